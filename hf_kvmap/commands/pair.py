"""`hf-kvmap pair`: a real pair's map in one command (obtain, calibrate resumably, fit, save with its serving choice)."""

from __future__ import annotations

import argparse

from . import _args


def _model_name(text: str) -> str:
    from ..real.registry import REGISTRY

    if text not in REGISTRY:
        raise argparse.ArgumentTypeError(
            f"unknown model {text!r}; the registered models are {', '.join(sorted(REGISTRY))} (hf-kvmap obtain --list)."
        )
    return text


def _pair_folder(text: str):
    from ..real.pairing import check_output

    path = _args.folder(text)
    try:
        check_output(path)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return path


def _rung(text: str) -> str:
    from ..serving.rungs import parse_rung

    try:
        parse_rung(text)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of minutes.") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0 minutes (0 checks and calibrates nothing).")
    return value


def add_parser(subparsers) -> None:
    from ..real import pairing

    parser = subparsers.add_parser(
        "pair",
        help="Map a real pair in one command: obtain both models, calibrate (resumable), fit, save the mapper.",
        description=(
            "Obtains SOURCE and TARGET (as `hf-kvmap obtain`), calibrates on this machine's pinned corpus in "
            "checkpointed chunks (run the same command again to resume; --max-minutes stops cleanly), fits the "
            "paper's ridge (k = 8, lambda 0.01) for SOURCE -> TARGET and writes OUT/mapper (with its model card) "
            "and OUT/serving.json (the rung to serve), then prints the command that serves a prompt through it."
        ),
    )
    parser.add_argument("source", type=_model_name, help="registered model mapped from (hf-kvmap obtain --list)")
    parser.add_argument("target", type=_model_name, help="registered model mapped to")
    parser.add_argument("--out", type=_pair_folder, required=True, help="output folder (new, or one this wrote)")
    parser.add_argument(
        "--cache-dir", type=_args.folder, default=None, help="default: $HF_KVMAP_CACHE or ~/.cache/hf-kvmap"
    )
    parser.add_argument(
        "--sequences",
        type=_args.positive_int,
        default=pairing.DEFAULT_SEQUENCES,
        help="calibration sequences of --seq-len tokens (default 10 x 1,024 at stride 2: 5,120 positions)",
    )
    parser.add_argument("--seq-len", type=_args.positive_int, default=pairing.DEFAULT_SEQ_LEN)
    parser.add_argument(
        "--chunk", type=_args.positive_int, default=pairing.DEFAULT_CHUNK, help="sequences a checkpoint"
    )
    parser.add_argument("--stride", type=_args.positive_int, default=pairing.DEFAULT_STRIDE)
    parser.add_argument("--seed", type=_args.non_negative_int, default=0)
    parser.add_argument("--dtype", choices=sorted(pairing.DTYPES), default="float32")
    parser.add_argument("--rung", type=_rung, default=pairing.DEFAULT_RUNG, help="the rung serving.json names")
    parser.add_argument("--manifest", type=_args.input_file, default=None, help="a corpus manifest (default: built)")
    parser.add_argument("--max-minutes", type=_minutes, default=None, help="start no chunk after this long")
    parser.add_argument("--threads", type=_args.positive_int, default=None, help="torch threads (default: torch's)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..real import ObtainError
    from ..real.pairing import make_pair, next_command

    if args.source == args.target:
        raise SystemExit(f"hf-kvmap pair: source and target are both {args.source!r}; name two models of one family.")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = make_pair(
            args.source,
            args.target,
            args.out,
            cache_dir=args.cache_dir,
            sequences=args.sequences,
            seq_len=args.seq_len,
            chunk=args.chunk,
            stride=args.stride,
            seed=args.seed,
            dtype=args.dtype,
            rung=args.rung,
            manifest=args.manifest,
            max_minutes=args.max_minutes,
        )
    except (ObtainError, ValueError) as err:
        raise SystemExit(f"hf-kvmap pair: {err}") from None
    calibration = result.calibration
    if not result.complete:
        print(
            f"calibration stopped after --max-minutes {args.max_minutes}: {calibration.done}/{calibration.chunks} chunks done, "
            f"{calibration.progress.get('positions', 0)} positions. Run the same command again to resume."
        )
        return 0
    print(
        f"mapper: {result.mapper_folder} ({calibration.progress['positions']} positions); serving: {result.serving['rung']}"
    )
    print(f"serve a prompt through it:\n  {next_command(args.out)}")
    return 0
