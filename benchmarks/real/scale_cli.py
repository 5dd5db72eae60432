"""The real pair against calibration scale, and what else it takes (`python -m benchmarks.real scale ...`).

The paper's ridge (k = 8 and k = all) is fitted on growing prefixes of one calibration stream (the snapshots that
`python -m benchmarks.real family calibrate --snapshots 2,4,8,...` keeps) and every fit is scored on the same items,
three ways (source alone, target alone, handoff), with the prefills of each model computed once and kept on disk. It
answers "does the paper's method hold on this pair if it gets more calibration text", and how far the answer moves
with the number of calibration positions (the paper's scale: 500 x 1,024 tokens at stride 4 = 128K positions).

    python -m benchmarks.real scale --cache-dir C run --calibration W/calib --work S [--items 16]
    python -m benchmarks.real scale report --work S      # benchmarks/results/real_family_scale.{json,png}

`run` is resumable (every score is written as soon as it is known) and picks up snapshots that appeared since the
last run; the running calibration's current checkpoint is scored too, under its position count.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import DTYPES, MANIFEST
from .finetune import FINETUNE_OBJECTIVES, cmd_features, cmd_finetune
from .guard import cmd_guard
from .layers import KEYS_RESULTS, cmd_keys, cmd_swap
from .long_finetune import add_command as add_long_finetune
from .scale import TASKS, cmd_first_layer, cmd_follow, cmd_run, cmd_score, int_list
from .scale_report import cmd_report


def fit_command(sub, name: str, help: str, tasks: str) -> argparse.ArgumentParser:
    """A subcommand about one direction's fitted mappers: the options `finetune`, `swap` and `first-layer` share."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--tasks", default=tasks)
    p.add_argument("--directions", default="0.5b-to-1.5b", help=argparse.SUPPRESS)
    p.add_argument("--direction", default="0.5b-to-1.5b")
    return p


