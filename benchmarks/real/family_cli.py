"""The real-family study's commands: Qwen2.5-Coder 0.5B <-> 1.5B (from packaged GGUF, `hf-kvmap obtain`).

    manifest   pin the calibration/evaluation text of this machine (file list + sha256)
    calibrate  resumable collection of the statistics of both directions, in chunks of sequences
    fit        ridge mappers from the statistics (k = 8, k = all) and ridge self-maps (sanity bounds)
    evaluate   tasks three ways (source alone, target alone, handoff), prefills cached on disk, resumable
    analyze    held-out per-layer R^2 and attention cosine of the fitted mappers
    latency    mapper (target dtype) vs target re-prefill beside the FLOP bound, side by side in one run
    report     results JSON, plot and cards from what the other commands wrote (`python -m benchmarks.docs` then
               renders the docs page)

Models come from `hf-kvmap obtain NAME` (folders under `--cache-dir`, default `~/.cache/hf-kvmap`); nothing here
downloads. See benchmarks/README.md ("Real family") for the exact commands and how to resume each job.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .calibrate import cmd_calibrate, cmd_manifest
from .common import DTYPES, MANIFEST
from .evaluate import cmd_analyze, cmd_evaluate, cmd_latency
from .family_report import cmd_report
from .fit import cmd_fit


def add_commands(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add this study's options and sub-commands to `parser` (each sets `func`, run by `benchmarks.real.cli.main`)."""
    parser.add_argument("--cache-dir", default=None, help="hf-kvmap obtain cache (default ~/.cache/hf-kvmap)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="the models' dtype (mappers run in the target's)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("manifest", help="pin this machine's corpus files")
    p.add_argument("--out", type=Path, default=MANIFEST)
    p.set_defaults(func=cmd_manifest)

    p = sub.add_parser("calibrate", help="resumable statistics collection (both directions in one pass)")
    p.add_argument("--out", type=Path, required=True, help="work folder (statistics + progress.json)")
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--sequences", type=int, default=500, help="total sequences (paper: 500)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (paper: 1024)")
    p.add_argument(
        "--corpus",
        choices=["mixed", "conversations"],
        default="mixed",
        help="mixed: code, prose and two-turn chats in turn (the paper's kind of text); conversations: long multi-turn "
        "chats of the same split's passages (hf_kvmap.real.corpus.conversation_sequences), for maps served at length",
    )
    p.add_argument("--chunk", type=int, default=2, help="sequences per checkpoint")
    p.add_argument("--stride", type=int, default=2, help="keep every n-th position")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-minutes", type=float, default=None, help="stop cleanly after this long (resume later)")
    p.add_argument(
        "--snapshots",
        type=lambda text: {int(n) for n in text.split(",") if n},
        default=set(),
        help="chunk counts at which a copy of the checkpoint is kept (e.g. 2,4,8,16,32), for the scale curve",
    )
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("fit", help="ridge mappers (k = 8, k = all) and self-maps from the collected statistics")
    p.add_argument("--work", type=Path, required=True, help="the folder holding calib/ (mappers/ is written)")
    p.add_argument("--calibration", type=Path, default=None, help="a calibration folder or snapshot (default calib/)")
    p.add_argument("--ridge-lambda", type=float, default=0.01)
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser("evaluate", help="tasks three ways; resumable, prefills cached on disk")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--items", type=int, default=200, help="items per task")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tasks", default="prose_retrieval,chat_recall,code_recall,code_nll,prose_ppl")
    p.add_argument("--variants", default="ridge-k8,ridge-all")
    p.add_argument("--self-maps", action="store_true", help="also evaluate the self-map sanity bounds")
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("analyze", help="held-out per-layer R^2 and attention cosine of the fitted mappers")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--items", type=int, default=200, help="the evaluate run whose perplexity contexts are used")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--variants", default="ridge-k8,ridge-all")
    p.add_argument("--contexts", default="code_nll,prose_ppl", help="tasks whose contexts are scored (no padding)")
    p.add_argument("--attention-sequences", type=int, default=1, help="0 skips the attention cosine")
    p.add_argument("--attention-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("latency", help="mapper vs target re-prefill beside the FLOP bound")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--tokens", default="512,1024,2048,4096")
    p.add_argument("--variants", default="ridge-k8,ridge-all")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_latency)

    p = sub.add_parser("report", help="results JSON, plot and cards from the other commands")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--seed", type=int, default=1234)
    p.set_defaults(func=cmd_report)
    return parser
