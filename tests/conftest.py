"""Tiny models built from configs: the registry every architecture-parametrized test runs over."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import (
    GPTNeoXConfig,
    LlamaConfig,
    Ministral3Config,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from hf_kvmap._compat import cache_kwargs, output_cache


def pytest_configure(config):
    """Under pytest-xdist (`-n 2`, as CI runs the other transformers releases) the workers share the cores: one torch
    thread each instead of each spinning up as many as there are cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _qwen3(**kw):
    return Qwen3Config(**{**COMMON, "head_dim": 16, **kw})


# Architectures whose caches hf-kvmap maps exactly.
SUPPORTED = {
    "qwen3": lambda: _qwen3(),
    "qwen3-yarn": lambda: _qwen3(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    "llama": lambda: LlamaConfig(**COMMON),
    "llama3-scaling": lambda: LlamaConfig(
        **COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    "ministral3-yarn": lambda: Ministral3Config(
        **COMMON,
        head_dim=16,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    ),
    "qwen2-biased-k": lambda: Qwen2Config(**COMMON),
}

# Layouts that must be refused with a clear error, and a fragment of the message.
REFUSED = {
    "mistral-sliding-window": (lambda: MistralConfig(**COMMON, sliding_window=32), "sliding"),
    "qwen3-hybrid-layers": (
        lambda: _qwen3(
            use_sliding_window=True, sliding_window=32, layer_types=["sliding_attention", "full_attention"]
        ),
        "sliding",
    ),
    "gpt-neox-partial-rotary": (
        lambda: GPTNeoXConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
        ),
        "not supported",
    ),
}


VOCAB = 128


def tiny_config(layers=2, kv_heads=2, head_dim=16, heads=4, hidden=64, vocab=VOCAB, **fields) -> Qwen3Config:
    """A tiny Qwen3 config (the default architecture of the tests); `fields` are further config fields."""
    return _qwen3(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        **fields,
    )


def make_model(config=None, *, seed: int = 0, sharpen: bool = True, attn_implementation="eager", **config_fields):
    """A randomly initialized causal LM in eval mode, from `config` or from `tiny_config(**config_fields)`.

    With `sharpen`, the output embeddings are scaled by 20: a random init is near-uniform, and greedy decoding should
    not be decided by rounding noise.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(**config_fields) if config is None else config
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()
    if sharpen:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(20.0)
    return model


def make_batches(seed=1, count=4, size=4, length=48, vocab=VOCAB) -> list[torch.Tensor]:
    """`count` random `(size, length)` token-id batches."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (size, length), generator=generator) for _ in range(count)]


def make_left_padded_batch(lengths=(9, 14), vocab=VOCAB, seed=1):
    """Token ids and attention mask for a left-padded batch of random prompts."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def run_prefill(model, ids, mask=None):
    """The cache of `ids` (positions from the mask, as `generate` derives them, for a padded batch)."""
    kwargs = {}
    if mask is not None:
        position_ids = mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(mask == 0, 1)
        kwargs = {"attention_mask": mask, "position_ids": position_ids}
    with torch.no_grad():
        return output_cache(model(ids, use_cache=True, **kwargs))


def run_greedy(model, ids, mask=None, cache=None, new=8):
    """Greedy `generate` of `new` tokens, on top of `cache` when given."""
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, **cache_kwargs(cache)
    )


def run_greedy_probabilities(model, ids, mask=None, cache=None, new=3):
    """The next-token probabilities (float32, `(batch, new, vocab)`) of each step of a greedy `generate` of `new`
    tokens (no end-of-sequence stop), on top of `cache` when given: what `generate`'s own scores say."""
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_scores=True,
        **cache_kwargs(cache),
    )
    return torch.stack([score.float().softmax(-1) for score in out.scores], dim=1)


class Helpers:
    """What the tests share, handed out by the `tiny` fixture (test modules never import each other)."""

    COMMON = COMMON
    SUPPORTED = SUPPORTED
    REFUSED = REFUSED
    VOCAB = VOCAB
    config = staticmethod(tiny_config)
    model = staticmethod(make_model)
    batches = staticmethod(make_batches)
    left_padded_batch = staticmethod(make_left_padded_batch)
    prefill = staticmethod(run_prefill)
    greedy = staticmethod(run_greedy)
    greedy_probabilities = staticmethod(run_greedy_probabilities)
    fake_machine = staticmethod(lambda root, files=12: make_fake_machine(root, files))

    @staticmethod
    def arch_config(name: str = "qwen3"):
        """A fresh config of a registered architecture."""
        return SUPPORTED[name]()


