"""What a serving team does at each task family and length, read mechanically off the sealed reports (docs/switch.md's
first screen): switch through the chosen repair, through its sparse prefill (the map-free peer of the same positions),
or re-prefill on the larger model, or stay on the smaller one.

The rule, per cell, in order (verdicts read lower bounds, as `report.verdict` does, with the protocol's thresholds):

1. fewer items than planned: no decision ("measuring");
2. the larger model no better than chance, or better than the smaller one on fewer than `min_gap_items` items: stay on
   the smaller model (nothing to keep, or no gap to recover);
3. the chosen repair meets the gap and retention targets and its first token's lower bound is sooner than the
   re-prefill: switch through it, unless its sparse peer meets them too and the map adds nothing (lower bound <= 0),
   where the sparse prefill serves (no map needed);
4. only the sparse peer meets them: switch through the sparse prefill;
5. neither: re-prefill on the larger model for its answers (the cheap rungs' shares are shown beside, so a team that
   accepts less than the target sees what it would get).
"""

from __future__ import annotations

from .protocol import SPARSE, load_protocol
from .report import verdict


def _figure(cell: dict, name: str, digits: int = 2, suffix: str = "") -> str:
    found = cell["figures"].get(name) or {}
    if found.get("value") is None:
        return "-"
    text = f"{found['value']:.{digits}f}{suffix}"
    if found.get("interval"):
        text += f" [{found['interval'][0]:.{digits}f}, {found['interval'][1]:.{digits}f}]"
    return text


def _passes(judged: dict) -> bool:
    return judged.get("gap") == "met" and judged.get("retention") == "met"


def _sooner(cell: dict, arm: str) -> bool:
    found = cell["figures"].get(f"{arm}/speedup") or {}
    return bool(found.get("interval")) and found["interval"][0] > 1.0


def decide(protocol, cell: dict) -> str:
    """The decision for one cell of a sealed report (the module docstring's rule)."""
    if not cell["items"] or "pending" in cell.get("verdict", {}):
        return f"measuring ({cell['items']} of {cell['planned']} items)"
    if not cell["target_beats_chance"]:
        return "stay on the 0.5B: the 1.5B does no better than chance"
    if not cell["gap_to_recover"]:
        return f"stay on the 0.5B: the 1.5B is right where it is wrong on only {cell['target_wins']} items"
    rung = cell["verdict"]["rung"]
    repair = _passes(cell["verdict"]) and _sooner(cell, rung)
    sparse = _passes(verdict(protocol, cell, SPARSE + rung)) and _sooner(cell, SPARSE + rung)
    adds = (cell["figures"].get(f"{rung}/map_adds") or {}).get("interval")
    if repair and not (sparse and adds is not None and adds[0] <= 0):
        return "switch: the repair"
    if sparse:
        return "switch: the sparse prefill (no map)"
    return "re-prefill on the 1.5B"


def markdown(results: list[dict]) -> str:
    """One row per planned cell of every sealed report in `results`, decision first; the map column tells apart the
    rows of two protocols that serve the same cells through other maps."""
    lines = [
        "| task | tokens | map | items | decision | repair: share of the gap | its first token | sparse prefill: share "
        "of the gap | its first token | the map adds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for report in results:
        protocol = load_protocol(report["protocol"]["path"])
        maps = ", ".join(protocol.settings["maps"])
        for cell in report["cells"]:
            if ":" in cell["task"]:  # follow-up questions: docs/sealed.md has them
                continue
            rung = protocol.chosen(cell["task"])
            decision = decide(protocol, cell)
            figures = ["-"] * 5
            if cell["items"] and "pending" not in cell.get("verdict", {}):
                gap = "gap" if cell["gap_to_recover"] else None
                figures = [
                    _figure(cell, f"{rung}/gap") if gap else "no gap",
                    _figure(cell, f"{rung}/speedup", 1, "x"),
                    _figure(cell, f"{SPARSE}{rung}/gap") if gap else "no gap",
                    _figure(cell, f"{SPARSE}{rung}/speedup", 1, "x"),
                    _figure(cell, f"{rung}/map_adds"),
                ]
            lines.append(
                f"| {cell['task']} | {cell['length']} | {maps} | {cell['items']}/{cell['planned']} | {decision} | "
                + " | ".join(figures)
                + " |"
            )
    names = ", ".join(f"`benchmarks/results/sealed/{r['protocol']['name']}.json`" for r in results)
    return (
        f"Generated from {names} by `benchmarks/sealed/decisions.py` (the rule in its docstring; the repair is each "
        "protocol's chosen rung, the sparse prefill its map-free peer of the same positions; in brackets 95 % paired "
        "bootstrap intervals over the items).\n\n" + "\n".join(lines)
    )


def headline(results: list[dict]) -> str:
    """One sentence per complete sealed cell of `results` (each protocol's report), for the README: its decision
    (docs/switch.md's rule), then the chosen rung's share of the gap, retention and first token, and what the map adds
    over the sparse prefill, each with its interval."""
    lines = []
    for report in results:
        protocol = load_protocol(report["protocol"]["path"])
        for cell in report["cells"]:
            if not cell["items"] or "pending" in cell["verdict"] or ":" in cell["task"]:
                continue
            rung = cell["verdict"]["rung"]
            gap = _figure(cell, f"{rung}/gap") if cell["gap_to_recover"] else "no gap to recover"
            lines.append(
                f"- {cell['task']} at {cell['length']} tokens ({cell['items']} items, protocol "
                f"`{report['protocol']['name']}`): **{decide(protocol, cell)}**. `{rung}`: share of the gap {gap}, "
                f"retention above chance {_figure(cell, f'{rung}/retention')}, first token "
                f"{_figure(cell, f'{rung}/speedup', 2, 'x')} sooner; the map adds {_figure(cell, f'{rung}/map_adds')} "
                "over the sparse prefill of the same positions."
            )
    source = ", ".join(f"`benchmarks/results/sealed/{r['protocol']['name']}.json`" for r in results)
    if not lines:
        return f"From {source}: no sealed cell is complete yet."
    return (
        f"The complete sealed cells and what to do there ([docs/switch.md](docs/switch.md)), from {source} "
        "([docs/sealed.md](docs/sealed.md)):\n\n" + "\n".join(lines)
    )
