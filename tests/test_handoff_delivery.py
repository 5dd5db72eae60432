"""Cache delivery: safetensors round trip with provenance, and every refusal that keeps a wrong cache from serving."""

from __future__ import annotations

import json

import pytest
import torch

from hf_kvmap import MappedCache, MapperModel, load_cache, save_cache, zoo
from hf_kvmap._compat import cache_kwargs
from hf_kvmap.delivery import read_provenance
from hf_kvmap.zoo import corpus


@pytest.fixture(scope="module")
def pair(one_thread):
    source, target = zoo.load_model("tiny-m"), zoo.load_model("tiny-l")
    mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-m", "tiny-l"))
    tokenizer = zoo.load_tokenizer()
    ids = torch.tensor([tokenizer(corpus.make_eval_set("recall", 1, seed=3)[0].context)["input_ids"]])
    cache = MappedCache.from_source(source(input_ids=ids, use_cache=True).past_key_values, mapper)
    return source, target, mapper, ids, cache


def _generate(model, ids, cache):
    return model.generate(ids, **cache_kwargs(cache), max_new_tokens=6, do_sample=False, pad_token_id=0)


def test_mapped_cache_round_trip_is_exact(pair, tmp_path):
    _, target, _, ids, cache = pair
    path = tmp_path / "cache.safetensors"
    record = save_cache(cache, path, input_ids=ids)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.safetensors"]  # no temporary left, no pickle
    loaded, provenance = load_cache(path, input_ids=ids, model=target)
    assert isinstance(loaded, MappedCache)
    assert provenance == record == read_provenance(path)
    assert provenance["mapping_info"] == cache.mapping_info
    assert provenance["model_id"] == "hf_kvmap.zoo:tiny-l"
    assert provenance["geometry"]["seq_length"] == ids.shape[1] - 1
    for mine, theirs in zip(cache.layers, loaded.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    assert torch.equal(
        _generate(target, ids, loaded),
        _generate(
            target, ids, MappedCache.from_source(pair[0](input_ids=ids, use_cache=True).past_key_values, pair[2])
        ),
    )


def test_dynamic_cache_round_trip_records_the_model(pair, tmp_path):
    source, _, _, ids, _ = pair
    own = source(input_ids=ids[:, :-1], use_cache=True).past_key_values
    save_cache(own, tmp_path / "own.safetensors", input_ids=ids, model=source, provenance={"request": "r1"})
    loaded, provenance = load_cache(tmp_path / "own.safetensors", input_ids=ids, model=source)
    assert type(loaded).__name__ == "DynamicCache"
    assert provenance["cache_class"] == "DynamicCache" and provenance["provenance"] == {"request": "r1"}
    assert provenance["model_revision"] == zoo.weights_revision("tiny-m")
    assert torch.equal(_generate(source, ids, loaded), source.generate(ids, max_new_tokens=6, do_sample=False))


def test_tampered_file_is_refused(pair, tmp_path):
    _, _, _, ids, cache = pair
    path = tmp_path / "cache.safetensors"
    save_cache(cache, path, input_ids=ids)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # flip one bit in the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="modified or truncated"):
        load_cache(path)
    loaded, _ = load_cache(path, verify=False)  # inspection stays possible
    assert loaded.get_seq_length() == ids.shape[1] - 1


def test_wrong_prompt_or_covered_prompt_is_refused(pair, tmp_path):
    _, _, _, ids, cache = pair
    path = tmp_path / "cache.safetensors"
    save_cache(cache, path, input_ids=ids)
    other = ids.clone()
    other[0, 3] = (other[0, 3] + 1) % 50 + 3
    with pytest.raises(ValueError, match="other prompt tokens"):
        load_cache(path, input_ids=other)
    with pytest.raises(ValueError, match="at least seq \\+ 1"):
        load_cache(path, input_ids=ids[:, :-1])  # the cache would cover the whole prompt
    save_cache(cache, tmp_path / "anonymous.safetensors")
    with pytest.raises(ValueError, match="records no prompt tokens"):
        load_cache(tmp_path / "anonymous.safetensors", input_ids=ids)


def test_wrong_model_is_refused(pair, tmp_path):
    source, _, _, ids, cache = pair
    path = tmp_path / "cache.safetensors"
    save_cache(cache, path, input_ids=ids)
    with pytest.raises(ValueError, match="another model"):
        load_cache(path, model=source)  # tiny-m has 4 layers, the cache 6
    same_shape = zoo.load_model("tiny-l")
    same_shape.config.name_or_path = "someone/else"
    with pytest.raises(ValueError, match="model id"):
        load_cache(path, model=same_shape)


def test_not_a_cache_file_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "weights.safetensors"))
    with pytest.raises(ValueError, match="not an hf-kvmap cache"):
        load_cache(tmp_path / "weights.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="not a readable safetensors"):
        load_cache(tmp_path / "junk.safetensors")


def test_failed_save_keeps_the_previous_file(pair, tmp_path, monkeypatch):
    _, _, _, ids, cache = pair
    path = tmp_path / "cache.safetensors"
    save_cache(cache, path, input_ids=ids)
    before = path.read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_cache(cache, path, input_ids=ids)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.safetensors"]


def test_save_refuses_an_empty_cache_and_a_short_prompt(pair, tmp_path):
    from transformers import DynamicCache

    _, _, _, ids, cache = pair
    with pytest.raises(ValueError, match="prefilled cache"):
        save_cache(DynamicCache(), tmp_path / "empty.safetensors")
    with pytest.raises(ValueError, match="pass the prompt"):
        save_cache(cache, tmp_path / "short.safetensors", input_ids=ids[:, :5])


def test_left_padded_batch_round_trip(tmp_path, tiny, one_thread):
    config = tiny.config()
    model = tiny.model(config)
    from hf_kvmap.rope import positions_from_attention_mask

    ids, mask = tiny.left_padded_batch()
    positions = positions_from_attention_mask(mask, *ids.shape, ids.device)
    cache = MappedCache.from_source(
        model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True).past_key_values,
        MapperModel.identity(config),
        attention_mask=mask,
        source_position_ids=positions,
    )
    save_cache(cache, tmp_path / "batch.safetensors", input_ids=ids, attention_mask=mask)
    loaded, provenance = load_cache(tmp_path / "batch.safetensors", input_ids=ids, model=model)
    assert provenance["geometry"]["batch"] == 2
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **cache_kwargs(loaded), **kwargs), model.generate(ids, **kwargs))
    assert json.loads(json.dumps(provenance)) == provenance


