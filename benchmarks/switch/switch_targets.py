"""Where the targets of a switch that pays stand: each target the project set for the handoff on the real pair (long
conversations and documents, HumanEval, the guard ladder at 2K and 4K), the best point the results hold for it, and
whether it is met, computed from `benchmarks/results/long_switch.json` (`benchmarks.switch.long_switch_report`) and
`benchmarks/results/guard_ladder_long2k.json` (`benchmarks.ladder.guard_ladder`). Rendered into docs/switch.md by
`python -m benchmarks.docs`; nothing here is typed in but the targets themselves.
"""

from __future__ import annotations

from hf_kvmap.reporting import floor_retention, gap_recovered
from lab.real.long_tasks import CHANCE

from ..formatting import number_text, pct, retention_text, strategy_text

#: the most a repair may recompute for an answer target (a share of the prompt, refreshes while decoding included)
MAX_FRACTION = 0.3
#: retention and share of the source-to-target gap an answer target asks for
MIN_KEPT = 0.9
#: the speedup of the first token over the re-prefill asked for, per prompt length
MIN_SPEEDUP = {2048: 2.5, 4096: 3.0}
#: the guard ladder's budget of changed answers (held as a 0.95 upper bound) and the mean cost asked for at 2K
LADDER_CHANGED, LADDER_COST, LADDER_4K_ITEMS = 0.05, 0.5, 48
HUMANEVAL_PROBLEMS = 164


def _kept(arm: dict, beats: bool) -> float:
    """What an arm keeps of the target's advantage: its retention, and its share of the gap where there is one."""
    return min(arm["retention"] or 0.0, arm["gap_recovered"] if beats else 1.0)


def best_arm(group: dict, min_speedup: float | None = None) -> tuple[str, dict] | None:
    """The repair of `group` (one task at one length) at most `MAX_FRACTION` recomputed that keeps most of the
    target's advantage ([`_kept`]), meeting `min_speedup` where it can (ties: the faster); `None` where none was
    measured."""
    arms = [
        (name, arm)
        for name, arm in group["arms"].items()
        if name not in ("target", "source") and (arm.get("fraction") or 0.0) <= MAX_FRACTION + 1e-9
    ]
    if not arms:
        return None

    def order(item):
        arm = item[1]
        fast = min_speedup is None or (arm.get("speedup") or 0.0) >= min_speedup
        return (fast, _kept(arm, group["target_beats_source"]), arm.get("speedup") or 0.0)

    return max(arms, key=order)


#: how a HumanEval row names its rung (chosen on other tasks, never on HumanEval)
CHOSEN = "(chosen on the continuations)"


def _interval(arm: dict, key: str) -> str:
    """` [low, high]`: the arm's 95 % bootstrap interval (`long_switch_report.intervals`) where the results hold one."""
    bounds = arm.get(f"{key}_interval")
    return f" [{number_text(bounds[0])}, {number_text(bounds[1])}]" if bounds else ""


def _point(name: str, arm: dict, beats: bool, chosen: bool = False) -> str:
    gap = number_text(arm["gap_recovered"]) + _interval(arm, "gap") if beats else "none to recover (target <= source)"
    speed = f"{arm['speedup']:.1f}x" if arm.get("speedup") else "not timed beside the re-prefill"
    wins = f", the target's wins kept {arm['wins_kept'][0]}/{arm['wins_kept'][1]}" if arm.get("wins_kept") else ""
    label = f"`{name}` {CHOSEN}" if chosen else f"`{name}`"
    retention = retention_text(arm["retention"]) + _interval(arm, "retention")
    return f"{label}: retention {retention}, gap {gap}{wins}, first token {speed}"


def group_parts(name: str) -> tuple[str, int, int]:
    """A report group's name, `task@length#seed`, as `(task, length, seed)`."""
    task, rest = name.split("@")
    length, seed = (int(x) for x in rest.split("#"))
    return task, length, seed


def has_target(task: str, length: int) -> bool:
    """Whether a target names this task at this length: HumanEval at any, the others at `MIN_SPEEDUP`'s lengths (a
    group at another, 512 tokens, is in the tables only)."""
    return task == "humaneval" or length in MIN_SPEEDUP


def code_rung(groups: dict, report_seed: int = 1234) -> str | None:
    """The rung HumanEval is judged on, chosen on other tasks: the one of the continuations' selection set (long
    answers of code, item sets other than `report_seed`) that keeps most of the target's advantage at most
    `MAX_FRACTION` recomputed ([`best_arm`]); `None` where no continuation was measured."""
    for name, group in sorted(groups.items()):
        task, _, seed = group_parts(name)
        if task == "continuation" and seed != report_seed and group.get("items"):
            found = best_arm(group)
            if found is not None:
                return found[0]
    return None