@pytest.fixture(scope="session")
def tiny():
    """The one tiny-model factory and its companions: `tiny.model(config=None, seed=0, sharpen=True, **fields)`,
    `tiny.config(...)`, `tiny.batches(...)`, `tiny.left_padded_batch(...)`, `tiny.prefill`, `tiny.greedy`,
    `tiny.greedy_probabilities`, and the architecture registries `tiny.SUPPORTED` / `tiny.REFUSED`."""
    return Helpers


@pytest.fixture(params=sorted(SUPPORTED))
def arch(request):
    """The name of every supported architecture in turn."""
    return request.param


@pytest.fixture
def model_and_config(arch):
    config = SUPPORTED[arch]()
    return make_model(config), config


@pytest.fixture(params=sorted(REFUSED))
def refused(request):
    """`(config, message fragment)` of every layout that must be refused."""
    make, fragment = REFUSED[request.param]
    return make(), fragment


@pytest.fixture(scope="module")
def one_thread():
    """Small GEMMs: one thread is faster than two and immune to a busy second core (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# One MLP-fitting setup shared by the modules that test what a fitted MLP mapper does (module-scoped: fitted once
# per test module that asks for it).
@pytest.fixture(scope="module")
def mlp_pair(tiny):
    """A 2-layer source and a 3-layer target with mismatched KV geometry (4 heads x 8 vs 2 heads x 16)."""
    return tiny.model(tiny.config(vocab=64, layers=2)), tiny.model(
        tiny.config(vocab=64, layers=3, kv_heads=4, head_dim=8), seed=1
    )


@pytest.fixture(scope="module")
def calibration():
    """Two calibration batches of 4 x 48 random tokens (seeded)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 64, (4, 48), generator=generator) for _ in range(2)]


@pytest.fixture(scope="module")
def fitted(mlp_pair, calibration):
    """`(mapper, kwargs)`: a small MLP mapper fitted on `mlp_pair` and the keyword arguments it was fitted with."""
    from hf_kvmap import fit_mapper

    source, target = mlp_pair
    kwargs = dict(top_k=2, hidden_size=32, epochs=2, batch_tokens=64, val_fraction=0.25, seed=3, progress=False)
    return fit_mapper(source, target, calibration, kind="mlp", **kwargs), kwargs


# ---- shared set-ups (one place for what several test modules build the same way)


@pytest.fixture(scope="module")
def self_model(tiny):
    """A 3-layer random model whose output is sharpened, so greedy decoding is not decided by rounding noise."""
    model = tiny.model(sharpen=False, layers=3, seed=0)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model


@pytest.fixture(scope="module")
def random_pair(tiny):
    """A source and a deeper target with the same KV geometry (independent random weights)."""
    return tiny.model(sharpen=False, seed=0, layers=4), tiny.model(sharpen=False, seed=1, layers=3)


@pytest.fixture(scope="module")
def random_pair_stats(tiny, random_pair):
    from hf_kvmap import CalibrationStatistics

    source, target = random_pair
    return CalibrationStatistics.collect(source, target, tiny.batches(seed=2), stride=2, progress=False)


@pytest.fixture(scope="module")
def ladder_pair(tiny):
    """`(source, target, identity mapper)`: two 3-layer tiny models (seeds 1 and 0, sdpa attention) of one config,
    what the tests of the ladder's serving hand off."""
    from hf_kvmap import MapperModel

    config = tiny.config(layers=3)
    source = tiny.model(config, seed=1, attn_implementation="sdpa")
    return source, tiny.model(config, seed=0, attn_implementation="sdpa"), MapperModel.identity(config)


@pytest.fixture
def ladder_cli(tmp_path):
    """`(args, out, records)` of `hf-kvmap calibrate-ladder` on tiny-m -> tiny-l (`draft_agreement:2`, a 30 % rung,
    3 items a task), writing the mapper to `out` and the measurements to `records` under `tmp_path`."""
    out, records = tmp_path / "m2l", tmp_path / "records.jsonl"
    args = ["calibrate-ladder", "--source", "tiny-m", "--target", "tiny-l", "--items", "3", "--probes"]
    args += ["draft_agreement:2", "--fractions", "0.3", "--records", str(records), "--out", str(out)]
    return args, out, records


