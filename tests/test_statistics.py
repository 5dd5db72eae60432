"""`CalibrationStatistics`: accumulation, padding, merging, memory, persistence, refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hf_kvmap import (
    CalibrationStatistics,
)


def test_save_load_round_trip_exact(random_pair_stats, tmp_path):
    random_pair_stats.save(tmp_path / "stats")
    assert sorted(os.listdir(tmp_path / "stats")) == ["statistics.json", "statistics.safetensors"]
    meta = json.loads((tmp_path / "stats" / "statistics.json").read_text())
    assert meta["calibration"]["fingerprint"] == random_pair_stats.fingerprint and meta["stride"] == 2
    assert meta["source_summary"]["num_hidden_layers"] == 4
    loaded = CalibrationStatistics.load(tmp_path / "stats")
    assert loaded.parts == random_pair_stats.parts and loaded.provenance() == random_pair_stats.provenance()
    for name, tensor in random_pair_stats.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
        # own storage, aligned as a fresh tensor's: MKL's GEMM rounds by the output's alignment on some CPUs, so a
        # calibration resumed into views of the file's buffer would not sum exactly as an uninterrupted one
        assert loaded.state_dict()[name].data_ptr() % 64 == 0, name

    with open(tmp_path / "stats" / "statistics.safetensors", "r+b") as handle:  # tamper with one byte
        handle.seek(-3, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-3, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ValueError, match="sha256"):
        CalibrationStatistics.load(tmp_path / "stats")


def test_merge_halves_equals_whole_and_rejects_incompatible(tiny, random_pair):
    source, target = random_pair
    data = tiny.batches(seed=2)
    whole = CalibrationStatistics.collect(source, target, data, stride=2, progress=False)
    first = CalibrationStatistics.collect(source, target, data[2:], stride=2, progress=False)
    second = CalibrationStatistics.collect(source, target, data[:2], stride=2, progress=False)
    merged = first.merge(second)
    assert merged.fingerprint == whole.fingerprint  # order independent
    for name, tensor in whole.state_dict().items():
        assert torch.allclose(merged.state_dict()[name], tensor, rtol=1e-12, atol=1e-9), name

    other_stride = CalibrationStatistics.collect(source, target, data[:1], stride=3, progress=False)
    with pytest.raises(ValueError, match="stride differs"):
        whole.merge(other_stride)
    restricted = CalibrationStatistics(source.config, target.config, stride=2, target_layers=[1])
    with pytest.raises(ValueError, match="target_layers differs"):
        whole.merge(restricted)
    swapped = CalibrationStatistics(target.config, source.config, stride=2)
    with pytest.raises(ValueError, match="source_summary differs"):
        whole.merge(swapped)


@pytest.mark.parametrize(
    "parts,target_layers,dtype",
    [(("key", "value"), None, torch.float64), (("key",), [2], torch.float32), (("value",), [0, 2], torch.float64)],
)
def test_memory_estimate_matches_collected(tiny, random_pair, parts, target_layers, dtype):
    source, target = random_pair
    stats = CalibrationStatistics.collect(
        source,
        target,
        tiny.batches(count=1, size=1, length=8),
        parts=parts,
        target_layers=target_layers,
        dtype=dtype,
        progress=False,
    )
    estimate = CalibrationStatistics.memory_estimate(
        source.config, target.config, parts=parts, target_layers=target_layers, dtype=dtype
    )
    assert estimate["total"] == stats.nbytes()
    assert set(parts) <= set(estimate)
    assert all(stats[part].gram.dtype == dtype for part in parts)


def test_padded_batches_match_unpadded(tiny, self_model):
    model = self_model
    data = tiny.batches(seed=6, count=1, size=2, length=20)[0]
    plain = CalibrationStatistics.collect(model, model, [data[0:1], data[1:2, 5:]], progress=False)
    ids = data.clone()
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # left padding of the second row
    padded = CalibrationStatistics.collect(model, model, [{"input_ids": ids, "attention_mask": mask}], progress=False)
    assert padded.count() == plain.count() == 35
    assert padded.fingerprint == plain.fingerprint and int(padded.tokens) == 35
    for name, tensor in plain.state_dict().items():
        assert torch.allclose(padded.state_dict()[name], tensor, rtol=1e-5, atol=1e-4), name


def test_update_rejects_bad_shapes(random_pair):
    source, target = random_pair
    stats = CalibrationStatistics(source.config, target.config)
    with pytest.raises(ValueError, match="width"):
        stats.update(torch.zeros(3, 5), torch.zeros(3, 5), torch.zeros(3, 5), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="values"):
        stats.update(torch.zeros(3, stats.source_width), None, torch.zeros(3, stats.target_width), None)
    layer = torch.zeros(1, 2, 5, 16)
    with pytest.raises(ValueError, match="model has 4 layers"):
        stats.update([layer] * 3, [layer] * 3, [layer] * 3, [layer] * 3)
    with pytest.raises(ValueError, match="n_kv \\* head_dim = 32"):
        stats.update([layer] * 4, [layer] * 4, [torch.zeros(1, 2, 5, 8)] * 3, [layer] * 3)


def test_non_finite_features_are_refused(random_pair):
    source, target = random_pair
    stats = CalibrationStatistics(source.config, target.config, parts=("key",))
    bad = torch.zeros(3, stats.target_width)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        stats.update(torch.zeros(3, stats.source_width), None, bad, None)
    assert stats.count() == 0 and not stats["key"].gram.any()


def test_kernel_settings_are_recorded_kept_and_joined(tiny, random_pair, monkeypatch, tmp_path):
    """The float kernels the sums were gathered with travel with them: collect records them, save/load keeps them,
    a merge of parts gathered under other settings says "mixed", an empty part takes the other's, an unknown part
    makes the sum unknown."""
    from hf_kvmap.reporting import PORTABLE_KERNELS, kernel_settings

    source, target = random_pair
    data = tiny.batches(seed=2)
    native = CalibrationStatistics.collect(source, target, data[:2], stride=2, progress=False)
    assert native.kernel_settings == kernel_settings("cpu") == f"cpu {torch.backends.cpu.get_cpu_capability()}"
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    portable = CalibrationStatistics.collect(source, target, data[2:], stride=2, progress=False)
    assert portable.kernel_settings == PORTABLE_KERNELS == "cpu DEFAULT, MKL_CBWR=COMPATIBLE"
    assert portable.provenance()["kernel_settings"] == PORTABLE_KERNELS
    portable.save(tmp_path / "portable")
    assert CalibrationStatistics.load(tmp_path / "portable").kernel_settings == PORTABLE_KERNELS

    again = CalibrationStatistics.collect(source, target, data[:2], stride=2, progress=False)
    assert again.merge(CalibrationStatistics.load(tmp_path / "portable")).kernel_settings == PORTABLE_KERNELS
    assert CalibrationStatistics.load(tmp_path / "portable").merge(native).kernel_settings == "mixed"
    empty = CalibrationStatistics(source.config, target.config, stride=2)
    assert empty.kernel_settings is None and empty.merge(native).kernel_settings == native.kernel_settings
    assert native.merge(CalibrationStatistics(source.config, target.config, stride=2)).kernel_settings is not None
    unknown = CalibrationStatistics.load(tmp_path / "portable")
    unknown.kernel_settings = None  # statistics saved before the field
    assert unknown.merge(again).kernel_settings is None
    # accumulating more under other kernels than the sums hold
    portable.accumulate(source, target, data[:1], progress=False)
    monkeypatch.delenv("MKL_CBWR")
    assert portable.accumulate(source, target, data[1:2], progress=False).kernel_settings == "mixed"


def test_statistics_saved_before_kernel_settings_load_as_unknown(random_pair_stats, tmp_path):
    random_pair_stats.save(tmp_path / "old")
    path = tmp_path / "old" / "statistics.json"
    meta = json.loads(path.read_text())
    del meta["calibration"]["kernel_settings"]
    path.write_text(json.dumps(meta))
    assert CalibrationStatistics.load(tmp_path / "old").kernel_settings is None
