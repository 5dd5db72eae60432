"""A saved source cache served to an engine as a mapped prefix (`hf_kvmap.serving.engine_prefix`, the engine-free half
of the vLLM connector): the plan the scheduler makes from a file's metadata, every refusal, and the mapped K/V the
worker writes, against `MappedCache.from_source` on the shipped tiny-s -> tiny-l map. No vLLM needed."""

from __future__ import annotations

import pytest
import torch

from hf_kvmap import MappedCache, MapperModel, zoo
from hf_kvmap._compat import output_cache
from hf_kvmap.delivery import read_provenance, save_cache
from hf_kvmap.serving import engine_prefix as ep


@pytest.fixture(scope="module")
def pair():
    source, target = zoo.load_model("tiny-s"), zoo.load_model("tiny-l")
    mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-s", "tiny-l")).float()
    ids = zoo.load_tokenizer()("the cat sat on the mat and the dog ran to the park")["input_ids"]
    return source, target, mapper, ids


@pytest.fixture
def saved(pair, tmp_path):
    """A folder holding the source's own prefill of the prompt (`chat.safetensors`)."""
    source, _, _, ids = pair
    with torch.no_grad():
        cache = output_cache(source(torch.tensor([ids]), use_cache=True))
    save_cache(cache, tmp_path / "chat.safetensors", input_ids=torch.tensor([ids]), model=source)
    return tmp_path, cache


def _plan(folder, ids, mapper, name="chat.safetensors", computed=0, salt=None, prefix_caching=False):
    return ep.plan_prefix(folder, name, ids, computed, [mapper.config], salt=salt, prefix_caching=prefix_caching)


def test_the_plan_offers_every_covered_token_but_the_last_beyond_the_engines_own(pair, saved):
    _, _, mapper, ids = pair
    folder, _ = saved
    plan = _plan(folder, ids, mapper)
    assert (plan.start, plan.end, plan.num_tokens, plan.mapper) == (0, len(ids) - 1, len(ids) - 1, 0)
    assert plan.content_sha256 == read_provenance(folder / "chat.safetensors")["content_sha256"]
    assert _plan(folder, ids, mapper, computed=8).start == 8
    assert _plan(folder, ids, mapper, computed=len(ids)).num_tokens == 0  # the engine already holds it all
    longer = ids + [8, 9, 10]  # a prompt that goes on past the cache: still its first tokens
    assert _plan(folder, longer, mapper).end == len(ids) - 1


def test_the_request_carries_the_file_and_the_salt_of_its_content(pair, saved):
    _, _, mapper, ids = pair
    folder, _ = saved
    prompt, params = ep.prefix_request(folder, "chat.safetensors", ids)
    record = read_provenance(folder / "chat.safetensors")
    assert params == {"hf_kvmap": {"source_cache": "chat.safetensors"}}
    assert prompt == {"prompt_token_ids": ids, "cache_salt": "hf-kvmap:" + record["content_sha256"][len("sha256:") :]}
    assert ep.request_source_cache(params) == "chat.safetensors"
    assert ep.request_source_cache(None) is None and ep.request_source_cache({"other": 1}) is None
    plan = _plan(folder, ids, mapper, salt=prompt["cache_salt"], prefix_caching=True)
    assert plan.num_tokens == len(ids) - 1


