"""A sealed protocol: the choices of a real-pair study frozen in one committed JSON file before its report items are
built.

The file names the direction, dtype and threads, the maps (each a recipe and a label), the rungs every item is served
with (`strategy[:options]@fraction`; each repair is also served as a sparse prefill of the same selection, the
map-free peer), the rung the verdicts read, the report cells (tasks, context length, items and a seed that no
selection ever used), the interval and the verdict rules. Its sha256 (of the file's bytes) is stamped into every
record made under it; `benchmarks.switch.long_switch --protocol` takes every choice from it and refuses flags that would
change one, and `benchmarks.sealed.report` refuses a record stamped with another hash.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
#: the suffix of a repair rung's map-free peer: the sparse prefill of the same selection
SPARSE = "sparse:"
_KEYS = {
    "name",
    "what",
    "direction",
    "dtype",
    "threads",
    "maps",
    "rungs",
    "chosen",
    "selection_seeds",
    "cells",
    "interval",
    "timing",
    "verdicts",
}
#: keys a protocol may hold besides `_KEYS`: `ladder`, the guard ladder replayed on its report items
_OPTIONAL_KEYS = {"ladder"}
_LADDER_KEYS = {"what", "probe", "check_tokens", "max_changed", "confidence", "calibration", "verdicts"}
#: a ladder is calibrated on at least this many items (all its tasks together), none of them a report item
LADDER_CALIBRATION_ITEMS = 100
_VERDICT_KEYS = {"gap", "gap_lower", "retention", "min_gap_items", "speedup", "map_adds", "map_adds_lower"}


class ProtocolError(ValueError):
    """A protocol file that does not say what it must, or a run or report that departs from it."""


@dataclass(frozen=True)
class Protocol:
    """A loaded protocol: `settings` as the file holds them, `sha256` of its bytes, `path` it was read from."""

    settings: dict[str, Any]
    sha256: str
    path: str

    @property
    def rungs(self) -> list[str]:
        return list(self.settings["rungs"])

    @property
    def arms(self) -> list[str]:
        """Every arm a record holds: the target, the mapped cache, each rung and its sparse peer, the source."""
        return ["target", "mapped", *self.rungs, *(SPARSE + rung for rung in self.rungs), "source"]

    def cell(self, task: str, tokens: int) -> dict[str, Any]:
        """The report cell of `task` at `tokens` (items, seed); refuses one the protocol does not name. A follow-up
        question's task (`followups:q2`) is its conversation's."""
        task = task.split(":")[0]
        for cell in self.settings["cells"]:
            if task in cell["tasks"] and cell["tokens"] == tokens:
                return cell
        named = ", ".join(f"{','.join(c['tasks'])}@{c['tokens']}" for c in self.settings["cells"])
        raise ProtocolError(f"{self.path} has no cell for {task} at {tokens} tokens; its cells: {named}.")

    def chosen(self, task: str) -> str:
        """The rung the verdicts of `task` read."""
        chosen = self.settings["chosen"]
        return chosen.get(task.split(":")[0], chosen["default"])


def _require(condition: bool, path, message: str) -> None:
    if not condition:
        raise ProtocolError(f"{path}: {message}")


def _check_ladder(ladder: Any, settings: dict, path) -> None:
    """A protocol's `ladder`: its probe, check, budget, calibration cell (its own seed, at least
    `LADDER_CALIBRATION_ITEMS` items, a length with a report cell) and verdicts."""
    _require(
        isinstance(ladder, dict) and set(ladder) == _LADDER_KEYS, path, f"ladder: exactly {sorted(_LADDER_KEYS)}."
    )
    _require(
        ladder["probe"] == "lookahead_margin:1",
        path,
        "ladder.probe: 'lookahead_margin:1', the probe a long_switch record holds (its mapped arm's first margin).",
    )
    _require(
        ladder["check_tokens"] in (None, 1), path, "ladder.check_tokens: 1 (records time the first token) or null."
    )
    budget = ladder["max_changed"]
    _require(isinstance(budget, float) and 0 < budget < 1, path, "ladder.max_changed: a share, e.g. 0.05.")
    confidence = ladder["confidence"]
    _require(confidence is None or 0.5 < confidence < 1, path, "ladder.confidence: null or e.g. 0.95.")
    cell = ladder["calibration"]
    _require(
        isinstance(cell, dict) and set(cell) == {"tasks", "tokens", "items", "seed"},
        path,
        "ladder.calibration: tasks, tokens, items, seed.",
    )
    used = set(settings["selection_seeds"]) | {c["seed"] for c in settings["cells"]}
    _require(cell["seed"] not in used, path, f"ladder.calibration seed {cell['seed']} is a selection or report seed.")
    total = cell["items"] * len(cell["tasks"])
    _require(
        total >= LADDER_CALIBRATION_ITEMS,
        path,
        f"ladder.calibration: {total} items in all; a ladder is calibrated on {LADDER_CALIBRATION_ITEMS} or more.",
    )
    for task in cell["tasks"]:
        held = any(task in c["tasks"] and c["tokens"] == cell["tokens"] for c in settings["cells"])
        _require(held, path, f"ladder.calibration: no report cell of {task} at {cell['tokens']} tokens to replay on.")
    verdicts = ladder["verdicts"]
    _require(
        isinstance(verdicts, dict) and {"max_cost", "max_changed"} <= set(verdicts),
        path,
        "ladder.verdicts: max_cost and max_changed (and how changed answers are read).",
    )


def load_protocol(path: str | Path) -> Protocol:
    """Read and check a protocol file; its sha256 is of the bytes as committed."""
    path = Path(path)
    if not path.is_file():
        raise ProtocolError(f"{path} is not a protocol file; the committed ones are in benchmarks/protocols/.")
    raw = path.read_bytes()
    try:
        settings = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ProtocolError(f"{path} is not JSON ({err}).") from None
    _require(isinstance(settings, dict), path, "a protocol is a JSON object.")
    missing, unknown = _KEYS - set(settings), set(settings) - _KEYS - _OPTIONAL_KEYS
    _require(not missing, path, f"missing {sorted(missing)}.")
    _require(
        not unknown,
        path,
        f"unknown keys {sorted(unknown)}; a protocol holds {sorted(_KEYS)} (and optionally {sorted(_OPTIONAL_KEYS)}).",
    )
    rungs = settings["rungs"]
    _require(isinstance(rungs, list) and rungs and len(set(rungs)) == len(rungs), path, "rungs: distinct entries.")
    for rung in rungs:
        _require(isinstance(rung, str) and "@" in rung and "+" not in rung, path, f"rung {rung!r}: name@fraction.")
    chosen = settings["chosen"]
    _require(isinstance(chosen, dict) and "default" in chosen, path, "chosen: {'default': rung, task: rung ...}.")
    for task, rung in chosen.items():
        _require(rung in rungs, path, f"chosen[{task!r}] = {rung!r} is not one of the rungs.")
    seeds = set(settings["selection_seeds"])
    _require(isinstance(settings["maps"], dict) and settings["maps"], path, "maps: {label: recipe}.")
    cells = settings["cells"]
    _require(isinstance(cells, list) and cells, path, "cells: a list of {tasks, tokens, items, seed}.")
    for cell in cells:
        keys = set(cell) - {"contexts"}  # `contexts`: how HumanEval's code contexts are drawn (long_switch --contexts)
        _require(keys == {"tasks", "tokens", "items", "seed"}, path, f"cell {cell}: tasks, tokens, items, seed.")
        _require(
            cell.get("contexts", "distinct") == "distinct", path, "a cell's contexts are 'distinct' (one a problem)."
        )
        _require(cell["seed"] not in seeds, path, f"cell seed {cell['seed']} was used while choosing.")
        floor = 32 if cell["tokens"] >= 8192 else 64
        _require(cell["items"] >= floor, path, f"cell {cell}: at least {floor} report items at {cell['tokens']}.")
    _require(set(settings["verdicts"]) == _VERDICT_KEYS, path, f"verdicts: exactly {sorted(_VERDICT_KEYS)}.")
    timing = settings["timing"]
    _require(
        isinstance(timing, dict) and set(timing) == {"max_load"} and timing["max_load"] > 0,
        path,
        "timing: {'max_load': the highest 1-minute load average an item's times are read at}.",
    )
    level = settings["interval"].get("level")
    _require(isinstance(level, float) and 0.5 < level < 1, path, "interval.level: e.g. 0.95.")
    if "ladder" in settings:
        _check_ladder(settings["ladder"], settings, path)
    return Protocol(settings, hashlib.sha256(raw).hexdigest(), str(path))


def protocol_from_flag(path: str | Path) -> Protocol:
    """`load_protocol` for a command's `--protocol` flag: a bad file exits naming the flag and what is wrong."""
    try:
        return load_protocol(path)
    except ProtocolError as err:
        raise SystemExit(f"--protocol: {err}") from None


def existing_files(paths: list[str]) -> None:
    """Exit naming the first of a command's input `paths` that is not a file."""
    for path in paths:
        if not Path(path).is_file():
            raise SystemExit(f"{path}: no such file")


__all__ = ["SPARSE", "Protocol", "ProtocolError", "existing_files", "load_protocol", "protocol_from_flag"]
