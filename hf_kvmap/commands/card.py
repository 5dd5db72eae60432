"""`hf-kvmap card DIR [--results results.json]`: (re)render a saved mapper's model card."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import _args


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("card", help="(Re)render the model card (README.md) of a saved mapper folder.")
    parser.add_argument("directory", type=Path, help="folder written by MapperModel.save_pretrained")
    parser.add_argument(
        "--results",
        type=_args.input_file,
        default=None,
        help="evaluation JSON to render (and store beside it)",
    )
    parser.add_argument("--name", default=None, help="model name / Hub id shown on the card (default: folder name)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..artifacts import results_hash
    from ..atomic import unwritable
    from .models import load_mapper

    try:
        results = None if args.results is None else _args.read_json_object(args.results, "--results")
    except ValueError as err:
        raise SystemExit(f"hf-kvmap card: {err}") from None
    mapper = load_mapper(args.directory, "card", flag=None)
    problem = unwritable(args.directory, inside=True)  # the card is written into the folder
    if problem:
        raise SystemExit(f"hf-kvmap card: {problem} (the card, README.md, is written into the mapper's folder)")
    if results is not None and results_hash(results) is None:
        raise SystemExit(
            f"hf-kvmap card: {args.results} records no mapper content hash (run.mapper_content_hash), so nothing "
            f"says it was measured on {args.directory}. Evaluate this mapper with `hf-kvmap eval --mapper "
            f"{args.directory} --json ...` and render those results."
        )
    try:
        card = mapper.write_card(args.directory, evaluation=results, repo_id=args.name)
    except ValueError as err:
        raise SystemExit(f"hf-kvmap card: {args.results}: {err}") from None
    except OSError as err:  # a folder that became unwritable since the check
        raise SystemExit(f"hf-kvmap card: cannot write the card into {args.directory}: {err.strerror}.") from None
    print(f"wrote {card}")
    return 0
