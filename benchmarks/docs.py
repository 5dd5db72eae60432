"""Every generated section of the docs, from the committed results JSON: `python -m benchmarks.docs [--check]`.

The pages (`docs/*.md`) and `README.md` hold hand-written narrative around marked sections
(`<!-- name:start -->` ... `<!-- name:end -->`); this command rewrites every section from `benchmarks/results/`, and
`--check` only reports the sections that differ (exit status 1), which is what `pytest -m docs` checks. The
benchmarks write JSON (and plots, cards); nothing else writes the docs, and the library never does.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from .formatting import pct
from .handoff import handoff_report
from .ladder import ladder_calibration_size, ladder_headroom, ladder_lengths
from .real import family_report, guard, scale_report
from .repair import real_repair_maps, repair_attention, repair_report
from .sealed import decisions as sealed_decisions
from .sealed import report as sealed_report
from .sections import demo_markdown, performance_markdown, replace_section
from .speed import packed_attention, pair_timing, portable_fit
from .switch import long_switch_report, map_compare, switch_targets
from .variants import mapper_variants, package_size, retention_curve, variant_parameters

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


#: the `benchmarks.repair.real_repair` runs of one pair with different maps that docs/repair.md sets side by side
REPAIR_MAPS = ("real_repair.json", "real_repair_kl.json")


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def errata(name: str) -> list[dict]:
    """The known defects of results file `name` (`benchmarks/results/errata.json`): what they invalidate, and why."""
    return [entry for entry in _json("errata.json")["errata"] if name in entry["results"]]


def with_errata(name: str, markdown: str) -> str:
    """`markdown` rendered from results file `name`, behind a warning for each of its known defects."""
    notes = [
        f"> **Erratum ({entry['found']}, fixed in {entry['fixed_in']}): do not use {entry['affected']} in this "
        f"section.** Cause: {entry['cause']}. Not affected: {entry['not_affected']}. Regression test: "
        f"`{entry['check']}`. Re-measured: {entry['remeasured']}."
        for entry in errata(name)
    ]
    return "\n\n".join([*notes, markdown])


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _variants(name: str) -> str:
    """A `benchmarks.variants.mapper_variants` comparison: every variant per direction and the rule's choice."""
    result = _json(name)
    return f"Generated from `benchmarks/results/{name}`.\n\n{mapper_variants.markdown(result['directions'], result['choice'])}"


def _held_out(paths: list[Path]) -> str:
    sources = ", ".join(f"`{_relative(path)}`" for path in paths)
    return f"Generated from {sources} (`hf-kvmap eval`).\n\n{mapper_variants.held_out_markdown(paths)}"


def held_out_shipped_paths() -> list[Path]:
    """The held-out evaluation of the variant each direction ships (the choice of the last comparison)."""
    choice = _json("mapper_variants_longer.json")["choice"]
    paths = []
    for direction, chosen in sorted(choice.items()):
        found = [
            path
            for folder in ("held_out_attention", "held_out_longer")
            for path in (RESULTS / folder).glob(f"{chosen['variant']}_{direction}.json")
        ]
        if len(found) != 1:
            raise ValueError(f"{direction}: expected one held-out evaluation of {chosen['variant']}, found {found}.")
        paths += found
    return paths


def _handoff() -> str:
    session = RESULTS / "handoff_session.json"
    return handoff_report.markdown(
        _json("handoff.json"),
        json.loads(session.read_text()) if session.exists() else None,
        "benchmarks/results/handoff.json",
        "benchmarks/results/handoff_session.json",
    )


