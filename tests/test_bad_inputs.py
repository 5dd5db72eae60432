"""Bad input through the public API and the CLI, walked the way a user's mistakes arrive: each case gives the correct
result, or an error of a `ValueError`/`TypeError` kind whose message names the problem and the fix. Nothing is served
silently wrong: another prompt's cache, a NaN threshold, unmasked padding, a mapper of another target, an approximate
cache loaded as exact, a tampered record or config field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import BatchEncoding, DynamicCache

from hf_kvmap import HandoffRefusedError, HandoffSession, MappedCache, MapperModel, handoff
from hf_kvmap._compat import cache_kwargs
from hf_kvmap.artifacts import write_folder_atomically
from hf_kvmap.cli import main as cli_main
from hf_kvmap.delivery import load_cache, read_provenance, save_cache


@pytest.fixture(scope="module")
def pair(tiny, one_thread):
    """A random model twice under one config (seed 0 and 1), its identity mapper, and the config."""
    config = tiny.config()
    return tiny.model(config, seed=0), tiny.model(config, seed=1), MapperModel.identity(config), config


def ids_of(seed: int, length: int = 12, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------ 1. another prompt's cache


def test_a_cache_of_another_prompt_of_the_same_length_is_refused(pair, tiny):
    """Before: accepted (length only), and with an identity mapper certified "exact"; the answer was the other
    prompt's. After: layer 0 of the given cache is checked against `input_ids` at every position."""
    model, _, identity, _ = pair
    ids, other = ids_of(1), ids_of(2)
    with pytest.raises(ValueError, match="not the source's cache of these input_ids.*position"):
        handoff(
            model, model, identity, ids, source_cache=tiny.prefill(model, other), probe="prefix_audit", threshold=1
        )
    # one token changed late in the prompt (beyond any prefix audit) is caught too
    late = ids.clone()
    late[0, 9] = (late[0, 9] + 1) % 128
    with pytest.raises(ValueError, match="position 9"):
        handoff(model, model, identity, ids, source_cache=tiny.prefill(model, late), probe="prefix_audit", threshold=1)
    # the cache of these very tokens is served (exact), as before
    cache, report = handoff(model, model, identity, ids, source_cache=tiny.prefill(model, ids))
    assert report.accepted and report.reason.startswith("exact mapping")
    assert torch.equal(tiny.greedy(model, ids, cache=cache), tiny.greedy(model, ids))


def test_the_exact_certificate_reads_every_position(pair, tiny):
    """A mapped cache that is the target's own in the first 8 positions and wrong after is not certified exact."""
    model, _, identity, config = pair
    ids = ids_of(3, length=20)
    own = tiny.prefill(model, ids)
    for layer in own.layers:
        layer.keys[:, :, 12:] = layer.keys[:, :, 12:].flip(-1)
    from hf_kvmap.serving.pipeline import exactness_error

    cache = MappedCache.from_source(own, identity)
    error = exactness_error(model, ids, torch.ones_like(ids), cache, audit_tokens=8)
    assert error > 0.1


# ------------------------------------------------------------------------------------------- 2. a NaN threshold


@pytest.mark.parametrize("where", ["argument", "config"])
def test_a_nan_threshold_is_refused(pair, where):
    """Before: `risk > nan` is False, so everything was accepted. After: a ValueError naming the threshold."""
    model, other, identity, _ = pair
    mapper = MapperModel(identity.config.__class__.from_dict(identity.config.to_dict()))
    mapper.load_state_dict(identity.state_dict())
    kwargs = {"probe": "lookahead_margin", "threshold": float("nan")}
    if where == "config":
        mapper.config.handoff_probe = {"probe": {"name": "lookahead_margin", "tokens": 1}, "threshold": float("nan")}
        kwargs = {}
    with pytest.raises(ValueError, match="threshold=nan.*finite"):
        handoff(model, other, mapper, ids_of(4), **kwargs)


# ------------------------------------------------------------------------------------ 3. padding without a mask


def test_left_padding_without_a_mask_is_served_as_generate_reads_it(pair, tiny):
    """Before: the fallback prefill ignored the padding generate infers, rows differed, the report blamed the
    mapping. After: the mask is derived as `generate` derives it (pad token id != eos) and used throughout."""
    model, _, identity, _ = pair
    ids, mask = tiny.left_padded_batch(lengths=(9, 14))
    assert model.generation_config.pad_token_id == 0
    cache, report = handoff(model, model, identity, ids, probe="prefix_audit", threshold=-1.0, audit_tokens=0)
    assert not report.accepted and report.reason.startswith("probe refused")  # fallback prefill
    assert "attention_mask derived" in report.notes[0]
    assert torch.equal(
        model.generate(ids, **cache_kwargs(cache), max_new_tokens=6, do_sample=False),
        model.generate(ids, max_new_tokens=6, do_sample=False),
    )
    cache, report = handoff(model, model, identity, ids)
    assert report.accepted and report.reason.startswith("exact mapping")
    assert torch.equal(
        model.generate(ids, **cache_kwargs(cache), max_new_tokens=6, do_sample=False),
        model.generate(ids, max_new_tokens=6, do_sample=False),
    )


def test_pad_tokens_inside_a_prompt_without_a_mask_are_refused(pair):
    model, _, identity, _ = pair
    ids = ids_of(5)
    ids[0, 4] = 0  # the pad token id, where no left padding can be
    with pytest.raises(ValueError, match="pad token id 0.*attention_mask"):
        handoff(model, model, identity, ids)


# ------------------------------------------------------------------------------ 4. a session checks its mappers


def test_a_session_refuses_a_mapper_fitted_for_another_target(pair, tiny):
    model, _, identity, config = pair
    other = tiny.model(tiny.config(rope_parameters={"rope_type": "default", "rope_theta": 500.0}), seed=2)
    with pytest.raises(ValueError, match=r"(?s)\('a', 'b'\).*target rope_parameters"):
        HandoffSession({"a": model, "b": other}, {("a", "b"): identity})
    with pytest.raises(TypeError, match="MapperModel"):
        HandoffSession({"a": model, "b": model}, {("a", "b"): "mapper"})


# ---------------------------------------------------------------------------------- 5. what a session appends

BAD_APPENDS = {
    "two-row batch": (lambda: torch.ones(2, 3, dtype=torch.long), ValueError, "2 rows.*one conversation"),
    "float ids": (lambda: torch.tensor([3.0, 4.7]), TypeError, "float.*integer token ids"),
    "bool ids": (lambda: torch.tensor([True, False]), TypeError, "bool.*integer token ids"),
    "id past the vocabulary": (lambda: [3, 128], ValueError, "128.*vocabulary of 128"),
    "negative id": (lambda: [3, -1], ValueError, "-1.*vocabulary"),
    "string": (lambda: "hello", TypeError, "str.*tokenizer\\(text\\)\\['input_ids'\\]"),
    "float list": (lambda: [3.5], TypeError, "integer token ids"),
}


@pytest.mark.parametrize("case", sorted(BAD_APPENDS))
def test_session_append_refuses_what_is_not_one_row_of_token_ids(pair, case):
    model, _, identity, _ = pair
    session = HandoffSession({"a": model}, {})
    make, error, message = BAD_APPENDS[case]
    with pytest.raises(error, match=message):
        session.append(make())
    assert session.input_ids.shape == (1, 0)  # nothing was appended


def test_session_append_takes_a_batch_encoding_and_a_1_row_batch(pair):
    model, _, _, _ = pair
    session = HandoffSession({"a": model}, {})
    session.append(BatchEncoding({"input_ids": [[5, 6, 7]], "attention_mask": [[1, 1, 1]]}))
    session.append(torch.tensor([[8, 9]]))
    session.append([10])
    assert session.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]


# ------------------------------------------------------------------------------- 6. approximate caches say so


def test_a_sessions_mapped_cache_saves_and_loads_as_approximate(pair, tmp_path):
    model, other, _, config = pair
    mapper = MapperModel.identity(config)
    session = HandoffSession({"a": model, "b": other}, {("a", "b"): mapper})
    session.append(ids_of(6, length=10)[0])
    session.sync("a")  # a prefills 9 tokens
    session.append([5, 6, 7])
    session.sync("b")  # b maps a's 9, prefills 3
    cache = session.caches["b"]
    assert cache.get_seq_length() == 12 and cache.approximate and cache.mapping_info["mapped_tokens"] == 9
    record = save_cache(cache, tmp_path / "c.safetensors", input_ids=session.input_ids)
    assert record["approximate"] is True and record["mapping_info"]["mapped_positions"] == [[0, 9]]
    loaded, record = load_cache(tmp_path / "c.safetensors")
    assert isinstance(loaded, MappedCache) and loaded.approximate
    assert loaded.mapping_info["mapped_tokens"] == 9
    with pytest.raises(ValueError, match="approximate.*exact"):
        load_cache(tmp_path / "c.safetensors", exact=True)


def test_an_own_prefill_loads_as_exact(pair, tiny, tmp_path):
    model, _, _, _ = pair
    ids = ids_of(7)
    save_cache(tiny.prefill(model, ids[:, :-1]), tmp_path / "own.safetensors", input_ids=ids, model=model)
    loaded, record = load_cache(tmp_path / "own.safetensors", exact=True, input_ids=ids)
    assert type(loaded) is DynamicCache and record["approximate"] is False and loaded.approximate is False


