"""The guarded-handoff section of docs/guard.md and the shipped mappers' calibrated probes come from the benchmark JSON."""

from __future__ import annotations

import json
import math

import pytest

from hf_kvmap import zoo

#: the numbers of the analysis (fitted weights, thresholds, AUCs, costs) move with the CPU's float kernels by about
#: 1e-14 of their size; the ROC thresholds are rounded to 6 decimals, where such a move can flip the last one
REL_TOL, ABS_TOL, ROC_TOL = 1e-7, 1e-12, 1.5e-6
#: what the analysis decides, compared exactly: shares of items (counts over a count) and the guarded serving
DECISIONS = {"true_alarm", "false_alarm", "refused", "fallback_rate", "changed_answers_served", "changed", "kept"}


def test_shipped_probes_and_readme_come_from_the_benchmark():
    """Each shipped mapper's `handoff_probe` is the probe and threshold `benchmarks/handoff/handoff.py` chose, and the docs/guard.md
    section is exactly what the benchmark JSON renders."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = json.loads((root / "benchmarks" / "results" / "handoff.json").read_text())
    session = json.loads((root / "benchmarks" / "results" / "handoff_session.json").read_text())
    for name, direction in result["directions"].items():
        stored = json.loads((zoo.mapper_path(direction["source"], direction["target"]) / "config.json").read_text())
        chosen = direction["probes"][direction["chosen"]]
        assert stored["handoff_probe"]["probe"] == chosen["settings"], name
        assert stored["handoff_probe"]["threshold"] == chosen["threshold"], name
    from benchmarks.handoff import handoff_report

    page = (root / "docs" / "guard.md").read_text()
    section = re.search(r"<!-- handoff:start -->\n(.*?)<!-- handoff:end -->", page, re.DOTALL).group(1)
    assert section == handoff_report.markdown(
        result, session, "benchmarks/results/handoff.json", "benchmarks/results/handoff_session.json"
    )


def _differences(recomputed, committed, path: str = "", decision: bool = False) -> list[str]:
    """Where `recomputed` is not `committed`: decisions (every string, bool, int, `DECISIONS` share, the accuracy
    shares) exactly, other numbers within the tolerances above."""
    if isinstance(committed, dict) and isinstance(recomputed, dict):
        if sorted(recomputed) != sorted(committed):
            return [f"{path}: keys {sorted(recomputed)} != {sorted(committed)}"]
        return [
            difference
            for name in committed
            for difference in _differences(
                recomputed[name],
                committed[name],
                f"{path}/{name}",
                decision or name in DECISIONS or path.endswith("/accuracy") or "/guarded_report" in path,
            )
        ]
    if isinstance(committed, list) and isinstance(recomputed, list):
        if len(recomputed) != len(committed):
            return [f"{path}: {len(recomputed)} entries != {len(committed)}"]
        return [
            d
            for i, (a, b) in enumerate(zip(recomputed, committed))
            for d in _differences(a, b, f"{path}[{i}]", decision)
        ]
    numbers = all(isinstance(x, float) for x in (recomputed, committed)) or (
        {type(recomputed), type(committed)} <= {int, float} and float in {type(recomputed), type(committed)}
    )
    if numbers and not decision:
        tolerance = ROC_TOL if "/roc/" in path else ABS_TOL
        if math.isclose(recomputed, committed, rel_tol=REL_TOL, abs_tol=tolerance):
            return []
    elif type(recomputed) is type(committed) and recomputed == committed:
        return []
    return [f"{path}: {recomputed!r} != {committed!r}"]


@pytest.mark.numerics
def test_handoff_results_are_what_the_checkpoints_give():
    """`benchmarks/results/handoff.json` (every ROC, threshold, rate and cost) is what the report stage computes from
    the committed per-item checkpoints and cost medians: the chosen probe, every accepted/refused share and the guarded
    serving exactly, the fitted numbers to float-kernel noise."""
    import argparse
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    from benchmarks.handoff import handoff as script

    results = root / "benchmarks" / "results"
    committed = json.loads((results / "handoff.json").read_text())
    costs = json.loads((results / "handoff_costs.json").read_text())["costs"]
    args = argparse.Namespace(
        work=str(results / "handoff_items"),
        max_false_alarm=committed["run"]["max_false_alarm"],
        max_cost_fraction=committed["run"]["max_cost_fraction"],
    )
    recomputed = json.loads(json.dumps(script.analyse(args, costs)))
    assert _differences(recomputed["directions"], committed["directions"]) == []
    # the choice and the serving decisions are there to compare, not only numbers
    for name, direction in committed["directions"].items():
        assert recomputed["directions"][name]["chosen"] == direction["chosen"], name
        assert recomputed["directions"][name]["guarded_report"] == direction["guarded_report"], name


def test_the_handoff_comparison_tells_a_changed_decision_apart():
    """`_differences` passes float-kernel noise and fails a changed share, a changed choice or a larger move."""
    committed = {"chosen": "a", "probes": {"a": {"threshold": 0.5, "report": {"pooled": {"refused": 0.25}}}}}
    noisy = json.loads(json.dumps(committed))
    noisy["probes"]["a"]["threshold"] = 0.5 * (1 + 1e-14)
    assert _differences(noisy, committed) == []
    for edit in (
        lambda r: r.update(chosen="b"),
        lambda r: r["probes"]["a"].update(threshold=0.5 * (1 + 1e-6)),
        lambda r: r["probes"]["a"]["report"]["pooled"].update(refused=0.25 * (1 + 1e-14)),
    ):
        changed = json.loads(json.dumps(committed))
        edit(changed)
        assert _differences(changed, committed) != []