#: the real pair's guard ladder runs of before the 100-item calibration, kept in the ladder's history
#: (docs/notes/2026-12-07-ladder-history.md), each rendered (with its plot) once its JSON is committed
HISTORY_LADDERS = (
    ("guard_ladder_real.json", "The real pair, 0.5B -> 1.5B, repairing by the source's attention or the tail."),
    ("guard_ladder_real_draft.json", "The real pair, 0.5B -> 1.5B, repairing by the source's draft attention."),
    ("guard_ladder_real_reverse.json", "The real pair, 1.5B -> 0.5B."),
    (
        "guard_ladder_real_kl.json",
        "The real pair, 0.5B -> 1.5B, the read-back-KL-tuned map, repairing by the source's draft attention.",
    ),
    (
        "guard_ladder_real_kl_2024.json",
        "The same, calibrated on the same selection set, replayed on a second report set (seed 2024).",
    ),
)

#: the real pair's guard ladder runs docs/ladder.md shows: the latest calibration, on both report sets
REAL_LADDERS = (
    (
        "guard_ladder_real_kl100.json",
        "The real pair, 0.5B -> 1.5B, the read-back-KL-tuned map, calibrated on 100 items per task, with the budget "
        "also held as an upper confidence bound.",
    ),
    (
        "guard_ladder_real_kl100_2024.json",
        "The same 100-item calibration, replayed on the second report set (seed 2024).",
    ),
)


#: the guard ladder calibrated on the long forms at 2K and replayed at each report length (docs/switch.md)
#: the sealed protocols' reports (`benchmarks/results/sealed/<name>.json`) the README headline and the switch decisions
#: read, each protocol's map named in its rows
SEALED = ("whole-context", "whole-context-conv4k", "switch-chat-doc")
LONG_LADDER = "guard_ladder_long2k.json"
#: the perfect probe against the calibrated ladder on the same long-form records (`benchmarks.ladder.ladder_headroom`)
LONG_HEADROOM = "ladder_headroom_long2k.json"


def _long_ladder() -> str:
    """The guard ladder on `long_chat`/`long_doc` (`benchmarks.ladder.guard_ladder --tasks long_chat,long_doc --report-tokens
    ...`): its saving per report length, then the whole run as docs/ladder.md shows one, with its plot; until that run
    is committed, the command that writes it."""
    path = RESULTS / LONG_LADDER
    if not path.exists():
        return (
            f"Not measured yet: `benchmarks/results/{LONG_LADDER}` is written by the `guard_ladder` command with "
            "`--tasks long_chat,long_doc --tokens 2048 --report-tokens 2048,512,1024,4096:48` in `benchmarks/README.md`."
        )
    result = json.loads(path.read_text())
    return (
        f"Generated from `{_relative(path)}`. The saving per length, each report set served by the ladder calibrated "
        f"on the selection set at {result['run']['tokens']:,} tokens:\n\n"
        + ladder_lengths.markdown(result)
        + f"\n\n![cost and changed answers per prompt length](../benchmarks/results/{path.stem}_lengths.png)\n\n"
        + repair_report.ladder_markdown(result, _relative(path))
        + f"\n\n![the guard ladder on the long forms](../benchmarks/results/{path.with_suffix('.png').name})"
    )


def _long_ladder_headroom() -> str:
    """What a perfect probe would save on the long forms' records, and how well each real probe separates the
    requests each rung changes (`benchmarks.ladder.ladder_headroom` over the long ladder's records)."""
    path = RESULTS / LONG_HEADROOM
    if not path.exists():
        return (
            f"Not measured yet: `benchmarks/results/{LONG_HEADROOM}` is written by `python -m benchmarks.ladder.ladder_headroom` "
            f"over the records of `benchmarks/results/{LONG_LADDER.removesuffix('.json')}/` (benchmarks/README.md)."
        )
    return ladder_headroom.markdown(json.loads(path.read_text()), _relative(path))


def _real_ladders(runs: tuple[tuple[str, str], ...], results: str) -> str:
    """Each real-pair run of `runs` that is measured (`--family real --out benchmarks/results/guard_ladder_real*.json`),
    with its plot; `results` is the results folder as the page links it."""
    text = ""
    for name, title in runs:
        real = RESULTS / name
        if real.exists():
            plot = real.with_suffix(".png").name
            text += (
                f"\n\n**{title}** "
                + repair_report.ladder_markdown(json.loads(real.read_text()), _relative(real))
                + f"\n\n![{title}]({results}/{plot})"
            )
    return text