def test_a_session_switch_sent_to_the_prefill_saves_as_the_models_own_cache(tmp_path, one_thread):
    """The ladder sent the switch to the model's own prefill: the object, its mapping_info and the file all say the
    cache is exact, and an exact-prefix lookup loads it; a switch that kept the mapping stays approximate everywhere."""
    from hf_kvmap import GuardLadder, HandoffSession, LadderRung

    source, target = zoo.load_model("tiny-m"), zoo.load_model("tiny-l")
    mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-m", "tiny-l"))
    tokenizer = zoo.load_tokenizer()
    first = tokenizer(corpus.make_eval_set("recall", 1, seed=3)[0].context)["input_ids"]
    lookahead = {"name": "lookahead_margin", "tokens": 2}
    for rungs, approximate in (([], False), ([LadderRung(2.0, 0.0)], True)):
        session = HandoffSession(
            {"m": source, "l": target}, {("m", "l"): mapper}, first[:-4], ladder=GuardLadder(lookahead, "tail", rungs)
        )
        session.respond("m", 3, pad_token_id=0)
        session.append(first[-4:])
        turn = session.sync("l")
        assert turn.rung == ("fallback" if not rungs else "mapped")
        cache = session.caches["l"]
        assert cache.approximate is approximate and cache.mapping_info["approximate"] is approximate
        path = tmp_path / f"switch-{approximate}.safetensors"
        record = save_cache(cache, path, input_ids=session.input_ids, model=target)
        assert record["approximate"] is approximate
        assert record["cache_class"] == ("MappedCache" if approximate else "DynamicCache")
        assert record["mapping_info"]["approximate"] is approximate
        if approximate:
            with pytest.raises(ValueError, match="approximate"):
                load_cache(path, input_ids=session.input_ids, model=target, exact=True)
        else:
            loaded, _ = load_cache(path, input_ids=session.input_ids, model=target, exact=True)
            assert loaded.approximate is False


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_cache_repaired_at_every_position_is_exact_in_the_object_the_record_and_the_file(pair, tmp_path, fraction):
    """Repair at fraction 1.0 recomputes every position: the target's own prefill (up to float rounding), so the cache
    is exact in the object, its mapping_info and its file; any smaller fraction leaves it approximate in all three."""
    from hf_kvmap import RepairConfig
    from hf_kvmap.repair import apply_repair

    source, target, mapper, ids, _ = pair
    source_cache = source(input_ids=ids, use_cache=True).past_key_values
    cache = MappedCache.from_source(source_cache, mapper, first_layer="target", target_model=target, input_ids=ids)
    apply_repair(target, cache, ids, RepairConfig("tail", fraction=fraction))
    exact = fraction == 1.0
    assert cache.mapping_info["repair"]["exact"] is exact
    assert cache.approximate is not exact and cache.mapping_info["approximate"] is not exact
    record = save_cache(cache, tmp_path / "repaired.safetensors", input_ids=ids, model=target)
    assert record["approximate"] is not exact and record["mapping_info"]["approximate"] is not exact
    if exact:
        loaded, _ = load_cache(tmp_path / "repaired.safetensors", input_ids=ids, model=target, exact=True)
        assert loaded.approximate is False
        assert torch.equal(_generate(target, ids, loaded), _generate(target, ids, None))
    else:
        with pytest.raises(ValueError, match="approximate"):
            load_cache(tmp_path / "repaired.safetensors", input_ids=ids, model=target, exact=True)
