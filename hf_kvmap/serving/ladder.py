"""The guard ladder: per request (per row of a batch), serve the mapped cache, repair it with the fraction the probe's
risk calls for, or fall back to the target's full prefill.

```python
ladder = GuardLadder(
    probe={"name": "draft_agreement", "tokens": 2},
    strategy={"name": "source_attention", "last_tokens": 16},
    rungs=[LadderRung(max_risk=0.0, fraction=0.0), LadderRung(max_risk=0.5, fraction=0.3)],
)
cache, report = handoff(source, target, mapper, input_ids, ladder=ladder)   # or stored: mapper.config.handoff_ladder
```

A row whose risk is at most the first rung's `max_risk` gets that rung's repair fraction (0: the mapped cache as it
is), and so on up the rungs; a risk above the last rung's `max_risk` falls back. A ladder with a `min_margin` checks
every row it served after its rung: the target runs the prompt's last token on the served cache (the run `generate`
starts with), and a row whose first answer token's probability margin (top-1 minus top-2) is below `min_margin` falls
back after all (with `check_tokens=k`, its smallest margin over its first `k` greedy answer tokens: an answer whose
first token is certain but whose later ones waver). A probe guesses before the repair how a row will fare; the check
reads the repaired cache itself. A ladder with `min_tokens` maps no prompt shorter than that: below the break-even
length the target's own prefill is sooner than any rung (`benchmarks/ladder/ladder_lengths.py` measures it), and a ladder
calibrated on long prompts vouches for nothing on short ones. The serving pipeline
(`hf_kvmap.serving.pipeline.serve_rows`) gives each row its rung; `hf_kvmap.calibration.ladder.calibrate_ladder`
chooses the rungs on measured items (`hf-kvmap calibrate-ladder` measures them, `hf_kvmap.calibration.ladder_items`):
the cheapest ladder whose changed answers stay within a budget on every task.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..repair import strategy_from_dict
from .probes import probe_from_dict

#: the rung name of a row that falls back to the target's own prefill
FALLBACK = "fallback"


@dataclass
class LadderRung:
    r"""
    One rung of a [`GuardLadder`].

    Args:
        max_risk (`float`): the highest probe risk this rung takes (rows above it go up the ladder).
        fraction (`float`): share of the row's mapped tokens the target recomputes, in `[0, 1)` (0: serve the mapped
            cache as it is).
        sparse (`bool`, *optional*, defaults to `False`): serve the target's prefill of the selected positions alone
            instead of repairing the mapped cache (the map-free rung, `hf_kvmap.repair.sparse_prefill`); a rung of one
            row. In a batch of several rows, a sparse row is repaired at its fraction instead (a costlier rung of the
            same selection), and its report row says so (`sparse_as_repair`).
    """

    max_risk: float
    fraction: float
    sparse: bool = False

    def __post_init__(self):
        if not isinstance(self.sparse, bool):
            raise TypeError(f"LadderRung sparse={self.sparse!r} must be True or False.")
        if self.sparse and not self.fraction > 0:
            raise ValueError("A sparse LadderRung prefills a share of the prompt: give it a fraction in (0, 1).")
        for name in ("max_risk", "fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"LadderRung {name}={value!r} must be a finite number.")
        if not 0.0 <= self.fraction < 1.0:
            raise ValueError(
                f"LadderRung fraction={self.fraction!r} must be in [0, 1): 0 serves the mapped cache, and a row that "
                "needs everything recomputed is the fallback above the last rung."
            )
        self.max_risk, self.fraction = float(self.max_risk), float(self.fraction)


@dataclass
class GuardLadder:
    r"""
    The rungs between the mapped cache and the target's full prefill, chosen per row by one probe's risk.

    Args:
        probe (`dict`): the probe's settings (`{"name": ..., "tokens": ...}`, `hf_kvmap.serving.probes.PROBES`).
        strategy (`dict` or `str`): the repair strategy of the repairing rungs (`hf_kvmap.repair.STRATEGIES`).
        rungs (`list[LadderRung]`): by increasing `max_risk` and increasing `fraction`; may be empty (every row falls
            back).
        calibration (`dict`, *optional*): what [`calibrate_ladder`] measured (items, costs, changed answers per task).
        min_margin (`float`, *optional*): the check after the rung, in `[0, 1]`: a served row whose first answer token
            the target takes with a margin below it falls back (`hf_kvmap.serving.forwards.answer_margin`); `None`
            (the default) checks nothing.
        check_tokens (`int`, *optional*, defaults to 1): how many greedy answer tokens the check reads: a row falls
            back where its smallest margin over them is below `min_margin` (an answer that ends sooner is read to its
            end). Each token past the first costs the check one decoding step; needs `min_margin`.
        min_tokens (`int`, *optional*): the fewest tokens a switch maps: a prompt with fewer real tokens gets the
            target's own prefill (rung `"fallback"`, marked `short`) with no probe, and a batch of such prompts is
            not mapped at all; in a `HandoffSession`, a switch with fewer unseen tokens than this has the model
            prefill them. `None` (the default) maps every length.

    Example:

    ```python
    >>> from hf_kvmap.serving.ladder import GuardLadder, LadderRung
    >>> ladder = GuardLadder({"name": "tail_nll", "tokens": 8}, "tail", [LadderRung(0.5, 0.0), LadderRung(2.0, 0.2)])
    >>> [ladder.fraction_for(risk) for risk in (0.1, 1.0, 3.0)]
    [0.0, 0.2, None]
    ```
    """

    probe: dict[str, Any]
    strategy: dict[str, Any] | str
    rungs: list[LadderRung] = field(default_factory=list)
    calibration: dict[str, Any] | None = None
    min_margin: float | None = None
    check_tokens: int = 1
    min_tokens: int | None = None

    def __post_init__(self):
        shortest = self.min_tokens
        if shortest is not None and (isinstance(shortest, bool) or not isinstance(shortest, int) or shortest < 2):
            raise ValueError(
                f"GuardLadder min_tokens={shortest!r} must be an int >= 2 (the fewest prompt tokens a switch maps; "
                "the break-even length of `benchmarks/ladder/ladder_lengths.py`), or None to map every length."
            )
        tokens = self.check_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(
                f"GuardLadder check_tokens={tokens!r} must be an int >= 1: how many answer tokens the check reads."
            )
        if tokens > 1 and self.min_margin is None:
            raise ValueError(
                f"GuardLadder check_tokens={tokens} reads answer tokens for a check, but min_margin is None (no "
                "check); give min_margin, or leave check_tokens at 1."
            )
        if self.min_margin is not None:
            value = self.min_margin
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"GuardLadder min_margin={value!r} must be a number in [0, 1] (a probability margin), or None "
                    "for no check after the rung."
                )
            self.min_margin = float(value)
        self.probe = probe_from_dict(self.probe).settings()  # unknown probes and options raise here
        self.strategy = strategy_from_dict(self.strategy).settings()
        self.rungs = [_rung(rung) for rung in _rung_list(self.rungs)]
        for low, high in zip(self.rungs, self.rungs[1:]):  # a sparse rung is cheaper than a repair of its fraction
            if not (
                high.max_risk > low.max_risk and (high.fraction, not high.sparse) > (low.fraction, not low.sparse)
            ):
                raise ValueError(
                    f"Ladder rungs must rise in both max_risk and fraction (a sparse rung may come before a repair of "
                    f"its fraction); got {low} then {high}. Drop the rung that does not."
                )

    def rung_for(self, risk: float) -> LadderRung | None:
        """The rung of a row with this risk, or `None` for the fallback (a NaN risk falls back)."""
        return next((rung for rung in self.rungs if risk <= rung.max_risk), None)

    def fraction_for(self, risk: float) -> float | None:
        """The repair fraction of a row with this risk, or `None` for the fallback (a NaN risk falls back)."""
        rung = self.rung_for(risk)
        return None if rung is None else rung.fraction

    def sparse_plan(self, risks: Sequence[float] | torch.Tensor) -> list[bool]:
        """Whether each row's rung is a sparse one (`LadderRung.sparse`)."""
        return [bool(rung is not None and rung.sparse) for rung in map(self.rung_for, map(float, risks))]

    def too_short(self, tokens: int) -> bool:
        """Whether a prompt (or a session's span) of `tokens` tokens is below `min_tokens`: the target prefills it."""
        return self.min_tokens is not None and tokens < self.min_tokens

    def plan(self, risks: Sequence[float] | torch.Tensor, tokens: Sequence[int] | None = None) -> list[float | None]:
        """`fraction_for` of every row; with each row's prompt `tokens`, `None` (the fallback) for a row below
        `min_tokens` whatever its risk."""
        plan = [self.fraction_for(float(risk)) for risk in risks]
        if tokens is None:
            return plan
        return [None if self.too_short(n) else fraction for fraction, n in zip(plan, tokens, strict=True)]

    def to_dict(self) -> dict[str, Any]:
        settings = {
            "probe": dict(self.probe),
            "strategy": dict(self.strategy),
            "rungs": [  # `sparse` only where set: the settings (and hashes) of ladders without one hold
                {"max_risk": rung.max_risk, "fraction": rung.fraction, **({"sparse": True} if rung.sparse else {})}
                for rung in self.rungs
            ],
            "calibration": self.calibration,
        }
        if self.min_margin is not None:  # absent otherwise: the settings (and hashes) of ladders without a check hold
            settings["min_margin"] = self.min_margin
        if self.check_tokens != 1:  # likewise: a check of the first token alone keeps the settings it had
            settings["check_tokens"] = self.check_tokens
        if self.min_tokens is not None:  # likewise: a ladder that maps every length keeps its settings
            settings["min_tokens"] = self.min_tokens
        return settings

    @classmethod
    def from_dict(cls, settings: GuardLadder | dict[str, Any]) -> GuardLadder:
        """A ladder from `to_dict()`'s output (a `GuardLadder` is returned as is)."""
        if isinstance(settings, GuardLadder):
            return settings
        if not isinstance(settings, dict):
            raise TypeError(f"A ladder is a GuardLadder or a dict of its fields; got {type(settings).__name__}.")
        optional = {"calibration", "min_margin", "check_tokens", "min_tokens"}
        unknown = set(settings) - {"probe", "strategy", "rungs"} - optional
        if unknown:
            raise ValueError(
                f"Unknown ladder settings {sorted(unknown)}; a ladder has probe, strategy, rungs (and optionally "
                f"{', '.join(sorted(optional))})."
            )
        missing = {"probe", "strategy", "rungs"} - set(settings)
        if missing:
            raise ValueError(f"The ladder settings lack {sorted(missing)}.")
        return cls(**settings)


