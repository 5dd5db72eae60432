"""Argument types the commands share. Each refuses a bad value while the command line is parsed (before any model
loads or any measuring starts) with `argparse.ArgumentTypeError`, which the parser (`hf_kvmap.cli.Parser`) reports as
`hf-kvmap <command>: error: argument --flag: ...` (the flag, the value and what to pass instead), never a traceback."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _integer(text: str, minimum: int) -> int:
    from ..validation import check_int

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer.") from None
    try:
        check_int("the value", value, minimum)
    except ValueError:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise argparse.ArgumentTypeError(f"{value} must be {what}.") from None
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (counts of items, repeats, threads)."""
    return _integer(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _integer(text, 0)


def _parent_is_usable(path: Path, *, append: bool = False, write: bool = True) -> None:
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"{path}: {parent} is a file, not a folder; name a path in a folder.")
            break
    from ..atomic import unwritable

    problem = unwritable(path, append=append) if write else None
    if problem:
        raise argparse.ArgumentTypeError(problem)


def output_file(text: str) -> Path:
    """A file to write (results JSON, a plot): not an existing folder, not below a file."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; name the file to write (e.g. {path / 'results.json'}).")
    _parent_is_usable(path)
    return path


def appendable_file(text: str) -> Path:
    """A file a run appends records to (JSONL): `output_file`, and an existing one must take writes."""
    path = output_file(text)
    _parent_is_usable(path, append=True)
    return path


def folder(text: str) -> Path:
    """A folder to read from or write into (made when missing): not an existing file, not below one."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file; name a folder.")
    _parent_is_usable(path, write=False)  # read from, too (`obtain --list`): written where the command writes
    return path


def mapper_folder(text: str) -> Path:
    """A folder to save a mapper into: new, empty or a mapper's own (files of a mapper only), not a file."""
    from ..artifacts import foreign_files

    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file; name a folder for the mapper (new, empty or a mapper's).")
    foreign = foreign_files(path)
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise argparse.ArgumentTypeError(
            f"{path} holds files that are not part of a mapper ({shown}); a save would replace the whole folder. "
            "Name a new or empty folder, or a mapper's own."
        )
    _parent_is_usable(path)
    return path


def input_file(text: str) -> Path:
    """An existing file to read."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; name the file.")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{path}: no such file.")
    return path


def read_json_object(path: Path, flag: str) -> dict:
    """The JSON object held by the file given to `flag` (e.g. results written by `hf-kvmap eval --json`); `ValueError`
    naming the flag and the file otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{flag} {path} is not valid JSON ({err}); pass the file `hf-kvmap eval --json` wrote."
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag} {path} holds a JSON {type(data).__name__}, not an object of results.")
    return data


def fractions(text: str) -> list[float]:
    """Comma-separated repair fractions in [0, 1) (`0.1,0.3`)."""
    values = []
    for part in (part.strip() for part in text.split(",")):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            where = "" if part == text.strip() else f" in {text!r}"
            raise argparse.ArgumentTypeError(f"{part!r}{where} is not a number; pass e.g. 0.1,0.3.") from None
        if not 0.0 <= value < 1.0:
            raise argparse.ArgumentTypeError(
                f"{part} in {text!r} is not in [0, 1): a fraction of the positions to recompute (the full "
                "prefill is the ladder's top rung)."
            )
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} names no fraction; pass e.g. 0.1,0.3.")
    return values


def probes(text: str) -> list:
    """Comma-separated probes `name:tokens` (`draft_agreement:2,lookahead_margin:1`)."""
    from ..calibration.ladder_items import parse_probe

    found = []
    for part in (part.strip() for part in text.split(",")):
        if not part:
            continue
        name, _, tokens = part.partition(":")
        if tokens and not tokens.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"{part!r}: the tokens after ':' must be a positive integer (e.g. {name}:2)."
            )
        try:
            found.append(parse_probe(part))
        except (TypeError, ValueError) as err:
            raise argparse.ArgumentTypeError(f"{part!r}: {err}") from None
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} names no probe; pass e.g. draft_agreement:2.")
    return found


def strategies(text: str) -> list[dict]:
    """Repair strategies: comma-separated names (`tail,source_attention`) or a JSON list of names and settings
    (`[{"name": "tail"}]`; `"skip": "markup"` names the tokenizer's special tokens, read once it is loaded)."""
    from ..repair import resolve_markup, strategy_from_dict

    if text.lstrip().startswith("["):
        try:
            listed = json.loads(text)
        except json.JSONDecodeError as err:
            raise argparse.ArgumentTypeError(
                f"{text!r} starts a JSON list but is not valid JSON ({err}); pass e.g. "
                '\'[{"name": "tail"}]\' or comma-separated names.'
            ) from None
    else:
        listed = [part.strip() for part in text.split(",") if part.strip()]
    if not isinstance(listed, list) or not listed:
        raise argparse.ArgumentTypeError(f"{text!r} names no repair strategy; pass e.g. tail,source_attention.")
    parsed = []
    try:
        for strategy in listed:
            # checked with `"skip": "markup"` read as no ids (no tokenizer yet); such a strategy is kept as given, and
            # the command reads the markup once its tokenizer is loaded
            checked = resolve_markup(strategy, None)
            settings = strategy_from_dict(checked).settings()
            parsed.append(strategy if checked != strategy else settings)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return parsed


def statistics_folder(text: str) -> Path:
    """A folder to save calibration statistics into: new, empty or one holding statistics only."""
    from ..statistics import METADATA_FILE, STATISTICS_FILE

    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file; name a folder for the statistics.")
    others = (
        sorted({entry.name for entry in path.iterdir()} - {STATISTICS_FILE, METADATA_FILE}) if path.is_dir() else []
    )
    if others:
        raise argparse.ArgumentTypeError(
            f"{path} holds files that are not calibration statistics ({', '.join(others[:5])}); a save replaces the "
            "whole folder. Name a new or empty folder (or one a previous --stats wrote)."
        )
    _parent_is_usable(path)
    return path


def saved_statistics(text: str) -> Path:
    """An existing folder, of calibration statistics written by `hf-kvmap fit --stats` (what it holds is checked when
    they are loaded)."""
    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{path}: {'not a folder' if path.exists() else 'no such folder'}; name the folder `--stats` wrote."
        )
    return path
