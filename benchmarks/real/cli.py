"""`python -m benchmarks.real STUDY COMMAND ...`: the parser of both studies of the real pair."""

from __future__ import annotations

import argparse

from . import family_cli, scale_cli


def build_parser() -> argparse.ArgumentParser:
    """`family` (calibrate, fit, evaluate, analyze, latency, report) and `scale` (the scale curve and the studies
    past it), each with its own options before its command."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.real",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    studies = parser.add_subparsers(dest="study", required=True)
    for name, module, help in (
        ("family", family_cli, "the real-family study: calibrate, fit, evaluate, analyze, latency, report"),
        ("scale", scale_cli, "calibration scale, fine-tunes, features, swaps, keys, the guard on the real pair"),
    ):
        study = studies.add_parser(
            name, help=help, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_commands(study)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the chosen command; its return value is the exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
