"""The `hf-kvmap` command line: one module per sub-command under `hf_kvmap.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines `add_parser(subparsers)` (which sets `func`) and is imported only when the CLI runs.
COMMANDS = ("benchmark", "card", "demo", "eval", "fit", "ladder", "obtain")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-kvmap", description="Map KV caches between models of one family.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"hf_kvmap.commands.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