@pytest.fixture(scope="module")
def identity_handoff(tiny):
    """A 2-layer model handing off to itself through the identity mapper."""
    from hf_kvmap import MapperModel
    from hf_kvmap.evaluation import HandoffEvaluation
    from hf_kvmap.zoo import load_tokenizer

    tokenizer = load_tokenizer()
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = tiny.model(config, seed=2)
    return HandoffEvaluation(source=model, target=model, mapper=MapperModel.identity(config), tokenizer=tokenizer)


@pytest.fixture
def provenance_mapper(tiny):
    """An identity mapper carrying full provenance (model ids, revisions, tokenizer, calibration)."""
    from hf_kvmap import MapperModel
    from hf_kvmap.artifacts import tokenizer_fingerprint
    from hf_kvmap.zoo import load_tokenizer

    return MapperModel.identity(
        tiny.SUPPORTED["qwen3"](),
        source_model_id="org/small",
        source_revision="a" * 40,
        target_model_id="org/large",
        target_revision="b" * 40,
        tokenizer_fingerprint=tokenizer_fingerprint(load_tokenizer()),
        calibration={"tokens": 1234, "stride": 4, "fingerprint": "sha256:feed"},
    )


# The real-corpus pipeline on a stand-in machine: a fake standard library and /usr/share, a byte-level tokenizer
WORDS = "the keeper of the light wrote every evening about wind and waves and ships that passed".split()


def make_fake_machine(root: Path, files: int = 12) -> tuple[Path, Path]:
    """A stand-in standard library (Python files with docstrings) and a /usr/share with licenses and docs."""
    stdlib, share = root / "lib", root / "share"
    (stdlib / "pkg").mkdir(parents=True)
    (stdlib / "test").mkdir()
    (share / "common-licenses").mkdir(parents=True)
    for i in range(files):
        prose = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(60)) + "."
        code = f'"""Module {i}. {prose}"""\n'
        for k in range(8):
            code += f'\n\ndef function_{WORDS[k]}_{i}(value):\n    """{prose}"""\n    return value + {i * k}\n'
        (stdlib / "pkg" / f"mod{i}.py").write_text(code)
        (share / "common-licenses" / f"LICENSE-{i}").write_text(f"License {i}.\n\n" + (prose + "\n\n") * 6)
    (stdlib / "test" / "test_skipped.py").write_text("x = 1\n" * 1000)
    return stdlib, share


@pytest.fixture
def split_by_relative_path(monkeypatch, tmp_path):
    """Split the fake machine's files by their path under `tmp_path`, as the library splits absolute paths.

    The library hashes the absolute path; pytest's `tmp_path` changes from run to run, so without this the
    held-out share of a dozen fake files would be drawn anew each run (some runs hold out no code at all).
    """
    from hf_kvmap.real import corpus

    split_of = corpus._split_of

    def relative_split(path: str) -> str:
        relative = Path(path)
        return split_of(relative.relative_to(tmp_path).as_posix() if relative.is_relative_to(tmp_path) else path)

    monkeypatch.setattr(corpus, "_split_of", relative_split)


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE tokenizer trained here (every character round-trips), with a chat template."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([" ".join(WORDS) + " def return value"] * 10, vocab_size=300, special_tokens=["<eos>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>", pad_token="<eos>")
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tokenizer


@pytest.fixture(scope="module")
def ladder_family():
    """`(source, target, mapper, tokenizer, items)`: tiny-m -> tiny-l with its shipped mapper and tokenizer, and the
    exact-match items of the tiny family's recall and chat tasks (6 each, seed 77) as `LadderItem`s: what the tests of
    the ladder's measurement serve."""
    from hf_kvmap import MapperModel, zoo
    from hf_kvmap.calibration.ladder_items import LadderItem

    source, target = zoo.load_model("tiny-m"), zoo.load_model("tiny-l")
    mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-m", "tiny-l"))
    items = []
    for task in zoo.tiny_family_tasks(6, seed=77):
        if task.name in ("recall", "chat"):
            for item in task.items:
                prompt = getattr(item, "prompt", "") or item.context
                items.append(LadderItem(prompt, item.answer, getattr(item, "stop", "") or task.stop, task.name))
    return source, target, mapper, zoo.load_tokenizer(), items
