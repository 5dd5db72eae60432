"""The argument types of `benchmarks.switch.long_switch`: each checks its flag while the command line is parsed (before the
tokenizer or a model loads) and raises `argparse.ArgumentTypeError`, which argparse reports as `argument --flag: ...`
naming the value."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path


def rungs_argument(text: str) -> str:
    """`--rungs`, checked while the command line is parsed (before the tokenizer or a model loads): every entry
    parses (`parse_rung`), names a registered repair strategy with options it takes (`RepairConfig`) and refresh
    options `DecodeRefresh` takes, and there is at least one. Returns `text`."""
    from hf_kvmap.repair import DecodeRefresh, RepairConfig, resolve_markup

    from .long_switch import parse_rung, split_rungs

    entries = split_rungs(text)
    if not entries:
        raise argparse.ArgumentTypeError(f"{text!r} names no rung; pass e.g. draft_attention@0.2,draft_attention@0.3")
    for entry in entries:
        _, settings, fraction, refresh = parse_rung(entry)
        try:
            if settings is not None:  # `skip=markup` is read as no ids here, and with the tokenizer at the run
                RepairConfig(resolve_markup(settings, None), fraction=fraction)
            if refresh is not None:
                inspect.signature(DecodeRefresh).bind(None, None, **refresh)
        except (TypeError, ValueError) as err:
            raise argparse.ArgumentTypeError(f"entry {entry!r}: {err}") from None
    return text


def records_argument(text: str) -> Path:
    """`--records`: a JSONL file this run can append to (not a folder), checked while parsing."""
    from hf_kvmap.atomic import unwritable

    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; name the JSONL file the records are appended to.")
    problem = unwritable(path, append=True)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return path