@pytest.mark.parametrize(
    "case, message",
    [
        ("no salt", "cache_salt is None"),
        ("other salt", "cache_salt is 'hf-kvmap:0'"),
        ("other tokens", "other tokens than the first"),
        ("short prompt", "other tokens than the first"),
        ("escape", "not a file inside source_cache_dir"),
        ("absolute", "not a file inside source_cache_dir"),
        ("missing", "no such file"),
        ("mapped file", "approximate (mapped) cache"),
        ("other model", "no mapper maps its caches"),
    ],
)
def test_a_request_the_plan_cannot_serve_exactly_is_refused_by_name(pair, saved, case, message):
    source, target, mapper, ids = pair
    folder, cache = saved
    name, prompt, salt, prefix_caching = "chat.safetensors", list(ids), None, False
    if case in ("no salt", "other salt"):
        prefix_caching, salt = True, None if case == "no salt" else "hf-kvmap:0"
    elif case == "other tokens":
        prompt[3] = (prompt[3] + 1) % 50
    elif case == "short prompt":
        prompt = prompt[:-2]
    elif case == "escape":
        (folder / "inner").mkdir()
        name = "../" + folder.name + "/chat.safetensors"
        folder = folder / "inner"
    elif case == "absolute":
        name = str(folder / "chat.safetensors")
    elif case == "missing":
        name = "nothing.safetensors"
    elif case == "mapped file":
        mapped = MappedCache.from_source(cache, mapper)
        name = "mapped.safetensors"
        save_cache(mapped, folder / name, input_ids=torch.tensor([ids]))
    elif case == "other model":  # the target's own prefill: the map's source geometry and id are not its
        with torch.no_grad():
            own = output_cache(target(torch.tensor([ids]), use_cache=True))
        name = "target.safetensors"
        save_cache(own, folder / name, input_ids=torch.tensor([ids]), model=target)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _plan(folder, prompt, mapper, name=name, salt=salt, prefix_caching=prefix_caching)


def test_a_malformed_entry_is_refused():
    with pytest.raises(ValueError, match="must be \\{'source_cache'"):
        ep.request_source_cache({"hf_kvmap": {"source_cache": "a", "extra": 1}})


def test_the_mapper_is_the_one_whose_source_wrote_the_file(pair, saved):
    _, _, mapper, ids = pair
    folder, _ = saved
    other = MapperModel.from_pretrained(zoo.mapper_path("tiny-m", "tiny-l")).config
    plan = ep.plan_prefix(folder, "chat.safetensors", ids, 0, [other, mapper.config], salt=None, prefix_caching=False)
    assert plan.mapper == 1
    with pytest.raises(ValueError, match="2 mappers map its caches"):
        ep.plan_prefix(folder, "chat.safetensors", ids, 0, [mapper.config] * 2, salt=None, prefix_caching=False)


def test_the_mapped_prefix_is_from_sources_cache_exactly_token_major(pair, saved):
    _, _, mapper, ids = pair
    folder, cache = saved
    plan = _plan(folder, ids, mapper, computed=5)
    mapped = ep.map_prefix(folder / "chat.safetensors", plan, ids, mapper)
    with torch.no_grad():
        reference = MappedCache.from_source(cache, mapper)
    assert len(mapped) == len(reference.layers) == 6
    for (keys, values), layer in zip(mapped, reference.layers):
        assert keys.shape == (len(ids) - 1 - 5, 2, 32)
        assert torch.equal(keys, layer.keys[0, :, 5:].transpose(0, 1))
        assert torch.equal(values, layer.values[0, :, 5:].transpose(0, 1))
    assert ep.map_prefix(folder / "chat.safetensors", plan, ids, mapper, torch.bfloat16)[0][0].dtype == torch.bfloat16


def test_a_file_changed_after_planning_or_tampered_is_refused(pair, saved):
    source, _, mapper, ids = pair
    folder, cache = saved
    plan = _plan(folder, ids, mapper)
    with torch.no_grad():
        other = output_cache(source(torch.tensor([ids[:-1] + [ids[-2]]]), use_cache=True))
    save_cache(other, folder / "chat.safetensors", input_ids=torch.tensor([ids[:-1] + [ids[-2]]]), model=source)
    with pytest.raises(ValueError, match="changed after its request was planned"):
        ep.map_prefix(folder / "chat.safetensors", plan, ids, mapper)
    save_cache(cache, folder / "chat.safetensors", input_ids=torch.tensor([ids]), model=source)
    data = bytearray((folder / "chat.safetensors").read_bytes())
    data[-16] ^= 0xFF  # a byte of the last tensor: the metadata (and the plan) still read the same
    (folder / "chat.safetensors").write_bytes(bytes(data))
    plan = _plan(folder, ids, mapper)
    with pytest.raises(ValueError, match="modified or truncated"):
        ep.map_prefix(folder / "chat.safetensors", plan, ids, mapper)


def test_slots_follow_the_blocks_in_order():
    assert ep.slot_mapping([7, 3], 4, 2, 7) == [30, 31, 12, 13, 14]
    with pytest.raises(ValueError, match="need 3 blocks; the request holds 2"):
        ep.slot_mapping([7, 3], 4, 0, 9)
