"""Fit a mapper with the calibration data sharded across processes (`torchrun` or `accelerate launch`).

Every process runs its share of the calibration batches through both models, the statistics are summed with
`torch.distributed` (`CalibrationStatistics.all_reduce`), and rank 0 solves the ridge and saves the mapper:

    torchrun --nproc-per-node 2 examples/distributed_fit.py --source tiny-s --target tiny-l --out runs/mapper
    accelerate launch --num_processes 2 examples/distributed_fit.py --source tiny-s --target tiny-l --out runs/mapper

On GPUs each process loads its models on `cuda:LOCAL_RANK` (nccl); on CPUs the gloo backend is used. The result is
the same as a single process over all the data (tests/test_distributed.py checks it to 1e-9).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from hf_kvmap import CalibrationStatistics, mapper_from_statistics, zoo
from hf_kvmap.artifacts import tokenizer_fingerprint
from hf_kvmap.commands.models import load_causal_lm, load_tokenizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="tiny-s")
    parser.add_argument("--target", default="tiny-l")
    parser.add_argument("--out", required=True)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--ridge-lambda", type=float, default=0.01)
    parser.add_argument("--docs", type=int, default=128, help="calibration sequences (tiny-family corpus)")
    parser.add_argument("--length", type=int, default=512)
    args = parser.parse_args(argv)

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")

    tokenizer = load_tokenizer(args.source)
    source, target = load_causal_lm(args.source).to(device), load_causal_lm(args.target).to(device)
    shard = zoo.calibration_batches(tokenizer, args.docs, args.length, batch_size=8)[rank::world]  # this rank's share

    stats = CalibrationStatistics.collect(
        source,
        target,
        shard,
        device=device,
        progress=rank == 0,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
    )
    stats.all_reduce()
    if rank == 0:
        mapper = mapper_from_statistics(stats.to("cpu"), top_k=args.top_k, ridge_lambda=args.ridge_lambda)
        mapper.save_pretrained(args.out)
        print(f"fitted on {stats.count()} positions from {world} processes -> {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
