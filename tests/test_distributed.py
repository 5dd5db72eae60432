"""Calibration statistics summed across processes with `torch.distributed` (gloo, CPU, two local processes)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen3Config, Qwen3ForCausalLM

from hf_kvmap import mapper_from_statistics
from hf_kvmap.reporting import kernel_settings
from hf_kvmap.statistics import CalibrationStatistics

WORLD_SIZE = 2


def _models():
    def build(seed, layers):
        torch.manual_seed(seed)
        config = Qwen3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
        )
        return Qwen3ForCausalLM(config).eval()

    return build(0, 3), build(1, 2)


def _batches():
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 64, (2, 24), generator=generator) for _ in range(4)]


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        source, target = _models()
        mine = _batches()[rank::WORLD_SIZE]
        stats = CalibrationStatistics.collect(source, target, mine, stride=2, progress=False)
        stats.all_reduce()
        stats.save(os.path.join(out_dir, f"rank{rank}"))

        # Kernel settings: ranks gathering under other settings sum to "mixed"; a rank without positions adds none.
        if rank == 1:
            os.environ["MKL_CBWR"] = "AVX2"  # the label only: this process's MKL has read its setting already
        labelled = CalibrationStatistics.collect(source, target, mine, stride=2, progress=False).all_reduce()
        empty = CalibrationStatistics(source.config, target.config, stride=2)
        rank0_only = empty if rank else CalibrationStatistics.collect(source, target, mine, stride=2, progress=False)
        rank0_only.all_reduce()
        with open(os.path.join(out_dir, f"settings{rank}.txt"), "w") as handle:
            handle.write(f"{labelled.kernel_settings}|{rank0_only.kernel_settings}")

        # Ranks holding incompatible statistics all refuse, before any tensor is summed.
        odd = CalibrationStatistics(source.config, target.config, stride=2 + rank)
        try:
            odd.all_reduce()
            outcome = "reduced"
        except ValueError as err:
            outcome = f"refused: {err}"
        with open(os.path.join(out_dir, f"incompatible{rank}.txt"), "w") as handle:
            handle.write(outcome)
    finally:
        dist.destroy_process_group()


def test_all_reduce_equals_single_process(tmp_path):
    # Rank 1 in a spawned process, rank 0 here (one interpreter start instead of two keeps the test fast).
    args = (str(tmp_path / "store"), str(tmp_path))
    child = mp.get_context("spawn").Process(target=_worker, args=(1, *args))
    child.start()
    threads = torch.get_num_threads()
    try:
        _worker(0, *args)
    finally:
        torch.set_num_threads(threads)
        child.join(timeout=180)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0, f"rank 1 exited with {child.exitcode}"
    assert not dist.is_initialized()

    source, target = _models()
    single = CalibrationStatistics.collect(source, target, _batches(), stride=2, progress=False)
    for rank in range(WORLD_SIZE):
        reduced = CalibrationStatistics.load(tmp_path / f"rank{rank}")
        assert reduced.provenance() == single.provenance()  # tokens, sequences, fingerprint (order independent)
        for name, tensor in single.state_dict().items():
            got = reduced.state_dict()[name]
            if tensor.is_floating_point():
                assert torch.allclose(got, tensor, rtol=1e-9, atol=1e-9 * tensor.abs().max().item()), name
            else:
                assert torch.equal(got, tensor), name
        native = kernel_settings("cpu")
        assert (tmp_path / f"settings{rank}.txt").read_text() == f"mixed|{native}"
        text = (tmp_path / f"incompatible{rank}.txt").read_text()
        assert text.startswith("refused") and "stride" in text, text

    reduced = CalibrationStatistics.load(tmp_path / "rank0")
    a = mapper_from_statistics(reduced, top_k=2, dtype=torch.float64)
    b = mapper_from_statistics(single, top_k=2, dtype=torch.float64)
    assert a.config.source_layers == b.config.source_layers
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa, pb, rtol=0, atol=1e-7 * pb.abs().max().item())


def test_all_reduce_without_process_group_is_a_no_op(recwarn):
    assert not dist.is_initialized()
    source, target = _models()
    stats = CalibrationStatistics.collect(source, target, _batches()[:1], progress=False)
    before = {name: tensor.clone() for name, tensor in stats.state_dict().items()}
    assert stats.all_reduce() is stats
    assert all(torch.equal(before[name], tensor) for name, tensor in stats.state_dict().items())
    assert len(recwarn) == 0