def answer_rows(long_switch: dict, direction: str = "0.5b:1.5b", report_seed: int = 1234) -> list[tuple[str, ...]]:
    """The answer targets on the report item set: HumanEval (all problems, bare and behind long code; judged on the
    rung chosen on the continuations, [`code_rung`]) and the long conversations and documents at 2K and 4K (their
    best rung)."""
    rows = []
    groups = long_switch["results"].get(direction, {})
    chosen = code_rung(groups, report_seed)
    for name, group in sorted(groups.items()):
        task, length, seed = group_parts(name)
        if seed != report_seed or not group.get("items") or task == "continuation" or not has_target(task, length):
            continue
        code = task == "humaneval"  # judged on the rung chosen elsewhere, never on its own best
        speedup = None if code else MIN_SPEEDUP.get(length)
        if code:
            found = (chosen, group["arms"][chosen]) if chosen in group["arms"] else None
        else:
            found = best_arm(group, speedup)
        beats = group["target_beats_source"]
        where = f"{task} @ {group['tokens']} tokens, {group['items']} items"
        if task == "humaneval":
            target = (
                f">= {MIN_KEPT} retention and of the gap at <= {pct(MAX_FRACTION)}, all {HUMANEVAL_PROBLEMS} problems"
            )
            where = (
                f"HumanEval {'bare' if length == 0 else f'behind {length} tokens of code'}, {group['items']} problems"
            )
        else:
            target = f">= {MIN_KEPT} retention and of the gap, first token >= {speedup}x sooner"
        if found is None:
            missing = f"`{chosen}` {CHOSEN} not measured" if code else "no repair measured"
            rows.append((target, where, missing, "not measured"))
            continue
        arm_name, arm = found
        met = _kept(arm, beats) >= MIN_KEPT - 1e-9 and (speedup is None or (arm.get("speedup") or 0.0) >= speedup)
        if task == "humaneval" and group["items"] < HUMANEVAL_PROBLEMS:
            verdict = f"not yet: {group['items']} of {HUMANEVAL_PROBLEMS} problems" + ("" if met else ", and missed")
        elif met and not beats:
            verdict = "retention met; no gap to recover on these items"
        else:
            verdict = "met" if met else "missed"
        rows.append((target, where, _point(arm_name, arm, beats, chosen=code), verdict))
    return rows


def fixed_rows(long_ladder: dict) -> list[tuple[str, ...]]:
    """The answer targets again on the guard ladder's larger item sets at the length it was calibrated at: every
    fixed repair it measured served to every request, per task, with its cost (the mapping and the repair over the
    item's own prefill, timed side by side; a first token `MIN_SPEEDUP` times sooner is a cost of at most its
    inverse). Where the records hold the source's answers, the gap too."""
    rows = []
    calibrated = long_ladder["run"]["tokens"]
    for data in long_ladder["directions"].values():
        if data.get("report_tokens", calibrated) != calibrated:
            continue
        for strategy, points in data["fixed_report"].items():
            for task in sorted(points[0]["tasks"]):
                best = None
                for point in points:
                    result = point["tasks"][task]
                    if not point["fraction"] or point["fraction"] > MAX_FRACTION + 1e-9 or "mean_cost" not in result:
                        continue
                    retention = floor_retention(  # floor-normalized, as long_switch_report's
                        result["accuracy"], result["target"], CHANCE.get(task, 0.0), data["report_items_per_task"]
                    )
                    gap = (
                        gap_recovered(result["accuracy"], result["target"], result["source"])
                        if "source" in result
                        else None
                    )
                    beats = "source" in result and result["target"] > result["source"]
                    kept = min(retention or 0.0, gap if beats else 1.0)
                    fast = result["mean_cost"] <= 1.0 / MIN_SPEEDUP[calibrated]
                    candidate = ((fast, kept, -result["mean_cost"]), point["fraction"], retention, gap, result, beats)
                    if best is None or candidate[0] > best[0]:
                        best = candidate
                if best is None:
                    continue
                (fast, kept, _), fraction, retention, gap, result, beats = best
                if "source" not in result:
                    gap_text, verdict = "not measured (no source answers)", "retention only"
                else:
                    gap_text = number_text(gap) if beats else "none to recover (target <= source)"
                    verdict = "met" if fast and kept >= MIN_KEPT - 1e-9 else "missed"
                rows.append(
                    (
                        f">= {MIN_KEPT} retention and of the gap, cost <= {1.0 / MIN_SPEEDUP[calibrated]:g} of a "
                        f"prefill (a first token {MIN_SPEEDUP[calibrated]}x sooner)",
                        f"{task} @ {calibrated} tokens, the ladder's {data['report_items_per_task']} report items",
                        f"`{strategy_text(strategy)}@{fraction:g}`: retention "
                        f"{retention_text(retention)}, gap {gap_text}, "
                        f"cost {number_text(result['mean_cost'])}",
                        verdict,
                    )
                )
    return rows


