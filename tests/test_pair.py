"""`hf-kvmap pair` and `hf_kvmap.real.pairing` on tiny stand-ins of the real models (no real weights, no download):
the saved mapper is the library's fit of the same statistics, a stopped-and-resumed calibration sums exactly what an
uninterrupted one does, and bad names and folders are refused before any work. Also the resumable checkpoints of
`hf_kvmap.real.calibrating` that the real-family benchmark calibrates with."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hf_kvmap import LayerSelection, MappedCache, MapperModel, mapper_from_statistics
from hf_kvmap.cli import main
from hf_kvmap.real import calibrating, corpus, pairing

SOURCE, TARGET = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"
SHORT = dict(sequences=4, seq_len=24, chunk=1, stride=1, progress=False)


@pytest.fixture
def stand_ins(tiny, tmp_path, monkeypatch, split_by_relative_path):
    """Tiny models for the two registered names, the tiny family's tokenizer and a corpus of a fake machine; loads
    are counted, and obtaining is refused (the stand-ins count as obtained)."""
    from hf_kvmap.zoo.tokenizer import build_tokenizer

    models = {
        SOURCE: tiny.model(tiny.config(layers=2, vocab=64), seed=1),
        TARGET: tiny.model(tiny.config(layers=3, vocab=64), seed=2),
    }
    loads = []

    def load_converted(name, cache_dir, dtype="float32"):  # as from the cache: the model goes by the folder
        loads.append(name)
        models[name].config.name_or_path = str(tmp_path / "cache" / "models" / name)
        return models[name]

    def refuse(*args, **kwargs):
        raise AssertionError("nothing is obtained in these tests")

    monkeypatch.setattr(pairing, "load_converted", load_converted)
    monkeypatch.setattr(pairing, "load_tokenizer", lambda name, cache_dir: build_tokenizer())
    monkeypatch.setattr(pairing, "is_converted", lambda name, cache_dir=None: True)
    monkeypatch.setattr(pairing, "obtain", refuse)
    manifest = tmp_path / "manifest.json"
    corpus.build_manifest(manifest, corpus.discover(*tiny.fake_machine(tmp_path / "machine", files=30)))
    return models, loads, manifest


def test_pair_saves_the_library_fit_of_its_statistics(stand_ins, tmp_path, capsys):
    models, loads, manifest = stand_ins
    out = tmp_path / "pair"
    argv = ["pair", SOURCE, TARGET, "--out", str(out), "--manifest", str(manifest)]
    assert main([*argv, "--sequences", "4", "--seq-len", "24", "--chunk", "1", "--stride", "1"]) == 0
    printed = capsys.readouterr().out
    assert "serve_prompt" in printed and str(out) in printed
    serving = json.loads((out / "serving.json").read_text())
    assert serving["rung"] == pairing.DEFAULT_RUNG and (serving["source"], serving["target"]) == (SOURCE, TARGET)
    assert serving["fit"] == {"kind": "ridge", "top_k": 8, "ridge_lambda": 0.01, "positions": 4 * 24}
    mapper = MapperModel.from_pretrained(out / "mapper")
    assert (out / "mapper" / "README.md").is_file()
    stats = calibrating.load_statistics(out / "calibration", SOURCE, TARGET)
    expected = mapper_from_statistics(stats, selection=LayerSelection.from_statistics(stats).with_top_k(8))
    saved, fitted = mapper.state_dict(), expected.state_dict()
    assert saved.keys() == fitted.keys()
    for name in fitted:
        assert torch.equal(saved[name], fitted[name]), name
    # the statistics are those of the corpus's sequences through the two models
    tokenizer = pairing.load_tokenizer(SOURCE, None)
    texts = corpus.calibration_sequences(tokenizer, corpus.load_manifest(manifest), 4, 24)
    direct = type(stats)(
        models[SOURCE].config, models[TARGET].config, tokenizer_fingerprint=stats.tokenizer_fingerprint
    )
    direct.accumulate(models[SOURCE], models[TARGET], [torch.tensor([t]) for t in texts], progress=False)
    for part in ("key", "value"):
        torch.testing.assert_close(stats[part].cross, direct[part].cross)
    with torch.no_grad():
        cache = models[SOURCE](torch.tensor([texts[0]]), use_cache=True).past_key_values
        mapped = MappedCache.from_source(cache, mapper)
    assert len(mapped.layers) == 3 and mapped.layers[0].keys.shape[-2] == 23
    # a finished folder is served again from its checkpoint: no model is loaded, the same mapper is written
    loads.clear()
    assert main([*argv, "--sequences", "4", "--seq-len", "24", "--chunk", "1", "--stride", "1"]) == 0
    assert loads == []
    again = MapperModel.from_pretrained(out / "mapper").state_dict()
    assert all(torch.equal(again[name], saved[name]) for name in saved)


def test_stopped_and_resumed_calibration_sums_exactly_the_uninterrupted_one(stand_ins, tmp_path, monkeypatch):
    models, loads, manifest = stand_ins
    whole = pairing.make_pair(SOURCE, TARGET, tmp_path / "whole", manifest=manifest, **SHORT)
    assert whole.complete and whole.calibration.done == 4
    stopped = pairing.make_pair(SOURCE, TARGET, tmp_path / "parts", manifest=manifest, max_minutes=0, **SHORT)
    assert not stopped.complete and stopped.calibration.stopped and stopped.calibration.done == 0
    assert not (tmp_path / "parts" / "mapper").exists()
    # stop after two chunks: the clock reads past the limit from the third chunk on
    ticks = iter([0.0, 0.0, 0.0, 0.0, 0.0, 1e9])
    with monkeypatch.context() as patch:
        patch.setattr(calibrating.time, "perf_counter", lambda: next(ticks, 1e9))
        part = pairing.make_pair(SOURCE, TARGET, tmp_path / "parts", manifest=manifest, max_minutes=1, **SHORT)
    assert part.calibration.stopped and 0 < part.calibration.done < 4 and not part.complete
    resumed = pairing.make_pair(SOURCE, TARGET, tmp_path / "parts", manifest=manifest, **SHORT)
    assert resumed.complete and resumed.calibration.done == 4
    one, two = (calibrating.load_statistics(tmp_path / f / "calibration", SOURCE, TARGET) for f in ("whole", "parts"))
    for part_name in ("key", "value"):
        for field in ("count", "source_sum", "target_sum", "target_sumsq", "gram", "cross"):
            assert torch.equal(getattr(one[part_name], field), getattr(two[part_name], field)), field
    a, b = (MapperModel.from_pretrained(tmp_path / f / "mapper").state_dict() for f in ("whole", "parts"))
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_another_setting_is_refused_before_any_model_loads(stand_ins, tmp_path):
    models, loads, manifest = stand_ins
    pairing.make_pair(SOURCE, TARGET, tmp_path / "pair", manifest=manifest, max_minutes=0, **SHORT)
    loads.clear()
    with pytest.raises(ValueError, match="another setting"):
        pairing.make_pair(SOURCE, TARGET, tmp_path / "pair", manifest=manifest, **{**SHORT, "seq_len": 16})
    other = tmp_path / "other.json"
    corpus.build_manifest(other, corpus.load_manifest(manifest)[:-1])
    with pytest.raises(ValueError, match="another corpus"):
        pairing.make_pair(SOURCE, TARGET, tmp_path / "pair", manifest=other, **SHORT)
    with pytest.raises(SystemExit, match="another setting"):
        main(["pair", SOURCE, TARGET, "--out", str(tmp_path / "pair"), "--seq-len", "16", "--chunk", "1"])
    assert loads == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["pair", "qwen-9b", TARGET], "unknown model 'qwen-9b'; the registered models are .*qwen2.5-coder-0.5b"),
        (["pair", SOURCE, SOURCE], "both 'qwen2.5-coder-0.5b-instruct'"),
        (["pair", SOURCE, TARGET, "--rung", "repaired:nope@0.1"], "Unknown repair strategy 'nope'"),
        (["pair", SOURCE, TARGET, "--max-minutes", "-1"], "must be >= 0 minutes"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit, match=message):
        main([*argv, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_bad_outputs_are_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(pairing, "obtain", lambda *a, **k: pytest.fail("obtained"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit, match="is a file"):
        main(["pair", SOURCE, TARGET, "--out", str(tmp_path / "file")])
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        with pytest.raises(SystemExit, match="cannot write"):
            main(["pair", SOURCE, TARGET, "--out", str(locked / "out")])
    finally:
        locked.chmod(0o700)
    with pytest.raises(ValueError, match="Unknown source model 'nope'"):
        pairing.make_pair("nope", TARGET, tmp_path / "x")


def test_checkpoint_swap_keeps_a_complete_one(tmp_path):
    assert calibrating.checkpoint_dir(tmp_path) is None
    (tmp_path / "progress.json").write_text("{}")  # the first layout
    assert calibrating.checkpoint_dir(tmp_path) == tmp_path
    tmp = tmp_path / "checkpoint.tmp"
    tmp.mkdir()
    (tmp / "progress.json").write_text('{"n": 1}')
    calibrating.swap_in(tmp_path, tmp)
    assert calibrating.checkpoint_dir(tmp_path) == tmp_path / "checkpoint"
    assert not (tmp_path / "progress.json").exists()
    # killed between the two renames of the next swap: the previous checkpoint is still found
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")
    assert calibrating.checkpoint_dir(tmp_path) == tmp_path / "checkpoint.old"


def test_body_replay_runs_each_batch_once(tiny):
    model = tiny.model(tiny.arch_config("qwen2-biased-k"))
    replay = calibrating.BodyReplay(model)
    ids = torch.randint(3, 128, (1, 12))
    first = replay(ids, use_cache=True)
    assert replay(ids.clone(), use_cache=True) is first
    assert replay(torch.randint(3, 128, (1, 12)), use_cache=True) is not first
    with torch.no_grad():
        truth = model(ids, use_cache=True).past_key_values
    torch.testing.assert_close(first.past_key_values.layers[1].keys, truth.layers[1].keys)


def test_statistics_folders_keep_the_benchmark_layout():
    assert calibrating.statistics_name(SOURCE, TARGET, {SOURCE: "0.5b", TARGET: "1.5b"}) == "statistics-0.5b-to-1.5b"
    assert Path(calibrating.statistics_name("a", "b")).name == "statistics-a-to-b"


def test_the_printed_next_command_serves_a_prompt_through_the_pair(stand_ins, tmp_path, tiny):
    """`serve_prompt` (what `hf-kvmap pair` prints) serves the rung of `serving.json` through the gate, the models
    going by their registered ids as the mapper records them (not by the cache folders they were read from): a repair
    of every position decodes exactly the target's own greedy tokens; the default rung reports itself."""
    models, loads, manifest = stand_ins
    out = tmp_path / "pair"
    pairing.make_pair(SOURCE, TARGET, out, manifest=manifest, rung="repaired:tail@1.0", **SHORT)
    served = pairing.serve_prompt(out, "the cat sat on the mat and the dog", max_new_tokens=6)
    assert served["report"]["rung"] == "repaired:tail@1.0"
    tokenizer = pairing.load_tokenizer(TARGET, None)
    ids = tokenizer("the cat sat on the mat and the dog", return_tensors="pt")["input_ids"]
    own = tiny.greedy(models[TARGET], ids, new=6)
    assert served["text"] == tokenizer.decode(own[0, ids.shape[1] :], skip_special_tokens=True)
    assert "serve_prompt" in pairing.next_command(out) and str(out) in pairing.next_command(out)


def test_more_sequences_extend_a_finished_calibration(stand_ins, tmp_path):
    """Sequence `i` does not depend on the count (as in the benchmark's setting): asking for more sums only the new
    chunks into the same statistics, the sums of a run of that count from the start."""
    models, loads, manifest = stand_ins
    pairing.make_pair(SOURCE, TARGET, tmp_path / "grown", manifest=manifest, **{**SHORT, "sequences": 2})
    grown = pairing.make_pair(SOURCE, TARGET, tmp_path / "grown", manifest=manifest, **SHORT)
    assert grown.complete and grown.calibration.done == 4 and grown.serving["fit"]["positions"] == 4 * 24
    pairing.make_pair(SOURCE, TARGET, tmp_path / "whole", manifest=manifest, **SHORT)
    one, two = (calibrating.load_statistics(tmp_path / f / "calibration", SOURCE, TARGET) for f in ("grown", "whole"))
    assert torch.equal(one["key"].gram, two["key"].gram) and torch.equal(one["value"].cross, two["value"].cross)
