"""The guarded-handoff section of docs/guard.md and the shipped mappers' calibrated probes come from the benchmark JSON."""

from __future__ import annotations

import json

from hf_kvmap import zoo


def test_shipped_probes_and_readme_come_from_the_benchmark():
    """Each shipped mapper's `handoff_probe` is the probe and threshold `benchmarks/handoff.py` chose, and the docs/guard.md
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
    from benchmarks import handoff_report

    page = (root / "docs" / "guard.md").read_text()
    section = re.search(r"<!-- handoff:start -->\n(.*?)<!-- handoff:end -->", page, re.DOTALL).group(1)
    assert section == handoff_report.markdown(
        result, session, "benchmarks/results/handoff.json", "benchmarks/results/handoff_session.json"
    )


def test_handoff_results_are_what_the_checkpoints_give():
    """`benchmarks/results/handoff.json` (every ROC, threshold, rate and cost) is what the report stage computes from
    the committed per-item checkpoints and cost medians."""
    import argparse
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    from benchmarks import handoff as script

    results = root / "benchmarks" / "results"
    committed = json.loads((results / "handoff.json").read_text())
    costs = json.loads((results / "handoff_costs.json").read_text())["costs"]
    args = argparse.Namespace(
        work=str(results / "handoff_items"),
        max_false_alarm=committed["run"]["max_false_alarm"],
        max_cost_fraction=committed["run"]["max_cost_fraction"],
    )
    recomputed = json.loads(json.dumps(script.analyse(args, costs)))
    assert recomputed["directions"] == committed["directions"]