# ------------------------------------------------------------------------ 7. the record is under the file's hash


def _rewrite_record(path, change):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from hf_kvmap.delivery import _METADATA_KEY

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(path))
    metadata[_METADATA_KEY] = change(metadata[_METADATA_KEY])
    save_file(tensors, str(path), metadata=metadata)


TAMPERS = {
    "cache class flipped to exact": lambda text: text.replace('"MappedCache"', '"DynamicCache"'),
    "approximate flipped": lambda text: text.replace('"approximate": true', '"approximate": false'),
    "provenance edited": lambda text: text.replace('"note": "x"', '"note": "y"'),
    "cache_class removed": lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "cache_class"}),
    "not JSON": lambda text: text[:-2],
}


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_a_tampered_record_is_refused(pair, tiny, tmp_path, case):
    model, _, identity, _ = pair
    ids = ids_of(8)
    cache = MappedCache.from_source(tiny.prefill(model, ids), identity)
    path = tmp_path / "c.safetensors"
    save_cache(cache, path, input_ids=ids, provenance={"note": "x"})
    before = json.dumps(read_provenance(path), sort_keys=True)
    _rewrite_record(path, TAMPERS[case])
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata()["hf_kvmap"] != before  # the record was changed
    with pytest.raises(ValueError, match="(modified|not valid JSON|lacks).*(Re-create|re-save)"):
        load_cache(path)


# ------------------------------------------------------------- 8. serving fields are under the mapper's hash

SERVING_EDITS = {
    "threshold": lambda c: c["handoff_probe"].update(threshold=1e9),
    "probe": lambda c: c["handoff_probe"]["probe"].update(tokens=99),
    "tokenizer_fingerprint": lambda c: c.update(tokenizer_fingerprint=None),
    "target_model_id": lambda c: c.update(target_model_id="someone/else"),
    "source_revision": lambda c: c.update(source_revision="0" * 40),
}


@pytest.mark.parametrize("case", sorted(SERVING_EDITS))
def test_an_edited_serving_field_fails_verification(pair, tmp_path, case):
    _, _, identity, config = pair
    mapper = MapperModel.identity(config, tokenizer_fingerprint="ab" * 32, target_model_id="tiny-target")
    mapper.config.source_revision = "1" * 40
    mapper.config.handoff_probe = {"probe": {"name": "lookahead_margin", "tokens": 1}, "threshold": 0.5}
    mapper.save_pretrained(tmp_path / "m")
    assert MapperModel.from_pretrained(tmp_path / "m").config.handoff_probe["threshold"] == 0.5
    path = tmp_path / "m" / "config.json"
    stored = json.loads(path.read_text())
    SERVING_EDITS[case](stored)
    path.write_text(json.dumps(stored))
    with pytest.raises(ValueError, match="serving fields.*modified.*re-save"):
        MapperModel.from_pretrained(tmp_path / "m")


# ----------------------------------------------------------------------------------- 9. clear loading errors


def _saved(config, folder, edit=None):
    MapperModel.identity(config).save_pretrained(folder)
    if edit is not None:
        path = folder / "config.json"
        stored = json.loads(path.read_text())
        edit(stored)
        path.write_text(json.dumps(stored))
    return folder


def _negative_heads(stored):
    stored["target_summary"]["num_key_value_heads"] = -2


LOAD_CASES = {
    "missing config.json": (lambda f: (f / "config.json").unlink(), "no config.json.*save_pretrained"),
    "source_layers all": (lambda f: None, "source_layers.*list of source-layer lists"),
    "edited layer_inputs": (lambda f: None, "modified"),
    "negative head counts": (lambda f: None, "num_key_value_heads=-2.*positive"),
}


@pytest.mark.parametrize("case", sorted(LOAD_CASES))
def test_from_pretrained_names_the_problem(pair, tmp_path, case):
    _, _, _, config = pair
    edits = {
        "source_layers all": lambda c: c.update(source_layers="all"),
        "edited layer_inputs": lambda c: c.update(layer_inputs={"1": {"key": {"context_window": 2}}}),
        "negative head counts": _negative_heads,
    }
    folder = _saved(config, tmp_path / "m", edits.get(case))
    LOAD_CASES[case][0](folder)
    with pytest.raises(ValueError, match=LOAD_CASES[case][1]):
        MapperModel.from_pretrained(folder)


def test_a_missing_local_path_is_not_called_a_bad_repo_id(tmp_path):
    with pytest.raises(ValueError, match=r"\./no-such-mapper: no such folder"):
        MapperModel.from_pretrained("./no-such-mapper")
    with pytest.raises(ValueError, match="no such folder"):
        MapperModel.from_pretrained(tmp_path / "absent")


HANDOFF_CASES = {
    "empty batch": (lambda: torch.zeros(0, 6, dtype=torch.long), ValueError, "empty batch"),
    "int32 ids": (lambda: ids_of(9).int(), None, None),
    "id past the embedding": (lambda: torch.tensor([[3, 4, 500, 6]]), ValueError, "500.*vocabulary of 128"),
    "float ids": (lambda: ids_of(9).float(), TypeError, "integer"),
    "1-D ids": (lambda: ids_of(9)[0], ValueError, r"\(batch, seq\)"),
}


@pytest.mark.parametrize("case", sorted(HANDOFF_CASES))
def test_handoff_input_ids(pair, tiny, case):
    model, _, identity, _ = pair
    make, error, message = HANDOFF_CASES[case]
    if error is None:  # int32 ids are served like int64 ones
        cache, report = handoff(model, model, identity, make())
        assert report.accepted and cache.get_seq_length() == 11
        return
    with pytest.raises(error, match=message):
        handoff(model, model, identity, make())


def test_from_source_needs_a_mapper(pair, tiny):
    model = pair[0]
    with pytest.raises(TypeError, match="mapper is None.*MapperModel"):
        MappedCache.from_source(tiny.prefill(model, ids_of(1)), None)


def test_beam_search_on_an_unexpanded_mapped_cache_is_refused_clearly(pair, tiny):
    model, _, identity, _ = pair
    ids = ids_of(10)
    cache = MappedCache.from_source(tiny.prefill(model, ids), identity)
    with pytest.raises(ValueError, match="batch_repeat_interleave"):
        model.generate(ids, **cache_kwargs(cache), num_beams=2, max_new_tokens=2, do_sample=False)
    cache = MappedCache.from_source(tiny.prefill(model, ids), identity)
    cache.batch_repeat_interleave(2)
    model.generate(ids, **cache_kwargs(cache), num_beams=2, max_new_tokens=2, do_sample=False)


# ------------------------------------------------------------------------------ 10. a local copy of the weights


def test_a_local_copy_is_named_the_same_weights_explicitly(pair, tmp_path, tiny):
    model, _, _, config = pair
    model.save_pretrained(tmp_path / "copy")
    from transformers import AutoModelForCausalLM

    copy = AutoModelForCausalLM.from_pretrained(tmp_path / "copy", attn_implementation="eager").eval()
    mapper = MapperModel.identity(config, source_model_id="org/model", target_model_id="org/model")
    ids = ids_of(11)
    cache, report = handoff(copy, copy, mapper, ids)
    assert not report.accepted and "same_weights=True" in report.reason  # the refusal says how to say it
    cache, report = handoff(copy, copy, mapper, ids, same_weights=True)
    assert report.accepted and report.same_weights
    assert mapper.check_compatible(copy, copy, same_weights=True) == []
    with pytest.raises(ValueError, match="same_weights=True"):
        HandoffSession({"a": copy, "b": copy}, {("a", "b"): mapper})
    HandoffSession({"a": copy, "b": copy}, {("a", "b"): mapper}, same_weights=True)
    # a cache saved for the original id loads into the copy only when told so
    save_cache(cache, tmp_path / "c.safetensors", input_ids=ids)
    assert cache.mapping_info["target_model_id"] == "org/model"
    with pytest.raises(ValueError, match="org/model.*same_weights=True"):
        load_cache(tmp_path / "c.safetensors", model=copy, input_ids=ids)
    loaded, _ = load_cache(tmp_path / "c.safetensors", model=copy, input_ids=ids, same_weights=True)
    assert loaded.approximate


# --------------------------------------------------------------------------- 11. an exact mapping needs no probe


def test_an_uncalibrated_exact_mapper_is_served(pair):
    model, other, identity, _ = pair
    assert identity.config.handoff_probe is None
    cache, report = handoff(model, model, identity, ids_of(12))
    assert report.accepted and report.reason.startswith("exact mapping") and report.probe is None
    near = MapperModel.identity(pair[3])
    with torch.no_grad():
        near.layers[1].key_proj.weight.mul_(1.05)  # close to exact, not exact
    with pytest.raises(ValueError, match="no calibrated handoff probe.*inexact.*calibrate_probe"):
        handoff(model, model, near, ids_of(12))
    with pytest.raises(ValueError, match="no calibrated handoff probe"):
        handoff(model, model, identity, ids_of(12), audit_tokens=0)
    with pytest.raises(HandoffRefusedError, match="gross mapping error"):  # another model's cache: refused
        handoff(other, model, identity, ids_of(12), policy="fail")