def add_commands(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add this study's options and sub-commands to `parser` (each sets `func`, run by `benchmarks.real.cli.main`)."""
    parser.add_argument("--cache-dir", default=None, help="hf-kvmap obtain cache (default ~/.cache/hf-kvmap)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--items", type=int, default=16, help="items per task")
    parser.add_argument("--seed", type=int, default=1234)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="fit every snapshot and score it (resumable)")
    p.add_argument("--calibration", type=Path, required=True, help="the calibrate --out folder (its snapshots)")
    p.add_argument("--work", type=Path, required=True, help="scores and prefills are kept here")
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--tasks", default=TASKS)
    p.add_argument("--directions", default="0.5b-to-1.5b,1.5b-to-0.5b")
    p.add_argument("--variants", default="ridge-k8,ridge-all")
    p.add_argument("--sizes", type=lambda t: set(int_list(t)), default=None, help="only these calibration positions")
    p.add_argument("--ridge-lambda", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("follow", help="calibrate and score each snapshot as it is kept, one process")
    p.add_argument("--out", type=Path, required=True, help="the calibration folder (as calibrate --out)")
    p.add_argument("--work", type=Path, required=True, help="scores and prefills are kept here")
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--sequences", type=int, default=500)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=4)
    p.add_argument("--stride", type=int, default=2)
    p.add_argument("--calibration-seed", dest="calibration_seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--snapshots", type=lambda t: set(int_list(t)), default={2, 4, 8, 16, 32, 64})
    p.add_argument("--tasks", default=TASKS)
    p.add_argument("--directions", default="0.5b-to-1.5b")
    p.add_argument("--variants", default="ridge-k8,ridge-all")
    p.add_argument("--ridge-lambda", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_follow)
    p = fit_command(sub, "finetune", "attention or KL fine-tune of one fitted mapper, scored like the curve", TASKS)
    p.add_argument("--objective", choices=sorted(FINETUNE_OBJECTIVES), default="attention")
    p.add_argument("--min-prefix", type=int, default=32, help="kl: the shortest mapped prefix and suffix")
    p.add_argument(
        "--data",
        choices=("calibration", "readback"),
        default="calibration",
        help="calibration text, or retrieval and chat-recall prompts built from the calibration split (--seq-len unused)",
    )
    p.add_argument("--variant", default="ridge-k8", help="the fitted mapper to start from (a fine-tuned one too)")
    p.add_argument("--name", default=None, help="the fine-tuned variant (default: <variant>-<objective>[-readback])")
    p.add_argument("--positions", type=int, default=None, help="which fit (default: the largest)")
    p.add_argument("--sequences", type=int, default=32, help="fine-tune sequences (the last --val-sequences held out)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calibration-seed", dest="calibration_seed", type=int, default=1, help="not the ridge's stream")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=1e-4, help="Adam step (1e-3 made the held-out error worse here)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--val-sequences", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_finetune)
    add_long_finetune(sub)
    p = fit_command(sub, "features", "fit and score the mappers that need features (windows, both kinds, MLP)", TASKS)
    p.add_argument("--calibration", type=Path, required=True, help="the calibration folder (its snapshots)")
    p.add_argument("--selection-positions", type=int, default=32768, help="the snapshot whose k = 8 selection is used")
    p.add_argument("--variants", default="ridge-k8-feat,ridge-k8-w1,ridge-k8-w3,ridge-k8-both")
    p.add_argument("--sequences", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--batch", type=int, default=2, help="sequences per forward")
    p.add_argument("--calibration-seed", dest="calibration_seed", type=int, default=2, help="not the ridge's stream")
    p.add_argument("--ridge-lambda", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_features)
    p = fit_command(sub, "swap", "layer_swap of one fitted mapper on real weights", "prose_retrieval,code_nll")
    p.add_argument("--variant", default="ridge-all")
    p.add_argument("--positions", type=int, default=None, help="which fit (default: the largest)")
    p.add_argument("--layers", default="all", help="layers to swap in one at a time ('all', or a list, may be empty)")
    p.add_argument("--own-layers", default="", help="layers kept the target's own, one at a time, the rest mapped")
    p.add_argument(
        "--own-first",
        default="",
        help="numbers n of leading layers kept the target's own (layers 0..n-1), the rest mapped",
    )
    p.add_argument(
        "--own-tokens",
        default="",
        help="numbers n of leading prompt tokens kept the target's own in every layer, the rest mapped",
    )
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_swap)
    p = fit_command(sub, "first-layer", "score fitted mappers with the target computing its first layer", TASKS)
    p.add_argument("--fits", required=True, help="positions:variant,... of fitted mappers (e.g. 32768:ridge-k8)")
    p.add_argument("--also-plain", action="store_true", help="score each mapper without the first layer too")
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_first_layer)
    p = fit_command(sub, "guard", "the guarded handoff's candidate probes on one fitted mapper (two item sets)", TASKS)
    p.add_argument("--variant", default="ridge-k8")
    p.add_argument("--positions", type=int, default=None, help="which fit (default: the largest)")
    p.add_argument("--report-seed", type=int, default=4321, help="the report set (thresholds come from --seed's)")
    p.add_argument("--max-false-alarm", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_guard)
    p = fit_command(
        sub, "keys", "per layer: mapped key norms, cosines and R^2 against the target's", "code_nll,prose_ppl"
    )
    p.add_argument("--fits", required=True, help="positions:variant,... of fitted mappers (e.g. 131072:ridge-k8)")
    p.add_argument("--out", type=Path, default=KEYS_RESULTS)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_keys)
    p = fit_command(sub, "score", "score fitted mappers and both models alone on the items of --items/--seed", TASKS)
    p.add_argument("--fits", required=True, help="positions:variant,... of fitted mappers (e.g. 32768:ridge-k8)")
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_score)
    p = sub.add_parser("report", help="write the results JSON and the plot")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument(
        "--held-out",
        action="append",
        default=[],
        metavar="ITEMS:SEED",
        help="also tabulate the fits scored (`score`) on this item set; repeatable",
    )
    p.set_defaults(func=cmd_report)
    return parser
