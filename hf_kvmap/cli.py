"""The `hf-kvmap` command line: one module per sub-command under `hf_kvmap.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines `add_parser(subparsers)` (which sets `func`) and is imported only when the CLI runs.
COMMANDS = ("benchmark", "card", "demo", "eval", "fit", "ladder", "obtain", "pair")


class Parser(argparse.ArgumentParser):
    """argparse's parser (its sub-command parsers are of this class too), ending on a bad argument as every other
    error of the command line does: the usage line, then `SystemExit` with the message (`hf-kvmap <command>: error:
    argument --flag: ...`), which Python prints before exiting with code 1."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        raise SystemExit(f"{self.prog}: error: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hf-kvmap", description="Map KV caches between models of one family.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"hf_kvmap.commands.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