# ------------------------------------------------------------------------------- 12. stale files of killed saves


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_staging_folders_are_cleaned_and_a_live_one_kept(tmp_path):
    destination = tmp_path / "m"
    stale = [tmp_path / ".m.abc.saving", tmp_path / f".m.pid{_dead_pid()}.x1.saving"]
    live = tmp_path / f".m.pid{os.getpid()}.x2.saving"
    for folder in (*stale, live):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    write_folder_atomically(destination, lambda folder: (folder / "config.json").write_text("{}"))
    assert not any(folder.exists() for folder in stale) and live.exists()


def test_a_save_killed_between_the_swaps_restores_the_previous_mapper(tmp_path):
    """The previous folder was moved aside (`.m.<x>.old/folder`) when the process died: the next save puts it back
    first, and a save that then fails leaves it in place."""
    old = tmp_path / ".m.zz.old" / "folder"
    old.mkdir(parents=True)
    (old / "config.json").write_text('{"previous": true}')

    def failing(folder):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_folder_atomically(tmp_path / "m", failing)
    assert json.loads((tmp_path / "m" / "config.json").read_text()) == {"previous": True}
    assert not (tmp_path / ".m.zz.old").exists()


def test_stale_cache_temporary_files_are_cleaned(pair, tiny, tmp_path):
    model = pair[0]
    for name in (".c.safetensors.abc.tmp", f".c.safetensors.pid{_dead_pid()}.x.tmp"):
        (tmp_path / name).write_bytes(b"partial")
    save_cache(tiny.prefill(model, ids_of(1)), tmp_path / "c.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]


# ------------------------------------------------------------------------------------------------ the CLI


def _cli_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code not in (0, None)
    text = str(info.value.code) if isinstance(info.value.code, str) else capsys.readouterr().err
    assert "Traceback" not in text
    return text


def test_cli_eval_bad_tasks_files(tmp_path, capsys):
    (tmp_path / "latin1.jsonl").write_bytes('{"task": "caf\xe9"}\n'.encode("latin-1"))
    text = _cli_error(
        ["eval", "--source", "tiny-s", "--target", "tiny-l", "--tasks", str(tmp_path / "latin1.jsonl")], capsys
    )
    assert "UTF-8" in text and "latin1.jsonl" in text


@pytest.mark.parametrize("chance", [2.0, -1, "NaN"])
def test_eval_refuses_a_chance_outside_0_1(tmp_path, chance):
    from hf_kvmap.evaluation import load_jsonl_tasks

    row = {"task": "mc", "type": "choice", "context": "a", "choices": ["b", "c"], "label": 0, "chance": chance}
    text = json.dumps(row).replace('"NaN"', "NaN")
    (tmp_path / "t.jsonl").write_text(text + "\n")
    with pytest.raises(ValueError, match=r"chance.*between 0 and 1"):
        load_jsonl_tasks(tmp_path / "t.jsonl")


CLI_CASES = {
    "missing --mapper folder": (
        ["eval", "--source", "tiny-s", "--target", "tiny-l", "--mapper", "./no-mapper"],
        "no such folder",
    ),
    "typo in --source": (["eval", "--source", "tiny-q", "--target", "tiny-l"], "tiny-q.*tiny-s"),
    "benchmark --mapper missing": (
        ["benchmark", "--source", "tiny-s", "--target", "tiny-l", "--mapper", "./nope"],
        "no such folder",
    ),
    "card on a missing folder": (["card", "./no-mapper"], "no such folder"),
    "demo typo": (["demo", "--source", "tiny-q"], "tiny-q"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_arguments_fail_without_a_traceback(case, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv, message = CLI_CASES[case]
    import re

    assert re.search(message, _cli_error(argv, capsys))


def test_cli_fit_out_with_a_broken_config(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{broken")
    text = _cli_error(["fit", "--source", "a", "--target", "b", "--data", "d.txt", "--out", str(out)], capsys)
    assert "config.json" in text and "not valid JSON" in text


HANDOFF_ARGS = {
    "policy": ({"policy": "maybe"}, ValueError, "policy='maybe' is not one of"),
    "audit_tokens bool": ({"audit_tokens": True}, ValueError, "audit_tokens=True must be a non-negative integer"),
    "threshold string": ({"probe": "lookahead_margin", "threshold": "0.5"}, ValueError, "threshold='0.5'.*number"),
    "unknown probe": ({"probe": "no-such-probe", "threshold": 0.5}, ValueError, "no-such-probe"),
    "mask shape": ({"attention_mask": torch.ones(1, 5, dtype=torch.long)}, ValueError, "attention_mask has shape"),
    "mask values": ({"attention_mask": torch.full((1, 12), 2)}, ValueError, "only 0 and 1"),
    "right padding": (
        {"attention_mask": torch.tensor([[1] * 10 + [0, 0]])},
        ValueError,
        "right padding.*padding_side='left'",
    ),
    "short source cache": ({"source_cache": "short"}, ValueError, "covers 11 tokens but input_ids has 12"),
}


@pytest.mark.parametrize("case", sorted(HANDOFF_ARGS))
def test_handoff_arguments(pair, tiny, case):
    model, _, identity, _ = pair
    kwargs, error, message = HANDOFF_ARGS[case]
    ids = ids_of(13)
    if kwargs.get("source_cache") == "short":
        kwargs = {"source_cache": tiny.prefill(model, ids[:, :-1])}
    with pytest.raises(error, match=message):
        handoff(model, model, identity, ids, policy=kwargs.pop("policy", "fail"), **kwargs)


def test_handoff_needs_a_mapper(pair):
    model = pair[0]
    with pytest.raises(TypeError, match="MapperModel"):
        handoff(model, model, None, ids_of(1))


SAVE_CASES = {
    "empty cache": (lambda m, ids: (DynamicCache(), {}), "prefilled cache"),
    "short prompt": (lambda m, ids: (None, {"input_ids": ids[:, :4]}), "pass the prompt the cache was built from"),
    "not a cache": (lambda m, ids: ([1, 2], {}), "prefilled cache"),
}


@pytest.mark.parametrize("case", sorted(SAVE_CASES))
def test_save_cache_refuses(pair, tiny, tmp_path, case):
    model = pair[0]
    ids = ids_of(14)
    cache, kwargs = SAVE_CASES[case][0](model, ids)
    cache = tiny.prefill(model, ids) if cache is None else cache
    with pytest.raises(ValueError, match=SAVE_CASES[case][1]):
        save_cache(cache, tmp_path / "c.safetensors", **kwargs)
    assert not (tmp_path / "c.safetensors").exists()


def test_load_cache_refuses_what_is_not_a_cache_file(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_cache(tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_cache(tmp_path / "missing.safetensors")


# ------------------------------------------------------------------- 13. a saved config that is not a mapper's


CONFIG_EDITS = {
    "a list": (lambda stored: [stored], r"config.json holds a JSON list, not a mapper config"),
    "no source_layers": (
        lambda stored: stored.pop("source_layers") and stored,
        r"config.json records no `source_layers`",
    ),
    "no target_summary": (lambda stored: stored.pop("target_summary") and stored, r"records no `target_summary`"),
    "not JSON": (lambda stored: "{broken", r"config.json is not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_EDITS))
def test_a_damaged_config_json_is_named(tiny, tmp_path, case):
    """Before: a list gave a raw TypeError, a lost `source_layers` a message about a layer of the target (or, for an
    identity, a silent load). After: the file and the missing field, and how to get a good one."""
    config = tiny.config(layers=4)
    mapper = MapperModel.identity(config)
    mapper.save_pretrained(tmp_path / "m")
    MapperModel.from_pretrained(tmp_path / "m")  # the control: the saved folder loads
    path = tmp_path / "m" / "config.json"
    edited = CONFIG_EDITS[case][0](json.loads(path.read_text()))
    path.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(ValueError, match=CONFIG_EDITS[case][1] + ".*re-save the mapper"):
        MapperModel.from_pretrained(tmp_path / "m")


def test_same_weights_is_suggested_only_for_a_model_that_could_be_a_copy(pair, tiny, tmp_path):
    """Before: every id mismatch ended in "pass same_weights=True", also below a geometry line showing another model.
    After: only where type, geometry and rope match."""
    from transformers import AutoModelForCausalLM

    model, _, _, config = pair
    mapper = MapperModel.identity(config, source_model_id="org/model", target_model_id="org/model")

    def loaded(model, name):  # a model loaded from a folder: its id is the folder
        model.save_pretrained(tmp_path / name)
        return AutoModelForCausalLM.from_pretrained(tmp_path / name)

    copy = loaded(model, "copy")
    same = mapper.check_compatible(copy, copy, allow_mismatch=True)
    assert any("same_weights=True" in problem for problem in same)  # the control: a possible copy
    other = loaded(tiny.model(tiny.config(kv_heads=1)), "other")
    problems = mapper.check_compatible(other, other, allow_mismatch=True)
    assert any("geometry" in problem for problem in problems) and any(" id:" in problem for problem in problems)
    assert not any("same_weights=True" in problem for problem in problems)


# ---------------------------------------------------------------- 14. command-line arguments and output paths


@pytest.fixture
def no_models(monkeypatch):
    """Loading a model fails the test: a bad argument must be refused before any model loads."""
    from hf_kvmap.commands import models

    def refuse(*args, **kwargs):
        raise RuntimeError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_causal_lm", refuse)


LADDER = ["calibrate-ladder", "--source", "tiny-s", "--target", "tiny-l"]
EVAL = ["eval", "--source", "tiny-s", "--target", "tiny-l"]
BENCH = ["benchmark", "--source", "tiny-s", "--target", "tiny-l"]
FIT = ["fit", "--source", "tiny-s", "--target", "tiny-l", "--data", "d.txt", "--out", "m"]
# case: (the bad command line, what its error says, the control command line, the attribute it sets and to what)
CLI_WALK = {
    "calibrate-ladder --out a file": (
        [*LADDER, "--out", "{tmp}/file.txt"],
        r"argument --out: .*file.txt is a file",
        [*LADDER, "--out", "{tmp}/new"],
        ("out", "{tmp}/new"),
    ),
    "calibrate-ladder --out a folder of other files": (
        [*LADDER, "--out", "{tmp}/notes"],
        r"argument --out: .*notes holds files that are not part of a mapper \(notes.txt\)",
        [*LADDER, "--out", "{tmp}/mapper"],
        ("out", "{tmp}/mapper"),
    ),
    "calibrate-ladder --json a folder": (
        [*LADDER, "--out", "{tmp}/new", "--json", "{tmp}"],
        r"argument --json: .* is a folder; name the file",
        [*LADDER, "--out", "{tmp}/new", "--json", "{tmp}/summary.json"],
        ("json", "{tmp}/summary.json"),
    ),
    "calibrate-ladder --records a folder": (
        [*LADDER, "--out", "{tmp}/new", "--records", "{tmp}"],
        r"argument --records: .* is a folder",
        [*LADDER, "--out", "{tmp}/new", "--records", "{tmp}/records.jsonl"],
        ("records", "{tmp}/records.jsonl"),
    ),
    "calibrate-ladder --items 0": (
        [*LADDER, "--out", "{tmp}/new", "--items", "0"],
        r"argument --items: 0 must be a positive integer",
        [*LADDER, "--out", "{tmp}/new", "--items", "3"],
        ("items", 3),
    ),
    "calibrate-ladder --items -3": (
        [*LADDER, "--out", "{tmp}/new", "--items", "-3"],
        r"argument --items: -3 must be a positive integer",
        [*LADDER, "--out", "{tmp}/new", "--items", "1"],
        ("items", 1),
    ),
    "calibrate-ladder --strategies bad JSON": (
        [*LADDER, "--out", "{tmp}/new", "--strategies", "[{bad json"],
        r"argument --strategies: '\[\{bad json' starts a JSON list but is not valid JSON",
        [*LADDER, "--out", "{tmp}/new", "--strategies", '[{"name": "tail"}]'],
        ("strategies", [{"name": "tail"}]),
    ),
    "calibrate-ladder --fractions abc": (
        [*LADDER, "--out", "{tmp}/new", "--fractions", "abc"],
        r"argument --fractions: 'abc' is not a number",
        [*LADDER, "--out", "{tmp}/new", "--fractions", "0.1,0.3"],
        ("fractions", [0.1, 0.3]),
    ),
    "calibrate-ladder --fractions 1.5": (
        [*LADDER, "--out", "{tmp}/new", "--fractions", "0.1,1.5"],
        r"argument --fractions: 1.5 in '0.1,1.5' is not in \[0, 1\)",
        [*LADDER, "--out", "{tmp}/new", "--fractions", "0.5"],
        ("fractions", [0.5]),
    ),
    "calibrate-ladder --probes lookahead_margin:x": (
        [*LADDER, "--out", "{tmp}/new", "--probes", "lookahead_margin:x"],
        r"argument --probes: 'lookahead_margin:x': the tokens after ':' must be a positive integer",
        [*LADDER, "--out", "{tmp}/new", "--probes", "lookahead_margin:1"],
        ("probes", "lookahead_margin:1"),
    ),
    "eval --json a folder": (
        [*EVAL, "--json", "{tmp}"],
        r"argument --json: .* is a folder",
        [*EVAL, "--json", "{tmp}/r.json"],
        ("json", "{tmp}/r.json"),
    ),
    "eval --plot a folder": (
        [*EVAL, "--plot", "{tmp}"],
        r"argument --plot: .* is a folder",
        [*EVAL, "--plot", "{tmp}/r.png"],
        ("plot", "{tmp}/r.png"),
    ),
    "eval --json below a file": (
        [*EVAL, "--json", "{tmp}/file.txt/r.json"],
        r"argument --json: .*file.txt is a file, not a folder",
        [*EVAL, "--json", "{tmp}/sub/r.json"],
        ("json", "{tmp}/sub/r.json"),
    ),
    "eval --items 0": ([*EVAL, "--items", "0"], r"argument --items: 0 must be", [*EVAL, "--items", "2"], ("items", 2)),
    "benchmark --threads -1": (
        [*BENCH, "--threads", "-1"],
        r"argument --threads: -1 must be a positive integer",
        [*BENCH, "--threads", "1"],
        ("threads", 1),
    ),
    "benchmark --repeats abc": (
        [*BENCH, "--repeats", "abc"],
        r"argument --repeats: 'abc' is not an integer",
        [*BENCH, "--repeats", "2"],
        ("repeats", 2),
    ),
    "benchmark --json a folder": (
        [*BENCH, "--json", "{tmp}"],
        r"argument --json: .* is a folder",
        [*BENCH, "--json", "{tmp}/b.json"],
        ("json", "{tmp}/b.json"),
    ),
    "fit --stats a folder of other files": (
        [*FIT, "--stats", "{tmp}/notes"],
        r"argument --stats: .*notes holds files that are not calibration statistics \(notes.txt\)",
        [*FIT, "--stats", "{tmp}/stats"],
        ("stats", "{tmp}/stats"),
    ),
    "fit --from-stats a file": (
        [*FIT, "--from-stats", "{tmp}/file.txt"],
        r"argument --from-stats: .*file.txt: not a folder; name the folder `--stats` wrote",
        [*FIT, "--from-stats", "{tmp}/saved-stats"],
        ("from_stats", "{tmp}/saved-stats"),
    ),
    "obtain --cache-dir a file": (
        ["obtain", "--list", "--cache-dir", "{tmp}/file.txt"],
        r"argument --cache-dir: .*file.txt is a file; name a folder",
        ["obtain", "--list", "--cache-dir", "{tmp}/cache"],
        ("cache_dir", "{tmp}/cache"),
    ),
    "obtain --download-dir below a file": (
        ["obtain", "--list", "--download-dir", "{tmp}/file.txt/wheels"],
        r"argument --download-dir: .*file.txt is a file, not a folder",
        ["obtain", "--list", "--download-dir", "{tmp}/wheels"],
        ("download_dir", "{tmp}/wheels"),
    ),
    "pair unknown model": (
        ["pair", "qwen-9b", "qwen2.5-coder-1.5b-instruct", "--out", "{tmp}/new"],
        r"argument source: unknown model 'qwen-9b'; the registered models are .*qwen2.5-coder-0.5b-instruct",
        ["pair", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "--out", "{tmp}/new"],
        ("source", "qwen2.5-coder-0.5b-instruct"),
    ),
    "pair --out a file": (
        ["pair", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "--out", "{tmp}/file.txt"],
        r"argument --out: .*file.txt is a file; name a folder",
        ["pair", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "--out", "{tmp}/new"],
        ("out", "{tmp}/new"),
    ),
    "card --results missing": (
        ["card", "{tmp}/mapper", "--results", "{tmp}/missing.json"],
        r"argument --results: .*missing.json: no such file",
        ["card", "{tmp}/mapper", "--results", "{tmp}/results.json"],
        ("results", "{tmp}/results.json"),
    ),
}


def _walk_folder(tmp_path, pair) -> dict:
    (tmp_path / "file.txt").write_text("a file")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("mine")
    (tmp_path / "results.json").write_text("{}")
    (tmp_path / "saved-stats").mkdir()
    (tmp_path / "saved-stats" / "statistics.json").write_text("{}")
    MapperModel.identity(pair[3]).save_pretrained(tmp_path / "mapper")
    return {"{tmp}": str(tmp_path)}


def _fill(value, names: dict):
    if isinstance(value, str):
        for name, replacement in names.items():
            value = value.replace(name, replacement)
    return value


@pytest.mark.parametrize("case", sorted(CLI_WALK))
def test_cli_refuses_bad_arguments_before_any_work(case, pair, tmp_path, capsys, no_models):
    """Before: these were accepted and failed late (after minutes of measuring, or after the mapper was written) or
    with a traceback, or named the value and not the flag. After: refused while parsing, by flag and value."""
    import re

    from hf_kvmap.cli import build_parser

    names = _walk_folder(tmp_path, pair)
    bad, message, control, (attribute, expected) = CLI_WALK[case]
    text = _cli_error([_fill(arg, names) for arg in bad], capsys)
    assert re.search(message, text), text
    assert not (tmp_path / "new").exists() and (tmp_path / "notes" / "notes.txt").read_text() == "mine"
    parsed = getattr(build_parser().parse_args([_fill(arg, names) for arg in control]), attribute)
    if attribute == "strategies":
        parsed = [{"name": strategy["name"]} for strategy in parsed]
    elif attribute == "probes":
        parsed = ",".join(f"{probe.name}:{probe.tokens}" for probe in parsed)
    elif isinstance(parsed, os.PathLike):
        parsed = str(parsed)
    assert parsed == _fill(expected, names)


CARD_RESULTS = {
    "invalid JSON": ("{not json", r"--results .*results.json is not valid JSON"),
    "a list": ("[1, 2]", r"--results .*results.json holds a JSON list, not an object of results"),
}


@pytest.mark.parametrize("case", sorted(CARD_RESULTS))
def test_cli_card_names_a_bad_results_file(case, pair, tmp_path, capsys):
    names = _walk_folder(tmp_path, pair)
    mapper = tmp_path / "mapper"
    text, message = CARD_RESULTS[case]
    (tmp_path / "results.json").write_text(text)
    import re

    assert re.search(message, _cli_error(["card", str(mapper), "--results", str(tmp_path / "results.json")], capsys))
    # the control: results that record this mapper's content hash are rendered and stored beside it
    recorded = json.loads((mapper / "config.json").read_text())["content_hash"]
    (tmp_path / "results.json").write_text(json.dumps({"run": {"mapper_content_hash": recorded}, "tasks": {}}))
    assert cli_main(["card", _fill("{tmp}/mapper", names), "--results", str(tmp_path / "results.json")]) == 0
    assert json.loads((mapper / "evaluation.json").read_text())["run"]["mapper_content_hash"] == recorded


def test_cli_calibrate_ladder_refuses_a_garbage_records_file_before_loading_models(tmp_path, capsys, no_models):
    (tmp_path / "records.jsonl").write_text('{"task": "a"}\nnot json at all\n')
    text = _cli_error([*LADDER, "--out", str(tmp_path / "new"), "--records", str(tmp_path / "records.jsonl")], capsys)
    assert "records.jsonl:2: not valid JSON" in text and "Pass a new file" in text
    assert (tmp_path / "records.jsonl").read_text() == '{"task": "a"}\nnot json at all\n'  # left as it was


@pytest.mark.parametrize("flag", ["--records", "--json"])
def test_cli_calibrate_ladder_keeps_its_files_out_of_the_folder_it_replaces(flag, tmp_path, capsys, no_models):
    argv = [*LADDER, "--out", str(tmp_path / "m"), flag, str(tmp_path / "m" / "f.json")]
    text = _cli_error(argv, capsys)
    assert f"{flag} " in text and "lies inside --out" in text and "keep it beside the folder" in text
    # the control: beside the folder, the same command goes on to load the models
    with pytest.raises(RuntimeError, match="a model was loaded"):
        cli_main([*LADDER, "--out", str(tmp_path / "m"), flag, str(tmp_path / "f.json")])


def test_a_records_file_cut_off_by_a_stopped_run_resumes(tmp_path, capsys):
    """The control of the garbage case: a record cut off mid-line by a stopped run is dropped (and measured again);
    the complete ones are kept, and a complete last record without its newline gets one."""
    from hf_kvmap.commands.ladder import _records

    path = tmp_path / "records.jsonl"
    path.write_text('{"task": "a"}\n{"task": "b"}\n{"task": "c", "answ')
    assert _records(path) == [{"task": "a"}, {"task": "b"}]
    assert path.read_text() == '{"task": "a"}\n{"task": "b"}\n' and "incomplete record" in capsys.readouterr().out
    path.write_text('{"task": "a"}')
    assert _records(path) == [{"task": "a"}] and path.read_text() == '{"task": "a"}\n'
    path.write_text("garbage without a newline")  # not a stopped run of this command: refused, not cut
    with pytest.raises(SystemExit, match="not a records file"):
        _records(path)
    assert path.read_text() == "garbage without a newline"


def test_cli_card_names_its_folder_not_a_flag_it_does_not_have(pair, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("a file")
    text = _cli_error(["card", str(tmp_path / "file.txt")], capsys)
    assert "file.txt is a file, not a mapper folder" in text and "--mapper" not in text
    MapperModel.identity(pair[3]).save_pretrained(tmp_path / "m")
    assert cli_main(["card", str(tmp_path / "m")]) == 0  # the control: a mapper folder's card is rendered


def test_cli_fit_from_damaged_statistics_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "stats").mkdir()
    text = _cli_error(["fit", "--out", str(tmp_path / "m"), "--from-stats", str(tmp_path / "stats")], capsys)
    assert "--from-stats" in text and "holds no statistics.json" in text
    (tmp_path / "stats" / "statistics.json").write_text("{}")
    text = _cli_error(["fit", "--out", str(tmp_path / "m"), "--from-stats", str(tmp_path / "stats")], capsys)
    assert "--from-stats" in text and "format_version" in text


def test_cli_eval_plot_without_diagnostics_is_refused_before_any_model_loads(tmp_path, capsys, no_models):
    """Before: the evaluation ran and no plot was written, silently."""
    text = _cli_error([*EVAL, "--plot", str(tmp_path / "d.png")], capsys)
    assert "--plot draws the diagnostics" in text and "--diagnostics N" in text
    with pytest.raises(RuntimeError, match="a model was loaded"):  # the control: with --diagnostics it goes on
        cli_main([*EVAL, "--plot", str(tmp_path / "d.png"), "--diagnostics", "2"])


# ---------------------------------------------------------------- 15. model output executed by the HumanEval judge

ADD = {
    "task_id": "Demo/0",
    "prompt": 'def add(a, b):\n    """The sum of a and b."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-4, 4) == 0\n",
}
RIGHT = "    return a + b\n"
#: what each run of a guard test uses: the whole judge, the interpreter's guard alone (no namespaces), the
#: namespaces alone (no interpreter guard; only where this system can create them)
LAYERS = {"judge": {}, "interpreter guard alone": {"namespaces": False}, "namespaces alone": {"guard": False}}


def _judge(completion: str, layers: str = "judge", timeout: float = 10.0):
    from lab.real.humaneval import program
    from lab.real.judge import namespace_command, run_program

    if layers == "namespaces alone" and not namespace_command():
        pytest.skip("this system cannot create network and PID namespaces (`unshare`)")
    return run_program(program(ADD, completion), ADD["entry_point"], timeout, **LAYERS[layers])


def _body(code: str) -> str:
    """`code` as the body of `add`, ahead of the right answer."""
    return "".join(f"    {line}\n" for line in code.strip().splitlines()) + RIGHT


def test_the_judge_passes_a_right_completion_and_nothing_else():
    """The controls of every guard case below: a right completion passes (also one that uses the standard library's
    frame readers, namedtuple and the functional Enum), a wrong one, an error, a timeout and a syntax error do not."""
    from lab.real.humaneval import judge

    assert judge(ADD, RIGHT).passed and judge(ADD, RIGHT).reason == "passed"
    library = "from collections import namedtuple\nimport enum\nP = namedtuple('P', 'x')\nenum.Enum('E', 'a b')"
    assert judge(ADD, _body(library)).passed
    assert judge(ADD, "    return a - b\n").reason == "failed (exit code 1)"
    assert "ZeroDivisionError" in judge(ADD, "    return a / 0\n").stderr
    assert judge(ADD, "    while True:\n        pass\n", timeout=1).reason == "timed out after 1 s"
    assert "SyntaxError" in judge(ADD, "    return a +\n").stderr


FAKED_PASSES = {
    "sys.exit(0) in the body": "import sys\nsys.exit(0)",
    "raise SystemExit(0)": "raise SystemExit(0)",
    "os._exit(0) in the body": "import os\nos._exit(0)",
    "an atexit hook calling os._exit(0)": "import atexit, os\natexit.register(lambda: os._exit(0))\nreturn 0",
    "a wrong answer printing a marker-like line": "import secrets\nprint(secrets.token_hex(16))\nreturn 0",
    "a wrong answer reading standard input": "import sys\nprint(sys.stdin.read())\nreturn 0",
    "a wrong answer reading /proc/self/fd/0": "print(open('/proc/self/fd/0').read())\nreturn 0",
    "a walk up the frames": "import sys\nf = sys._getframe()\nwhile f.f_back: f = f.f_back\nprint(f.f_locals)\nreturn 0",
    "inspect.stack": "import inspect\nprint([f.frame.f_locals for f in inspect.stack()])\nreturn 0",
    "the objects gc knows": "import gc\nprint([o for o in gc.get_objects() if isinstance(o, dict)])\nreturn 0",
    "a signal handler's frame": "import signal\nsignal.signal(signal.SIGALRM, lambda s, f: print(f.f_back))\nreturn 0",
    "ctypes": "import ctypes\nreturn 0",
}


@pytest.mark.parametrize("case", sorted(FAKED_PASSES))
def test_an_exit_code_or_a_guessed_line_is_no_pass(case):
    """Before: exit code 0 was the pass, so `sys.exit(0)` or an atexit `os._exit(0)` passed a wrong answer. After:
    only the run's random marker, printed by the harness after `check` returns, is a pass; the completion cannot read
    it back (stdin is /dev/null before it runs; frames, gc, signal handlers, ctypes and /proc are refused)."""
    judgement = _judge(_body(FAKED_PASSES[case]) if "return 0" not in FAKED_PASSES[case] else _body_only(case))
    assert not judgement.passed and judgement.reason.startswith("failed")
    assert _judge(RIGHT).passed  # the control


def _body_only(case: str) -> str:
    return "".join(f"    {line}\n" for line in FAKED_PASSES[case].splitlines())


@pytest.mark.parametrize("layers", ["judge", "interpreter guard alone"])
@pytest.mark.parametrize("how", ["os.remove", "posix.unlink", "pathlib", "shutil.rmtree", "open for writing"])
def test_a_completion_deletes_nothing_outside_its_folder(how, layers, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    code = {
        "os.remove": f"import os\nos.remove({str(victim)!r})",
        "posix.unlink": f"import posix\nposix.unlink({str(victim)!r})",
        "pathlib": f"import pathlib\npathlib.Path({str(victim)!r}).unlink()",
        "shutil.rmtree": f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        "open for writing": f"open({str(victim)!r}, 'w').write('gone')",
    }[how]
    judgement = _judge(_body(code), layers)
    assert not judgement.passed and ("PermissionError" in judgement.stderr or "TypeError" in judgement.stderr)
    assert victim.read_text() == "keep"
    assert _judge(_body("open('mine.txt', 'w').write('x')\nimport os\nassert os.listdir('.')"), layers).passed


def test_a_completion_finds_neither_the_callers_folder_nor_home_nor_environment(tmp_path, monkeypatch):
    """Before: `$PWD` led to the caller's working folder, `~` and the environment were the caller's. After: the
    environment is scrubbed and HOME, TMPDIR, PWD and the working folder are the run's own temporary folder."""
    (tmp_path / "mine.txt").write_text("keep")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HF_KVMAP_SECRET", "s3cret")
    show = "import os\nprint(os.environ['PWD'], os.listdir(os.path.expanduser('~')), dict(os.environ))"
    judgement = _judge(_body(show))
    assert judgement.passed  # the control: reading its own environment is allowed
    assert str(tmp_path) not in judgement.stdout and "s3cret" not in judgement.stdout
    assert judgement.folder in judgement.stdout and "['candidate.py']" in judgement.stdout
    for code in (
        f"import os\nprint(os.listdir({str(tmp_path)!r}))",
        f"print(open({str(tmp_path / 'mine.txt')!r}).read())",
    ):
        assert not _judge(_body(code)).passed  # the caller's folder by its absolute path
    delete = (
        "import os\nfor name in os.listdir(os.environ['PWD']):\n    os.remove(os.path.join(os.environ['PWD'], name))"
    )
    assert not _judge(_body(delete)).passed and (tmp_path / "mine.txt").read_text() == "keep"
    assert not os.path.exists(judgement.folder)  # the run's folder is removed


@pytest.mark.parametrize("layers", sorted(LAYERS))
def test_a_completion_opens_no_connection(layers):
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        for module in ("socket", "_socket"):
            code = f"import {module}\ns = {module}.socket()\ns.connect(('127.0.0.1', {port}))\ns.send(b'x')"
            assert not _judge(_body(code), layers).passed
        with pytest.raises(TimeoutError):
            server.accept()
    assert _judge(RIGHT, layers).passed


def _processes_of(folder: str) -> list[int]:
    """Processes whose command line or environment names `folder` (a judged run's)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as handle:
                    environ = handle.read()
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    command = handle.read()
            except OSError:
                continue
            if folder.encode() in environ or folder.encode() in command:
                found.append(int(entry))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("layers", sorted(LAYERS))
@pytest.mark.parametrize("how", ["os.fork and setsid", "subprocess with a new session"])
def test_a_completion_leaves_no_process_behind(how, layers):
    """Before: only the direct child was killed, and only on timeout. After: its process group is killed whole after
    it returns; in a PID namespace everything it started dies with it; the interpreter's guard refuses starting one."""
    import time

    code = {
        "os.fork and setsid": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)",
        "subprocess with a new session": "import subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)",
    }[how]
    judgement = _judge(_body(code), layers)
    assert judgement.passed == (layers == "namespaces alone")  # the guard refuses the fork; alone, it runs
    deadline = time.monotonic() + 5
    while _processes_of(judgement.folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_of(judgement.folder) == []


def _judge_in_a_process(completion: str, layers: str) -> subprocess.CompletedProcess:
    """`run_program` in a fresh interpreter (the judge module loaded alone), which prints the judgement and the
    process's peak memory before and after."""
    from pathlib import Path

    from lab.real.humaneval import program

    judge_file = Path(__file__).resolve().parents[1] / "lab" / "real" / "judge.py"
    script = (
        "import importlib.util, json, resource, sys\n"
        f"spec = importlib.util.spec_from_file_location('judge', {str(judge_file)!r})\n"
        "judge = sys.modules['judge'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(judge)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"j = judge.run_program({program(ADD, completion)!r}, 'add', 20, **{LAYERS[layers]!r})\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(json.dumps({'passed': j.passed, 'reason': j.reason, 'kib': after - before, 'shown': len(j.stdout)}))\n"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("layers", sorted(LAYERS))
@pytest.mark.parametrize("how", ["os.kill", "posix.kill", "os.killpg"])
def test_a_completion_cannot_kill_the_judge(how, layers):
    """Before: `os.kill(os.getppid(), 9)` killed the judging process. After: refused by the guard; in a PID
    namespace the parent is not even visible (`getppid()` is 0)."""
    if layers == "namespaces alone":
        from lab.real.judge import namespace_command

        if not namespace_command():
            pytest.skip("this system cannot create network and PID namespaces (`unshare`)")
    code = {
        "os.kill": "import os\nos.kill(os.getppid(), 9)",
        "posix.kill": "import os, posix\nposix.kill(os.getppid(), 9)",
        "os.killpg": "import os\nos.killpg(os.getpgid(os.getppid()), 9)",
    }[how]
    done = _judge_in_a_process(_body(code), layers)
    assert done.returncode == 0, done.stderr  # the judging process lived
    result = json.loads(done.stdout)
    assert result["reason"] != "passed" or layers == "namespaces alone"
    assert json.loads(_judge_in_a_process(RIGHT, layers).stdout)["passed"]  # the control


def test_a_completion_printing_150_mb_costs_no_memory():
    """Before: the judge held all it printed. After: output beyond the file-size limit fails the run, and the judge
    reads it in chunks and keeps the first `SHOWN_BYTES`."""
    from lab.real.judge import SHOWN_BYTES

    flood = _body("import sys\nfor _ in range(150):\n    sys.stdout.write('x' * (1 << 20))")
    result = json.loads(_judge_in_a_process(flood, "judge").stdout)
    assert not result["passed"] and result["shown"] == SHOWN_BYTES
    assert result["kib"] < 32 * 1024  # far below the 150 MB printed
    control = json.loads(_judge_in_a_process(_body("print('x' * 1000)"), "judge").stdout)
    assert control["passed"] and control["shown"] == 2 * 1001 + 34  # its line per call of `add`, then the marker


# ----------------------------------------------------------------------- 16. the long-switch benchmark's command

BAD_RUNGS = {
    "x": "entry 'x' needs a fraction",
    "x@abc": "entry 'x@abc': fraction 'abc' is not a number",
    "@0": "entry '@0' names no repair strategy",
    "tail@1.5": r"entry 'tail@1.5': the fraction 1.5 must be a number in \(0, 1\]",
    "tail@nan": r"the fraction nan must be a number in \(0, 1\]",
    "+foo": r"entry '\+foo': after '\+' comes refresh",
    ",,,": "',,,' names no rung",
    "bogus@0.2": "entry 'bogus@0.2': Unknown repair strategy 'bogus'",
    "draft_attention:bogus=1@0.2": "does not take these options.*bogus",
    "mapped+refresh:bogus=1": "entry 'mapped\\+refresh:bogus=1': .*bogus",
}


def _benchmark_error(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code not in (0, None)
    text = info.value.code if isinstance(info.value.code, str) else capsys.readouterr().err
    assert "Traceback" not in text
    return text


@pytest.mark.parametrize("rungs", sorted(BAD_RUNGS))
def test_long_switch_refuses_a_bad_rung_while_parsing(rungs, capsys):
    """Before: tracebacks (an `ArgumentTypeError` raised outside the parser, `RepairConfig` errors), and `,,,`
    measured no rung. After: argparse's error naming the flag and the entry, before any tokenizer or model loads."""
    import re

    from benchmarks.switch import long_switch

    text = _benchmark_error(long_switch.build_parser().parse_args, ["--rungs", rungs], capsys)
    assert "argument --rungs: " in text and re.search(BAD_RUNGS[rungs], text), text
    good = "tail@0.2,draft_attention:draft_tokens=16@0.1+refresh:every=16,tokens=32,mapped+refresh:fraction=0.05"
    assert long_switch.build_parser().parse_args(["--rungs", good]).rungs == good  # the control
    assert long_switch.split_rungs(good)[1] == "draft_attention:draft_tokens=16@0.1+refresh:every=16,tokens=32"


def test_long_switch_refuses_a_folder_as_records(tmp_path, capsys):
    """Before: `IsADirectoryError` after the models loaded. After: refused while parsing."""
    from benchmarks.switch import long_switch

    parse = long_switch.build_parser().parse_args
    assert "argument --records: " in _benchmark_error(parse, ["--records", str(tmp_path)], capsys)
    assert str(parse(["--records", str(tmp_path / "r.jsonl")]).records) == str(tmp_path / "r.jsonl")  # the control


RUN_LINE = '{"run": {"id": "r1"}}\n'
ITEM = '{"key": "%s", "setup": {}, "task": "long_doc", "length": 2048, "arms": {"target": {"score": 1}}}\n'
BAD_RECORDS = {
    "a JSON list": (RUN_LINE + ITEM % "k1" + "[1, 2]\n", r"records.jsonl:3: a list, expected"),
    "a row without arms": (RUN_LINE + '{"key": "k1", "task": "long_doc"}\n', r"records.jsonl:2: .*without its 'arms'"),
    "not JSON, then more rows": (RUN_LINE + '{"key": "k1", "ar\n' + ITEM % "k2", r"records.jsonl:2: not valid JSON"),
    "neither item nor run": (RUN_LINE + '{"note": 1}\n', r"records.jsonl:2: neither a measured item"),
}


@pytest.fixture
def switch_run(monkeypatch):
    """`benchmarks.switch.long_switch.main` with no tokenizer, and loading the models failing the test."""
    from benchmarks.switch import long_switch

    def no_models(*args, **kwargs):
        raise RuntimeError("the models were loaded")

    monkeypatch.setattr(long_switch, "target_tokenizer", lambda args: None)
    monkeypatch.setattr(long_switch, "Runner", no_models)
    return lambda records: long_switch.main(["--mapper", "m", "--rungs", "tail@0.1", "--records", str(records)])


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_long_switch_refuses_a_bad_records_line_by_file_and_line(case, tmp_path, switch_run):
    """Before: a JSON list was skipped silently, a row without `arms` gave KeyError, a bad line a JSONDecodeError
    naming neither file nor line. After: refused by file and line before the models load; the file is kept."""
    import re

    path = tmp_path / "records.jsonl"
    text, message = BAD_RECORDS[case]
    path.write_text(text)
    with pytest.raises(SystemExit) as info:
        switch_run(path)
    assert re.search(message, str(info.value)), info.value
    assert path.read_text() == text
    path.write_text(RUN_LINE + ITEM % "k1")  # the control: a good file goes on to load the models
    with pytest.raises(RuntimeError, match="the models were loaded"):
        switch_run(path)


def test_long_switch_cuts_a_torn_last_record_and_measures_its_item_again(tmp_path, switch_run, capsys):
    """A kill while a row is appended leaves a line without its end: cut (the item is measured again), as
    calibrate-ladder's records; the report reads such a file and leaves it as it is."""
    from benchmarks.switch import long_switch_report

    path = tmp_path / "records.jsonl"
    torn = RUN_LINE + ITEM % "k1" + '{"key": "k2", "arms": {"tar'
    path.write_text(torn)
    assert sorted(long_switch_report.load(path)) == ["k1"] and path.read_text() == torn  # the report cuts nothing
    with pytest.raises(RuntimeError, match="the models were loaded"):
        switch_run(path)
    assert path.read_text() == RUN_LINE + ITEM % "k1" and "incomplete record" in capsys.readouterr().err
    assert sorted(long_switch_report.load(path)) == ["k1"]  # k2 is measured again: it is not in the records


def test_long_switch_names_obtain_for_a_missing_model(tmp_path, capsys):
    """Before: transformers' "Repo id must be ..." traceback. After: the command that obtains the model."""
    from benchmarks.switch import long_switch
    from hf_kvmap.real.obtain import obtained_path

    argv = ["--mapper", "m", "--records", str(tmp_path / "r.jsonl"), "--cache-dir", str(tmp_path / "cache")]
    text = _benchmark_error(long_switch.main, argv, capsys)
    assert f"run `hf-kvmap obtain qwen2.5-coder-1.5b-instruct --cache-dir {tmp_path / 'cache'}`" in text
    folder = tmp_path / "cache" / "models" / "qwen2.5-coder-1.5b-instruct"
    folder.mkdir(parents=True)
    (folder / "obtain.json").write_text("{}")  # the control: an obtained model's folder
    assert obtained_path("qwen2.5-coder-1.5b-instruct", tmp_path / "cache") == folder


# ----------------------------------------------------------- 17. every CLI output path is checked before any work


def _read_only_mount_works() -> bool:
    import shutil

    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    probe = "mkdir -p /tmp && mount --bind /tmp /tmp && mount -o remount,ro,bind /tmp /tmp && ! touch /tmp/.probe"
    return subprocess.run(["unshare", "-m", "sh", "-c", probe], capture_output=True).returncode == 0


READ_ONLY_SCRIPT = """
import json, sys
from hf_kvmap.cli import main
ro, rw, mapper = sys.argv[1:4]
ladder = ["calibrate-ladder", "--source", "tiny-s", "--target", "tiny-l"]
cases = {
    "eval --plot": ["eval", "--source", "tiny-s", "--target", "tiny-l", "--diagnostics", "2", "--plot", ro + "/d.png"],
    "calibrate-ladder --records, a new file": [*ladder, "--out", rw + "/m", "--records", ro + "/new.jsonl"],
    "calibrate-ladder --records, a file there": [*ladder, "--out", rw + "/m", "--records", ro + "/records.jsonl"],
    "card": ["card", mapper],
    "fit --out": ["fit", "--source", "s", "--target", "t", "--data", rw + "/d.txt", "--out", ro + "/m"],
    "pair --out": ["pair", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "--out", ro + "/pair"],
}
found = {}
for case, argv in cases.items():
    try:
        main(argv)
        found[case] = "no error"
    except SystemExit as err:
        found[case] = str(err.code)
    except BaseException as err:
        found[case] = "raised " + type(err).__name__ + ": " + str(err)
print(json.dumps(found))
"""


@pytest.mark.skipif(not _read_only_mount_works(), reason="needs a private read-only bind mount (unshare -m, root)")
def test_cli_refuses_an_output_path_on_a_read_only_mount_before_any_work(pair, tmp_path):
    """Before: `eval --plot` and `fit --out` failed after the whole run, `calibrate-ladder --records` after the first
    item, `card` with a raw OSError. After: each is refused before any model loads, naming the path and why."""
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir(), rw.mkdir()
    (ro / "records.jsonl").write_text("")
    (rw / "d.txt").write_text("calibration text\n")
    MapperModel.identity(pair[3]).save_pretrained(ro / "mapper")
    mount = f'mount --bind {ro} {ro} && mount -o remount,ro,bind {ro} {ro} && exec "$0" -c "$1" {ro} {rw} {ro}/mapper'
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", mount, sys.executable, READ_ONLY_SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(Path(__file__).resolve().parents[1]),
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for case, text in found.items():
        assert "read-only file system" in text and "cannot" in text and str(ro) in text, (case, text)
        assert "Traceback" not in text and not text.startswith("raised")
    # the controls: the same arguments in a folder that takes writes pass the checks
    from hf_kvmap.cli import build_parser

    assert build_parser().parse_args(["eval", "--source", "s", "--target", "t", "--plot", str(rw / "d.png")]).plot
    assert build_parser().parse_args([*LADDER, "--out", str(rw / "m"), "--records", str(rw / "r.jsonl")]).records


def test_cli_eval_names_its_flag_for_a_mapper_of_another_pair(capsys):
    """Before: a ValueError traceback whose hint named the Python argument `allow_mismatch=True`. After: a clean exit
    naming `--allow-mismatch`, which then evaluates."""
    from hf_kvmap import zoo

    other = str(zoo.mapper_path("tiny-m", "tiny-l"))
    text = _cli_error([*EVAL, "--mapper", other], capsys)
    assert "does not match the models" in text and "--allow-mismatch" in text and "allow_mismatch=True" not in text
    text = _cli_error([*EVAL, "--mapper", other, "--allow-mismatch", "--items", "1"], capsys)
    assert "does not match the models" not in text and "layers" in text  # let through, then refused by the mapping
    assert cli_main([*EVAL, "--items", "1"]) == 0  # the control: the mapper fitted for the pair evaluates


def test_cli_fit_names_a_source_it_cannot_load_and_data_that_is_not_utf8(pair, tmp_path, capsys, monkeypatch):
    """Before: the source tokenizer of a Hub id offline ended in a traceback (the target's was caught), and so did
    --data that is not UTF-8. After: both refused by flag before any model loads."""
    from transformers import AutoTokenizer

    from hf_kvmap import zoo
    from hf_kvmap.commands.fit import _loaded, check_data

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "d.txt").write_text("some calibration text\n")
    argv = ["fit", "--source", "org/not-cached", "--target", "org/other", "--data", str(tmp_path / "d.txt")]
    text = _cli_error([*argv, "--out", str(tmp_path / "m")], capsys)
    assert "cannot load the tokenizer of --source org/not-cached" in text and "HF_HUB_OFFLINE=1" in text
    zoo.load_tokenizer().save_pretrained(tmp_path / "tok")  # the control: a local folder loads
    assert _loaded("--source", str(tmp_path / "tok"), "tokenizer", AutoTokenizer.from_pretrained).get_vocab()
    (tmp_path / "bad.txt").write_bytes(b"caf\xc3\xa9 ok\nthen \xff\xfe here\n")
    text = _cli_error(
        ["fit", "--source", "s", "--target", "t", "--data", str(tmp_path / "bad.txt"), "--out", "m"], capsys
    )
    assert "--data" in text and "is not UTF-8 text (byte 14: invalid start byte)" in text
    assert check_data(str(tmp_path / "d.txt")) is None  # the control


# ------------------------------------------------------------------ 18. options a session or a handoff cannot serve


RESPOND_OPTIONS = {
    "num_beams=2": ({"num_beams": 2}, ValueError, "num_beams=2.*one beam.*pass num_beams=1"),
    "num_return_sequences=2": ({"num_return_sequences": 2}, ValueError, "num_return_sequences=2.*pass"),
    "refresh with an unknown option": ({"refresh": {"bogus": 1}}, ValueError, r"refresh= does not take 'bogus'"),
    "refresh not a dict": ({"refresh": 16}, TypeError, "refresh= takes the settings"),
}


@pytest.mark.parametrize("case", sorted(RESPOND_OPTIONS))
def test_session_respond_refuses_what_one_conversation_cannot_serve(pair, case):
    """Before: `num_beams=2` or `num_return_sequences=2` hit the batch-1 cache with a torch size error, an unknown
    refresh option a raw TypeError (and none at all where nothing was mapped). After: refused by name, before the
    cache is brought up to date."""
    model, _, _, _ = pair
    session = HandoffSession({"a": model}, {})
    session.append(ids_of(10, length=6)[0])
    kwargs, error, message = RESPOND_OPTIONS[case]
    with pytest.raises(error, match=message):
        session.respond("a", 2, **kwargs)
    assert session.covered("a") == 0 and session.input_ids.shape == (1, 6) and not session.turns
    turn = session.respond("a", 2, num_beams=1, num_return_sequences=1, refresh={"every": 4, "tokens": 1})
    assert len(turn.tokens) == 2 and session.input_ids.shape == (1, 8)  # the control


def test_handoff_refuses_a_legacy_cache_a_tokenizer_name_and_a_non_bool_same_weights(pair, tiny):
    """Before: a tuple `source_cache` passed the checks and failed in drafting with an AttributeError,
    `tokenizer="gpt2"` an AttributeError, and `same_weights="no"` was read as True (the model ids went unchecked).
    After: each refused by name at the check."""
    from hf_kvmap import zoo

    model, _, identity, _ = pair
    ids = ids_of(11)
    own = tiny.prefill(model, ids)
    legacy = tuple((layer.keys, layer.values) for layer in own.layers)
    with pytest.raises(
        TypeError, match="source_cache is a tuple.*legacy tuple.*DynamicCache\\(ddp_cache_data=pairs\\)"
    ):
        handoff(model, model, identity, ids, source_cache=legacy)
    with pytest.raises(TypeError, match=r"tokenizer is a str.*AutoTokenizer.from_pretrained\('gpt2'\)"):
        handoff(model, model, identity, ids, tokenizer="gpt2")
    with pytest.raises(TypeError, match="same_weights='no' must be True or False"):
        handoff(model, model, identity, ids, same_weights="no")
    with pytest.raises(TypeError, match="same_weights='no' must be True or False"):
        identity.check_compatible(model, model, same_weights="no")
    # the controls: the same request with a Cache, a tokenizer object and a bool is served exactly
    cache, report = handoff(
        model, model, identity, ids, source_cache=DynamicCache(ddp_cache_data=legacy), tokenizer=zoo.load_tokenizer()
    )
    assert report.accepted and report.reason.startswith("exact mapping")
    assert torch.equal(tiny.greedy(model, ids, cache=cache), tiny.greedy(model, ids))
    assert handoff(model, model, identity, ids, same_weights=False)[1].accepted


# ------------------------------------------------------------- 19. a save through a link, a load racing a save


@pytest.mark.parametrize("dangling", [False, True], ids=["a link to a file", "a dangling link"])
def test_a_file_save_through_a_link_writes_the_file_it_points_to(tmp_path, dangling):
    """Before: the link was replaced by a regular file and the linked file left old. After: the linked file is
    written and the link kept, as folder saves follow links."""
    from hf_kvmap.atomic import write_text_atomically

    target, link = tmp_path / "real" / "a.json", tmp_path / "link.json"
    target.parent.mkdir()
    if not dangling:
        target.write_text("old")
    link.symlink_to(target)
    assert write_text_atomically(link, "new") == target
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_text() == "new"
    assert write_text_atomically(tmp_path / "plain.json", "x") == tmp_path / "plain.json"  # the control
    assert not (tmp_path / "plain.json").is_symlink() and (tmp_path / "plain.json").read_text() == "x"


def test_a_load_racing_a_save_reads_the_version_the_save_left(pair, tmp_path, monkeypatch):
    """Before: a load read config.json of one version and the weights of the other and reported a content-hash
    mismatch. After: when the folder changed during the read, it is read again, and the model loaded is one
    version whole. Here the save lands between reading the config and verifying the weights."""
    from hf_kvmap import modeling_mapper

    _, _, _, config = pair
    old, new = MapperModel.identity(config), MapperModel.identity(config)
    with torch.no_grad():
        for parameter in new.parameters():
            parameter.mul_(2.0)
    old.save_pretrained(tmp_path / "m")
    assert MapperModel.from_pretrained(tmp_path / "m").config.content_hash == old.config.content_hash  # the control
    verify, calls = modeling_mapper.verify_artifact, []

    def save_in_between(name, config, **kwargs):
        calls.append(config.content_hash)
        if len(calls) == 1:  # another process's save, after this load read config.json
            new.save_pretrained(tmp_path / "m")
        return verify(name, config, **kwargs)

    monkeypatch.setattr(modeling_mapper, "verify_artifact", save_in_between)
    loaded = MapperModel.from_pretrained(tmp_path / "m")
    assert calls == [old.config.content_hash, new.config.content_hash]  # read twice: the second time, the new one
    assert loaded.config.content_hash == new.config.content_hash
    for name, tensor in new.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)


def test_loads_racing_another_process_saving_read_one_version_each(pair, tmp_path):
    """The race between processes: another process saves one of two versions into the folder every 0.2 s while this
    one loads it over and over; every load succeeds and is one of the two versions whole."""
    import time

    _, _, _, config = pair
    versions = []
    for scale, name in ((1.0, "a"), (3.0, "b")):
        mapper = MapperModel.identity(config)
        with torch.no_grad():
            for parameter in mapper.parameters():
                parameter.mul_(scale)
        mapper.save_pretrained(tmp_path / name)
        versions.append(mapper.config.content_hash)
    mapper = MapperModel.identity(config)
    mapper.save_pretrained(tmp_path / "m")
    swapper = (
        "import shutil, sys, time\nfrom hf_kvmap.atomic import write_folder_atomically\n"
        "end = time.monotonic() + 6\nn = 0\n"
        "while time.monotonic() < end:\n"
        f"    source = {str(tmp_path)!r} + ('/a' if n % 2 else '/b')\n"
        f"    write_folder_atomically({str(tmp_path / 'm')!r}, lambda f: shutil.copytree(source, f, dirs_exist_ok=True))\n"
        "    n += 1\n    time.sleep(0.2)\nprint(n)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", swapper],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(Path(__file__).resolve().parents[1]),
    )
    time.sleep(1.0)
    loaded = []
    while process.poll() is None:
        loaded.append(MapperModel.from_pretrained(tmp_path / "m").config.content_hash)
    assert int(process.stdout.read()) > 10 and len(loaded) > 10
    assert set(loaded) <= set(versions)


def test_cli_calibrate_ladder_names_the_fix_for_a_mapper_of_another_pair(tmp_path, capsys):
    """Before: the hint named the Python argument `allow_mismatch=True`, which calibrate-ladder has no flag for. After:
    it says to calibrate a ladder for the mapper of these models."""
    from hf_kvmap import zoo

    other = str(zoo.mapper_path("tiny-m", "tiny-l"))
    argv = [*LADDER, "--mapper", other, "--items", "2", "--out", str(tmp_path / "m")]
    text = _cli_error(argv, capsys)
    assert "does not match the models" in text and "calibrate a ladder for the mapper fitted for these models" in text
    assert "allow_mismatch" not in text