def _guard_ladder() -> str:
    """The guard ladder of the tiny family (`benchmarks.ladder.guard_ladder`), then the real pair's runs of `REAL_LADDERS`."""
    return repair_report.ladder_markdown(_json("guard_ladder.json")) + _real_ladders(
        REAL_LADDERS, "../benchmarks/results"
    )


def headline_tiny() -> str:
    """README: per shipped direction, the report-set accuracy of the target alone, the mapped cache and guarded
    serving (`benchmarks.handoff.handoff`), with the fallback rate and the net saving per request."""
    result = _json("handoff.json")
    lines = [
        f"From `benchmarks/results/handoff.json` ({result['run']['items_per_task_and_set']} held-out items per task; "
        "exact match; the full study: [docs/guard.md](docs/guard.md), the variants: "
        "[docs/results-tiny-family.md](docs/results-tiny-family.md)).",
        "",
        "| direction | recall: target / mapped / guarded | chat: target / mapped / guarded | fallback recall / chat "
        "| net saving per request |",
        "|---|---|---|---|---|",
    ]
    for name, direction in result["directions"].items():
        cells = []
        for task in ("recall", "chat"):
            accuracy, guarded = direction["accuracy"][f"report/{task}"], direction["guarded_report"][task]
            cells.append(f"{accuracy['target_own']:.2f} / {accuracy['mapped']['1']:.2f} / {guarded['accuracy']:.2f}")
        fallback = " / ".join(pct(direction["guarded_report"][task]["fallback_rate"]) for task in ("recall", "chat"))
        cost = direction["cost_per_request_ms"]
        lines.append(
            f"| {name} | {cells[0]} | {cells[1]} | {fallback} | {cost['net_saving']:.1f} ms of "
            f"{cost['target_prefill_avoided']:.1f} ({pct(cost['net_saving_fraction'])}) |"
        )
    return "\n".join(lines)


#: the real pair's repair runs the README sets side by side: (results file, the map's name)
HEADLINE_REPAIRS = (
    ("real_repair.json", "the paper's ridge"),
    ("real_repair_kl.json", "the same ridge, KL-tuned on read-back prompts"),
    ("real_repair_reverse.json", "the paper's ridge"),
)


def headline_repair() -> str:
    """README: the real pair's report set (`benchmarks.repair.real_repair`), per direction and map: the target alone, the
    mapped cache and the repair chosen on the selection set, on the two exact-match tasks."""
    tasks = ("prose_retrieval", "chat_recall")
    first = _json(HEADLINE_REPAIRS[0][0])
    items = first["run"]["report"]["items"]
    lines = [
        f"From `benchmarks/results/real_repair*.json` (Qwen2.5-Coder 0.5B and 1.5B, {items} held-out items per task, "
        "exact match; the repair is the strategy and fraction chosen on a separate selection set; the full study: "
        "[docs/repair.md](docs/repair.md), the guard on this pair: [docs/guard.md](docs/guard.md)).",
        "",
        "| direction | map | repair | " + " | ".join(f"{task}: target / mapped / repaired" for task in tasks) + " |",
        "|---|---|---|" + "---|" * len(tasks),
    ]
    for name, label in HEADLINE_REPAIRS:
        result = _json(name)
        chosen, report = result["chosen_on_selection"], result["sets"]["report"]
        if ("KL" in label) != ("kl" in (result["run"]["mapper_config"].get("fine_tunes") or [])):
            raise ValueError(f"{name}: the label {label!r} does not say how its map was fitted")
        cells = []
        for task in tasks:
            repaired = result["chosen_reported"][task]["score"]
            cells.append(f"{report[task]['target']:.2f} / {report[task]['mapped']:.2f} / {repaired:.2f}")
        direction = result["run"]["direction"].replace(":", "-to-")
        lines.append(
            f"| {direction} | {label} | `{chosen['strategy']}`, {pct(chosen['fraction'])} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def published_retention() -> str:
    """docs/method.md: the paper's retention table, from the one copy kept as data (`family_report.PAPER_TABLE`)."""
    return "\n".join(family_report.PAPER_TABLE)


def published_latency() -> str:
    """docs/method.md: the paper's latency table, from the one copy kept as data (`gpu_shapes.PAPER`)."""
    from .gpu.gpu_shapes import DIRECTIONS, PAPER

    head, rule = "| tokens |", "|---|"
    for name in PAPER:
        head += f" {'->'.join(DIRECTIONS[name])} mapper / re-prefill (ms) | speedup |"
        rule += "---|---|"
    lines = [head, rule]
    for tokens in sorted({count for table in PAPER.values() for count in table}):
        label = f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)
        cells = "".join(
            f" {mapper:.1f} / {prefill:.1f} | {speedup}x |"
            for mapper, prefill, speedup in (PAPER[n][tokens] for n in PAPER)
        )
        lines.append(f"| {label} |{cells}")
    return "\n".join(lines)


