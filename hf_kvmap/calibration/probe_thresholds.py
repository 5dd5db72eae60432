"""Calibrating the guarded handoff's probe: ROC of a probe's risks against changed answers, and the threshold stored
in `MapperConfig.handoff_probe` (the ladder's calibration, with repair rungs between, is `hf_kvmap.calibration.ladder`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..serving.probes import Probe, probe_from_dict


def roc_curve(risks: Sequence[float], positives: Sequence[bool]) -> list[dict[str, float]]:
    """Every distinct threshold `t` (refuse when risk > t) with its true-alarm and false-alarm rates.

    `positives[i]` says item `i`'s handoff answer differs from the target's own. Rows are sorted by threshold; the
    first (`t` below every risk) refuses everything, the last accepts everything.
    """
    risks, positives = [float(r) for r in risks], [bool(p) for p in positives]
    if len(risks) != len(positives):
        raise ValueError(f"{len(risks)} risks but {len(positives)} labels.")
    n_pos, n_neg = sum(positives), len(positives) - sum(positives)
    thresholds = sorted(set(risks))
    rows = [{"threshold": thresholds[0] - 1.0 if thresholds else 0.0, "true_alarm": 1.0, "false_alarm": 1.0}]
    for t in thresholds:
        caught = sum(r > t for r, p in zip(risks, positives) if p)
        false = sum(r > t for r, p in zip(risks, positives) if not p)
        rows.append(
            {
                "threshold": t,
                "true_alarm": caught / n_pos if n_pos else float("nan"),
                "false_alarm": false / n_neg if n_neg else float("nan"),
            }
        )
    return rows


def auc(risks: Sequence[float], positives: Sequence[bool]) -> float:
    """Probability that a changed-answer item has a higher risk than an unchanged one (ties count half)."""
    pos = [float(r) for r, p in zip(risks, positives) if p]
    neg = [float(r) for r, p in zip(risks, positives) if not p]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def calibrate_threshold(risks: Sequence[float], positives: Sequence[bool], max_false_alarm: float = 0.1) -> float:
    """The lowest threshold whose false-alarm rate (refused items whose answer did not change) is at most
    `max_false_alarm`: it catches the most changed answers within that budget."""
    if not 0.0 <= max_false_alarm <= 1.0:
        raise ValueError(f"max_false_alarm={max_false_alarm} must be in [0, 1].")
    if not any(not p for p in positives):
        raise ValueError("No calibration item kept its answer: a false-alarm rate cannot be measured.")
    for row in roc_curve(risks, positives):
        if row["false_alarm"] <= max_false_alarm:
            return float(row["threshold"])
    raise AssertionError("unreachable: the last threshold refuses nothing")


def calibrate_probe(
    mapper,
    probe: Probe | str | dict,
    risks: Sequence[float],
    positives: Sequence[bool],
    *,
    max_false_alarm: float = 0.1,
    provenance: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Calibrate `probe`'s threshold on measured items and store it in `mapper.config.handoff_probe`.

    Args:
        mapper ([`MapperModel`]): the mapper; its config is updated (save it to keep the calibration).
        probe (`Probe`, `str` or `dict`): the probe whose risks were measured.
        risks (sequence of `float`): the probe's risk on each calibration item.
        positives (sequence of `bool`): whether each item's handoff answer differed from the target's own.
        max_false_alarm (`float`, *optional*, defaults to 0.1): the false-alarm budget.
        provenance (`dict`, *optional*): what the items were (tasks, seeds, counts), recorded beside the threshold.

    Returns:
        The `handoff_probe` dict: `probe` (settings), `threshold`, `max_false_alarm`, and the calibration's own
        true/false-alarm rates and item counts.
    """
    probe = probe if isinstance(probe, Probe) else probe_from_dict(probe)
    threshold = calibrate_threshold(risks, positives, max_false_alarm)
    n_pos = sum(map(bool, positives))
    n_neg = len(positives) - n_pos
    caught = sum(r > threshold for r, p in zip(risks, positives) if p)
    false = sum(r > threshold for r, p in zip(risks, positives) if not p)
    stored = {
        "probe": probe.settings(),
        "threshold": threshold,
        "max_false_alarm": max_false_alarm,
        "calibration": {
            "items": len(positives),
            "changed": n_pos,
            "true_alarm": caught / n_pos if n_pos else None,
            "false_alarm": false / n_neg,
            **(provenance or {}),
        },
    }
    mapper.config.handoff_probe = stored
    return stored


__all__ = ["auc", "calibrate_probe", "calibrate_threshold", "roc_curve"]
