"""Opt-in tests on real pretrained weights (`-m real`), skipped unless `hf-kvmap obtain` converted the models.

    hf-kvmap obtain smollm2-135m-instruct        # and the two Qwen2.5-Coder sizes for the mapper tests
    HF_KVMAP_CACHE=... python -m pytest -m real tests/test_real_models.py

The Qwen mapper tests also need fitted mappers: `HF_KVMAP_REAL_WORK` names the work folder of
`python -m benchmarks.real family` (its `mappers/<direction>/<variant>/` folders). CI never downloads any of this.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hf_kvmap import MappedCache, MapperModel
from hf_kvmap._compat import cache_kwargs
from hf_kvmap.real import converted_path, is_converted

pytestmark = pytest.mark.real

SMOL = "smollm2-135m-instruct"
QWEN_SMALL, QWEN_LARGE = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"


def needs(*names):
    missing = [name for name in names if not is_converted(name)]
    return pytest.mark.skipif(bool(missing), reason=f"not obtained: {missing} (hf-kvmap obtain NAME)")


def load(name, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted_path(name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    return model, tokenizer


@pytest.fixture(scope="module")
def smol():
    if not is_converted(SMOL):
        pytest.skip(f"not obtained: {SMOL} (hf-kvmap obtain {SMOL})")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load(SMOL)
    torch.set_num_threads(threads)


def prefill(model, ids, mask=None):
    from hf_kvmap.rope import positions_from_attention_mask

    kwargs = {}
    if mask is not None:
        kwargs = {"attention_mask": mask, "position_ids": positions_from_attention_mask(mask, *ids.shape, ids.device)}
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **kwargs).past_key_values


def greedy(model, tokenizer, ids, mask=None, cache=None, new=24):
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            **cache_kwargs(cache),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )


PROSE = (
    "The lighthouse keeper wrote in the log every evening: the direction of the wind, the height of the waves, "
    "the ships that passed and the ones that did not. "
)


def chat_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt")["input_ids"]


@pytest.mark.parametrize("repeat", [1, 12], ids=["short", "about-400-tokens"])
def test_smol_identity_mapping_is_token_identical(smol, repeat):
    model, tokenizer = smol
    ids = chat_ids(tokenizer, [{"role": "user", "content": PROSE * repeat + "Summarize the log in one sentence."}])
    assert (repeat == 1 and ids.shape[1] < 120) or 350 <= ids.shape[1] <= 500
    cache = MappedCache.from_source(prefill(model, ids), MapperModel.identity(model.config))
    assert cache.get_seq_length() == ids.shape[1] - 1
    assert torch.equal(greedy(model, tokenizer, ids, cache=cache), greedy(model, tokenizer, ids))


def test_smol_identity_batched_left_padding(smol):
    model, tokenizer = smol
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        for text in ("What is a lighthouse?", PROSE * 3 + "Who wrote in the log?")
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert (mask == 0).any()  # the first row is padded on the left
    from hf_kvmap.rope import positions_from_attention_mask

    positions = positions_from_attention_mask(mask, *ids.shape, ids.device)  # as the prefill used them
    cache = MappedCache.from_source(
        prefill(model, ids, mask),
        MapperModel.identity(model.config),
        attention_mask=mask,
        source_position_ids=positions,
    )
    assert torch.equal(greedy(model, tokenizer, ids, mask, cache=cache), greedy(model, tokenizer, ids, mask))


def test_smol_identity_multi_turn_chat(smol):
    """Each turn maps the whole conversation so far and continues from it, as a handoff would mid-chat."""
    model, tokenizer = smol
    messages = [{"role": "user", "content": "My name is Ada and I keep a lighthouse. What do I do at night?"}]
    for question in ("What is my name?", "Name one thing I write in my log."):
        ids = chat_ids(tokenizer, messages)
        cache = MappedCache.from_source(prefill(model, ids), MapperModel.identity(model.config))
        mapped = greedy(model, tokenizer, ids, cache=cache, new=32)
        assert torch.equal(mapped, greedy(model, tokenizer, ids, new=32))
        reply = tokenizer.decode(mapped[0, ids.shape[1] :], skip_special_tokens=True)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
    assert len(chat_ids(tokenizer, messages)[0]) > 80


def test_smol_rerope_exact_at_layer_zero(smol):
    """Layer 0's content-space keys depend only on the embeddings, so re-roping SmolLM2's cache to another rope
    base must give the keys a copy of the model with that base computes."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = smol
    other_config = model.config.__class__.from_dict(model.config.to_dict())
    other_config.rope_parameters = {**model.config.rope_parameters, "rope_theta": 10_000.0}
    other = AutoModelForCausalLM.from_config(other_config, dtype=torch.float32).eval()
    other.load_state_dict(model.state_dict())
    ids = chat_ids(tokenizer, [{"role": "user", "content": PROSE * 4}])
    mapped = MappedCache.from_source(prefill(model, ids), MapperModel.identity(model.config, other_config))
    truth = prefill(other, ids).layers[0].keys[:, :, : ids.shape[1] - 1]
    original = prefill(model, ids).layers[0].keys[:, :, : ids.shape[1] - 1]
    error = ((mapped.layers[0].keys - truth).norm() / truth.norm()).item()
    assert error < 1e-5
    assert ((original - truth).norm() / truth.norm()).item() > 0.1  # the two bases do differ
    torch.testing.assert_close(mapped.layers[0].values, prefill(other, ids).layers[0].values[:, :, : ids.shape[1] - 1])