#: page (relative to the repository root) -> section name -> what renders it from the committed JSON
SECTIONS: dict[str, dict[str, Callable[[], str]]] = {
    "README.md": {
        "headline-tiny": headline_tiny,
        "headline-repair": headline_repair,
        "headline-sealed": lambda: sealed_decisions.headline([_json(f"sealed/{name}.json") for name in SEALED]),
        "package-weight": lambda: package_size.markdown(_json("package_size.json")),
        "pair-timing": lambda: pair_timing.markdown(_json("pair.json")),
    },
    "docs/results-tiny-family.md": {
        "demo-results": lambda: demo_markdown(_json("demo.json"), "benchmarks/results/demo.json"),
        "mapper-variants": lambda: _variants("mapper_variants.json"),
        "mapper-variants-objectives": lambda: _variants("mapper_variants_objectives.json"),
        "mapper-held-out": lambda: _held_out(sorted((RESULTS / "held_out").glob("*.json"))),
        "mapper-variants-shipped": lambda: _variants("mapper_variants_longer.json"),
        "mapper-held-out-shipped": lambda: _held_out(held_out_shipped_paths()),
    },
    "docs/fitting.md": {
        "retention-curve": lambda: (
            "Generated from `benchmarks/results/retention_curve.json` by `benchmarks/variants/retention_curve.py`.\n\n"
            + retention_curve.markdown(_json("retention_curve.json"))
        ),
        "variant-parameters": lambda: (
            "Generated from `benchmarks/results/variant_parameters.json` by `benchmarks/variants/variant_parameters.py`.\n\n"
            + variant_parameters.markdown(_json("variant_parameters.json"))
        ),
    },
    "docs/guard.md": {
        "handoff": _handoff,
        "real-guard": lambda: guard.guard_markdown(_json("real_family_guard.json")),
    },
    "docs/real-family.md": {
        "map-choice-4k": lambda: map_compare.markdown(_json("map-choice/4096-summary.json")),
        "real-family": lambda: with_errata(
            "real_family.json", family_report.report_markdown(_json("real_family.json"))
        ),
        "real-scale": lambda: with_errata(
            "real_family_scale.json", scale_report.report_markdown(_json("real_family_scale.json"))
        ),
        "portable-fit": lambda: portable_fit.markdown(_json("portable_fit.json")),
    },
    "docs/repair.md": {
        "repair-frontier": lambda: repair_report.frontier_markdown(_json("repair_frontier.json")),
        "repair-frontier-knee": lambda: repair_report.frontier_markdown(
            _json("repair_frontier_knee.json"), "benchmarks/results/repair_frontier_knee.json"
        ),
        "repair-cost": lambda: repair_report.cost_markdown(_json("repair_cost.json")),
        "real-repair": lambda: repair_report.real_repair_markdown(_json("real_repair.json")),
        "repair-attention": lambda: repair_attention.markdown(_json("repair_attention.json")),
        "real-repair-reverse": lambda: repair_report.real_repair_markdown(
            _json("real_repair_reverse.json"), "benchmarks/results/real_repair_reverse.json"
        ),
        "real-repair-maps": lambda: real_repair_maps.maps_markdown(
            [_json(name) for name in REPAIR_MAPS], [f"benchmarks/results/{name}" for name in REPAIR_MAPS]
        ),
        "real-repair-cost": lambda: repair_report.cost_markdown(
            _json("repair_cost_real.json"), source="benchmarks/results/repair_cost_real.json"
        ),
        "real-repair-cost-draft": lambda: repair_report.cost_markdown(
            _json("repair_cost_real_draft.json"), source="benchmarks/results/repair_cost_real_draft.json"
        ),
    },
    "docs/ladder.md": {
        "guard-ladder": _guard_ladder,
        "ladder-calibration-size": lambda: ladder_calibration_size.markdown(_json("ladder_calibration_size.json")),
        "ladder-headroom": lambda: ladder_headroom.markdown(_json("ladder_headroom.json")),
    },
    "docs/notes/2026-12-07-ladder-history.md": {
        "guard-ladder-history": lambda: _real_ladders(HISTORY_LADDERS, "../../benchmarks/results").lstrip("\n"),
    },
    "docs/method.md": {
        "published-retention": published_retention,
        "published-latency": published_latency,
    },
    "docs/switch.md": {
        "switch-decisions": lambda: sealed_decisions.markdown([_json(f"sealed/{name}.json") for name in SEALED]),
    },
    "docs/notes/2026-12-07-switch-history.md": {
        "switch-targets": lambda: switch_targets.markdown(
            _json("long_switch.json"), _json("guard_ladder_long2k.json")
        ),
        "long-switch": lambda: long_switch_report.markdown(_json("long_switch.json")),
        "long-ladder": _long_ladder,
        "long-ladder-headroom": _long_ladder_headroom,
    },
    "docs/sealed.md": {
        "sealed-chat-doc": lambda: sealed_report.markdown(_json("sealed/switch-chat-doc.json")),
        "sealed-whole-context": lambda: sealed_report.markdown(_json("sealed/whole-context.json")),
        "sealed-whole-context-conv4k": lambda: sealed_report.markdown(_json("sealed/whole-context-conv4k.json")),
    },
    "docs/performance.md": {
        "performance": lambda: performance_markdown(_json("apply.json"), "benchmarks/results/apply.json"),
        "packed-attention": lambda: packed_attention.markdown(_json("packed_attention.json")),
    },
}


def markers(text: str) -> list[str]:
    """The names of the marked sections of `text`, in order."""
    return re.findall(r"<!-- ([a-z0-9-]+):start -->", text)


def render(page: str) -> str:
    """`page` with every one of its sections rendered from the committed JSON (its narrative unchanged)."""
    path = ROOT / page
    text = path.read_text()
    found, expected = markers(text), list(SECTIONS[page])
    if sorted(found) != sorted(expected):
        raise ValueError(f"{page} has the sections {found}; benchmarks.docs renders {expected}.")
    for name, section in SECTIONS[page].items():
        text = replace_section(text, name, section())
    return text


def stale() -> list[str]:
    """The pages whose committed text differs from what the committed JSON renders."""
    return [page for page in SECTIONS if render(page) != (ROOT / page).read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is not what it renders")
    args = parser.parse_args(argv)
    changed = stale()
    if args.check:
        for page in changed:
            print(f"{page}: out of date with benchmarks/results/ (run: python -m benchmarks.docs)", file=sys.stderr)
        return 1 if changed else 0
    for page in changed:
        (ROOT / page).write_text(render(page))
        print(f"wrote {page}")
    print(f"{len(SECTIONS) - len(changed)} of {len(SECTIONS)} pages unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
