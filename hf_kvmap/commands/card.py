"""`hf-kvmap card DIR [--results results.json]`: (re)render a saved mapper's model card."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("card", help="(Re)render the model card (README.md) of a saved mapper folder.")
    parser.add_argument("directory", type=Path, help="folder written by MapperModel.save_pretrained")
    parser.add_argument("--results", type=Path, default=None, help="evaluation JSON to render (and store beside it)")
    parser.add_argument("--name", default=None, help="model name / Hub id shown on the card (default: folder name)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..modeling_mapper import MapperModel

    mapper = MapperModel.from_pretrained(args.directory)
    results = json.loads(args.results.read_text()) if args.results is not None else None
    print(f"wrote {mapper.write_card(args.directory, evaluation=results, repo_id=args.name)}")
    return 0