def test_smol_first_layer_from_the_ids_is_its_own(smol):
    """`target_first_layer` on real weights: SmolLM2's layer-0 keys and values computed from the ids of a ~400-token
    chat equal its own prefill's, and a handoff whose layer-0 map is wrecked generates the model's own tokens."""
    from hf_kvmap.first_layer import target_first_layer

    model, tokenizer = smol
    ids = chat_ids(tokenizer, [{"role": "user", "content": PROSE * 4}])
    own = prefill(model, ids).layers[0]
    keys, values = target_first_layer(model, ids, torch.arange(ids.shape[1]).expand_as(ids))
    assert ((keys - own.keys).norm() / own.keys.norm()).item() < 1e-5
    assert ((values - own.values).norm() / own.values.norm()).item() < 1e-5
    mapper = MapperModel.identity(model.config)
    with torch.no_grad():
        mapper.layers[0].key_proj.weight.mul_(-1.0)
    cache = MappedCache.from_source(
        prefill(model, ids), mapper, first_layer="target", target_model=model, input_ids=ids
    )
    assert torch.equal(greedy(model, tokenizer, ids, cache=cache), greedy(model, tokenizer, ids))


@needs(QWEN_SMALL)
def test_qwen_identity_mapping_is_token_identical():
    model, tokenizer = load(QWEN_SMALL, dtype=torch.bfloat16)
    ids = chat_ids(tokenizer, [{"role": "user", "content": "Write a Python function that reverses a string."}])
    cache = MappedCache.from_source(prefill(model, ids), MapperModel.identity(model.config))
    assert torch.equal(greedy(model, tokenizer, ids, cache=cache, new=16), greedy(model, tokenizer, ids, new=16))


def _mapper_folders():
    work = os.environ.get("HF_KVMAP_REAL_WORK")
    if not work:
        return []
    return sorted(p for p in Path(work).glob("mappers/*/*") if (p / "config.json").is_file())


@pytest.fixture(scope="module")
def qwen_pair():
    small, tokenizer = load(QWEN_SMALL, dtype=torch.bfloat16)
    large, _ = load(QWEN_LARGE, dtype=torch.bfloat16)
    return {"0.5b": small, "1.5b": large}, tokenizer


@needs(QWEN_SMALL, QWEN_LARGE)
@pytest.mark.skipif(not _mapper_folders(), reason="no fitted mappers (set HF_KVMAP_REAL_WORK)")
@pytest.mark.parametrize("folder", _mapper_folders(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_qwen_mappers_load_map_and_generate(folder, qwen_pair):
    by_size, tokenizer = qwen_pair
    source_name, target_name = folder.parent.name.split("-to-")
    source, target = by_size[source_name], by_size[target_name]
    mapper = MapperModel.from_pretrained(folder, dtype=torch.bfloat16)
    ids = chat_ids(tokenizer, [{"role": "user", "content": "def add(a, b):\n    return a + b\n\nExplain this."}])
    cache = MappedCache.from_source(prefill(source, ids), mapper)
    heads, dim = target.config.num_key_value_heads, target.config.hidden_size // target.config.num_attention_heads
    assert len(cache.layers) == target.config.num_hidden_layers
    for layer in cache.layers:
        assert layer.keys.shape == (1, heads, ids.shape[1] - 1, dim) and torch.isfinite(layer.keys).all()
    out = greedy(target, tokenizer, ids, cache=cache, new=8)
    assert out.shape == (1, ids.shape[1] + 8)
    if source is not target:  # the other model's cache has the wrong geometry and is refused
        with pytest.raises(ValueError, match="mapper expects"):
            MappedCache.from_source(prefill(target, ids), mapper)
