"""The command line of `benchmarks.switch.long_switch`: how a rung entry reads (`parse_rung`, `split_rungs`) and the
argument types that check a flag while the command line is parsed (before the tokenizer or a model loads), raising
`argparse.ArgumentTypeError`, which argparse reports as `argument --flag: ...` naming the value."""

from __future__ import annotations

import argparse
import inspect
import json
import re
from pathlib import Path

from ..sealed.protocol import SPARSE


def parse_options(options: str) -> dict:
    """`key=value,...` -> settings (each value read as JSON where it is, else kept as text)."""
    settings = {}
    for option in filter(None, options.split(",")):
        key, _, raw = option.partition("=")
        try:
            settings[key] = json.loads(raw)
        except json.JSONDecodeError:
            settings[key] = raw
    return settings


def split_rungs(text: str) -> list[str]:
    """`--rungs` (or `--strategies`) split into entries at the commas that start a new entry (an option's own
    comma, `a=1,b=2`, is followed by `name=`, which no entry starts with)."""
    entries: list[str] = []
    for piece in text.split(","):
        if entries and re.match(r"[A-Za-z_]\w*=", piece):
            entries[-1] += "," + piece
        elif piece:
            entries.append(piece)
    return entries


def parse_strategy(text: str) -> dict:
    """`name[:option=value,...]` -> strategy settings, e.g. `query_overlap:fill=draft_branches,after=24` (the
    library's one syntax, `hf_kvmap.repair.base.strategy_from_text`)."""
    from hf_kvmap.repair.base import strategy_from_text

    try:
        return strategy_from_text(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_rung(text: str) -> tuple[str, dict | None, float, dict | None]:
    """`name[:option=value,...]@fraction[+refresh:option=value,...]` -> (label, strategy settings, fraction, refresh
    settings); e.g. `draft_attention@0.2`, `draft_attention:draft_tokens=64@0.2`,
    `draft_attention@0.1+refresh:every=16,tokens=32` (`DecodeRefresh` repairs while the target decodes), or
    `mapped+refresh:every=16,fraction=0.02` (no repair before the first token). `sparse:` before a repair rung
    (`sparse:draft_branches@0.1`) is its map-free peer: the target prefills only the positions the repair selects
    (`hf_kvmap.repair.sparse_prefill`), sharing the repair's selection where both are served. A malformed entry
    raises `argparse.ArgumentTypeError` naming it."""
    if text.startswith(SPARSE):
        label, settings, fraction, refresh = parse_rung(text[len(SPARSE) :])
        if settings is None or refresh is not None:
            raise argparse.ArgumentTypeError(
                f"entry {text!r}: sparse: takes a repair rung without a refresh, e.g. sparse:draft_branches@0.1"
            )
        return text, settings, fraction, None
    head, plus, tail = text.partition("+")
    refresh = None
    if plus:
        kind, _, options = tail.partition(":")
        if kind != "refresh":
            raise argparse.ArgumentTypeError(f"entry {text!r}: after '+' comes refresh[:option=value,...]")
        refresh = parse_options(options)
        if head == "mapped":
            return text, None, 0.0, refresh
    if "@" not in head:
        raise argparse.ArgumentTypeError(f"entry {text!r} needs a fraction: name[:option=value]@fraction")
    spec, fraction = head.rsplit("@", 1)
    if not spec.partition(":")[0]:
        raise argparse.ArgumentTypeError(
            f"entry {text!r} names no repair strategy: name[:option=value]@fraction (e.g. draft_attention@0.2)"
        )
    try:
        share = float(fraction)
    except ValueError:
        raise argparse.ArgumentTypeError(f"entry {text!r}: fraction {fraction!r} is not a number") from None
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(f"entry {text!r}: the fraction {fraction} must be a number in (0, 1]")
    return text, parse_strategy(spec), share, refresh


def rungs_argument(text: str) -> str:
    """`--rungs`, checked while the command line is parsed (before the tokenizer or a model loads): every entry
    parses (`parse_rung`), names a registered repair strategy with options it takes (`RepairConfig`) and refresh
    options `DecodeRefresh` takes, and there is at least one. Returns `text`."""
    from hf_kvmap.repair import DecodeRefresh, RepairConfig, resolve_markup

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
