"""The `hf-kvmap` command line."""

from __future__ import annotations

import argparse
import importlib
import sys

# Sub-command name -> module under hf_kvmap.commands (imported lazily, so `--help` stays fast).
COMMANDS = {
    "fit": "fit",
    "demo": "demo",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-kvmap", description="Map KV caches between models of one family.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(f"hf_kvmap.commands.{module_name}")
        except ModuleNotFoundError as err:
            if err.name != f"hf_kvmap.commands.{module_name}":
                raise
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