def _rung_list(rungs) -> list:
    if isinstance(rungs, (str, bytes, dict)) or not isinstance(rungs, (list, tuple)):
        raise TypeError(
            f"Ladder rungs are a list of rungs; got a {type(rungs).__name__} ({rungs!r}). Pass e.g. "
            '[{"max_risk": 0.1, "fraction": 0.0}, {"max_risk": 0.5, "fraction": 0.3}] (or [] for a ladder that always '
            "falls back)."
        )
    return list(rungs)


def _rung(rung) -> LadderRung:
    """A `LadderRung` from itself or from `{"max_risk": ..., "fraction": ...}`."""
    if isinstance(rung, LadderRung):
        return rung
    if not isinstance(rung, dict):
        raise TypeError(
            f"A ladder rung is a LadderRung or a dict {{'max_risk': ..., 'fraction': ...}}; got a "
            f"{type(rung).__name__} ({rung!r}). Write [0.5, 0.2] as {{'max_risk': 0.5, 'fraction': 0.2}}."
        )
    unknown, missing = set(rung) - {"max_risk", "fraction", "sparse"}, {"max_risk", "fraction"} - set(rung)
    if unknown or missing:
        what = f"unknown {sorted(unknown)}" if unknown else f"missing {sorted(missing)}"
        raise ValueError(
            f"A ladder rung has max_risk and fraction (and optionally sparse); got {sorted(rung)} ({what})."
        )
    return LadderRung(**rung)


def below_margin(margin: float, min_margin: float) -> bool:
    """Whether the check after the rung sends a row back: its answer margin is below `min_margin` (a NaN margin too)."""
    return not float(margin) >= min_margin


def rung_name(fraction: float | None, sparse: bool = False) -> str:
    """`"mapped"`, `"repair:<fraction>"`, `"sparse:<fraction>"` or `"fallback"`."""
    if fraction is None:
        return FALLBACK
    if sparse:
        return f"sparse:{fraction:g}"
    return "mapped" if fraction == 0.0 else f"repair:{fraction:g}"


__all__ = ["FALLBACK", "GuardLadder", "LadderRung", "below_margin", "rung_name"]