def _bound_points(data: dict) -> list[tuple[str, float, float]]:
    """(label, the worst task's share of changed answers, mean cost) on the report set of each way a ladder
    direction holds to the confidence bound (the probe alone, and with the check after the rung)."""
    points = []
    for name, label in (("ladder_confident", "probe only"), ("ladder_checked_confident", "with the check")):
        if name in data:
            report = data[name]["report"]
            worst = max(g["changed_served"] for g in report["per_group"].values())
            points.append((label, worst, report["mean_cost"]))
    return points


def _points_text(points: list[tuple[str, float, float]]) -> str:
    return "; ".join(
        f"{label}: cost {number_text(cost)}, worst task {pct(worst, 1)} changed" for label, worst, cost in points
    )


def ladder_rows(long_ladder: dict) -> list[tuple[str, ...]]:
    """The guard ladder's targets: at the length it was calibrated at, held to the bound, the changed answers served
    within the budget at a mean cost of at most `LADDER_COST`; and a report set of at least `LADDER_4K_ITEMS` items a
    task at 4K."""
    rows = []
    calibrated = long_ladder["run"]["tokens"]
    for key, data in long_ladder["directions"].items():
        if data.get("report_tokens", calibrated) != calibrated:
            continue
        items = data["report_items_per_task"]
        points = _bound_points(data)
        within = [worst <= LADDER_CHANGED + 1e-9 for _, worst, _ in points]
        cheap = [cost <= LADDER_COST for _, _, cost in points]
        if any(a and b for a, b in zip(within, cheap)):
            verdict = "met"
        elif any(cheap):
            verdict = "cost met; changed answers over the budget on the report set"
        elif any(within):
            verdict = "changed answers within the budget; cost missed"
        else:
            verdict = "missed"
        rows.append(
            (
                f"ladder at {calibrated} tokens held to the 0.95 bound: <= {pct(LADDER_CHANGED)} changed, mean cost "
                f"<= {LADDER_COST}",
                f"{key}, {items} report items a task",
                _points_text(points),
                verdict,
            )
        )
    at_4k = [d for d in long_ladder["directions"].values() if d.get("report_tokens") == 4096]
    items = max((d["report_items_per_task"] for d in at_4k), default=0)
    widest = next((d for d in at_4k if d["report_items_per_task"] == items), None)
    verdict = "met" if items >= LADDER_4K_ITEMS else "not yet measured"
    if 0 < items < LADDER_4K_ITEMS:
        verdict = f"not yet: {items} of {LADDER_4K_ITEMS} items a task"
    rows.append(
        (
            f"the ladder's frontier at 4K on >= {LADDER_4K_ITEMS} items a task",
            f"{items} items a task at 4096 tokens" if at_4k else "no 4K report set",
            _points_text(_bound_points(widest)) if widest else "-",
            verdict,
        )
    )
    return rows


def reverse_rows(long_switch: dict, direction: str = "1.5b:0.5b") -> list[tuple[str, ...]]:
    """The other direction's target: the same tasks with the frontier reported. Which (task, length) groups were
    measured there, with how many items, and which of the forward direction's are missing."""
    forward = {  # the forward direction's groups at the lengths a target names
        name.split("#")[0]
        for name in long_switch["results"].get("0.5b:1.5b", {})
        if has_target(*group_parts(name)[:2])
    }
    mine = long_switch["results"].get(direction, {})
    measured = sorted(f"{name.split('#')[0]} ({group['items']})" for name, group in mine.items() if group.get("items"))
    missing = sorted(forward - {name.split("#")[0] for name in mine})
    partial = sorted(  # HumanEval is one fixed set: fewer problems than all of it is a run not finished
        f"{name.split('#')[0]} on {group['items']} of {HUMANEVAL_PROBLEMS} problems"
        for name, group in mine.items()
        if group_parts(name)[0] == "humaneval" and group.get("items", 0) < HUMANEVAL_PROBLEMS
    )
    gaps = ([f"not measured: {', '.join(missing)}"] if missing else []) + partial
    verdict = "reported" if not gaps else f"reported in part; {'; '.join(gaps)}"
    return [
        (
            f"{direction.replace(':', ' -> ')}: the same tasks, the frontier reported",
            ", ".join(measured) if measured else "nothing measured",
            "the tables below",
            verdict,
        )
    ]


def markdown(long_switch: dict, long_ladder: dict) -> str:
    rows = answer_rows(long_switch) + fixed_rows(long_ladder) + ladder_rows(long_ladder) + reverse_rows(long_switch)
    lines = [
        "Generated from `benchmarks/results/long_switch.json` and `benchmarks/results/guard_ladder_long2k.json` by "
        "`benchmarks/switch/switch_targets.py` (0.5b -> 1.5b, report item sets; the best repair at most "
        f"{pct(MAX_FRACTION)} recomputed for each answer target, HumanEval's chosen on the continuations' selection "
        "set). In brackets: 95 % paired bootstrap intervals over the items (`long_switch_report.intervals`), given "
        "on sets of at least 24 items (a gap's where enough items separate the two models to bound it). Verdicts "
        "read the point estimates.",
        "",
        "| target | measured on | best point reached | verdict |",
        "|---|---|---|---|",
    ]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines)
