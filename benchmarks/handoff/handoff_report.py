"""The markdown of the guarded-handoff benchmark (`benchmarks.handoff.handoff` and `benchmarks.handoff.handoff_session` JSON), for
`python -m benchmarks.docs`."""

from __future__ import annotations

from functools import partial

from ..formatting import pct
from .handoff import MIN_CAUGHT, TASKS

#: a share, or `-` where it was not measured
_pct = partial(pct, missing="-")


def markdown(result: dict, session: dict | None, source_file: str, session_file: str) -> str:
    """The guarded-handoff tables of `docs/guard.md`, rendered from the benchmark JSON (never typed by hand)."""
    budget = result["run"]["max_false_alarm"]
    lines = [
        f"Measured by `benchmarks/handoff/handoff.py` ({source_file}): {result['run']['items_per_task_and_set']} items per task "
        "on a calibration set (threshold chosen there: false alarms <= "
        f"{budget:.0%}) and a disjoint report set (the numbers below). *Caught*: refused items whose answer on the mapped "
        "cache differs from the target's own; *false alarms*: refused items whose answer is the target's own. Costs at "
        f"{next(iter(result['directions'].values())).get('cost_per_request_ms', {}).get('tokens', '-')} tokens, CPU, "
        "medians of interleaved runs.",
        "",
        "| direction | probe (chosen on calibration) | caught recall / chat | false alarms recall / chat | AUC recall / "
        "chat | probe cost vs re-prefill: time / target tokens | answers changed: unguarded -> guarded | net saving per request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, direction in result["directions"].items():
        chosen = direction["probes"][direction["chosen"]]
        report = chosen["report"]
        changed = direction["accuracy"]
        unguarded = [changed[f"report/{task}"]["changed"][str(chosen["hold_back"])] for task in TASKS]
        guarded = [direction["guarded_report"][task]["changed_answers_served"] for task in TASKS]
        cost = direction.get("cost_per_request_ms")
        saving = (
            f"{cost['net_saving']:.1f} ms of {cost['target_prefill_avoided']:.1f} ({_pct(cost['net_saving_fraction'])})"
            if cost
            else "-"
        )
        lines.append(
            f"| {name} | `{direction['chosen']}` | {_pct(report['recall']['true_alarm'])} / "
            f"{_pct(report['chat']['true_alarm'])} | {_pct(report['recall']['false_alarm'])} / "
            f"{_pct(report['chat']['false_alarm'])} | {chosen['auc']['recall']:.2f} / {chosen['auc']['chat']:.2f} | "
            f"{_pct(chosen.get('cost_fraction_of_prefill'))} / {_pct(chosen.get('target_token_fraction'))} | "
            f"{_pct(unguarded[0])} -> {_pct(guarded[0])} (recall), "
            f"{_pct(unguarded[1])} -> {_pct(guarded[1])} (chat) | {saving} |"
        )
    lines += [
        "",
        "Against the targets (catch >= 80 % of changed answers, <= 10 % false alarms, probe <= 5 % of the "
        "re-prefill), on the report set:",
        "",
    ]
    for name, direction in result["directions"].items():
        chosen = direction["probes"][direction["chosen"]]
        misses = []
        for task in TASKS:
            rates_ = chosen["report"][task]
            if rates_["true_alarm"] is not None and rates_["true_alarm"] < MIN_CAUGHT:
                misses.append(
                    f"{task} caught {_pct(rates_['true_alarm'])} ({_pct(MIN_CAUGHT - rates_['true_alarm'])} short, of "
                    f"{rates_['changed']} changed answers)"
                )
            if rates_["false_alarm"] is not None and rates_["false_alarm"] > budget:
                misses.append(
                    f"{task} false alarms {_pct(rates_['false_alarm'])} ({_pct(rates_['false_alarm'] - budget)} over, of "
                    f"{rates_['kept']} kept answers)"
                )
        fraction = chosen.get("cost_fraction_of_prefill")
        if fraction is not None and fraction > result["run"]["max_cost_fraction"]:
            misses.append(
                f"cost {_pct(fraction)} of the re-prefill in time ({_pct(chosen['target_token_fraction'])} of its tokens)"
            )
        lines.append(f"- {name}: " + ("met" if not misses else "missed: " + "; ".join(misses)) + ".")
    lines += [
        "",
        "Accuracy on the report set (exact match): the target alone, the mapped cache holding back the last token or "
        "the last 16 (the target runs them itself), and guarded serving (the mapped answer when the probe accepts, the "
        "target's own when it refuses).",
        "",
        "| direction | task | target alone | mapped, hold back 1 | mapped, hold back 16 | guarded | fallback rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, direction in result["directions"].items():
        for task in TASKS:
            accuracy = direction["accuracy"][f"report/{task}"]
            guarded = direction["guarded_report"][task]
            lines.append(
                f"| {name} | {task} | {accuracy['target_own']:.2f} | {accuracy['mapped']['1']:.2f} | "
                f"{accuracy['mapped']['16']:.2f} | {guarded['accuracy']:.2f} | {_pct(guarded['fallback_rate'])} |"
            )
    upcast = [
        f"{name} {d['cost_per_request_ms']['mapper']:.0f} ms ({d['cost_per_request_ms']['mapper_dtype']}) vs "
        f"{d['cost_per_request_ms']['mapper_float32']:.0f} ms (float32), net saving "
        f"{d['cost_per_request_ms']['net_saving_float32_mapper']:.1f} ms"
        for name, d in result["directions"].items()
        if "mapper_float32" in d.get("cost_per_request_ms", {})
    ]
    if upcast:
        lines += ["", "Mapper time as shipped vs the same weights in float32 on this CPU: " + "; ".join(upcast) + "."]
    lines += [
        "",
        "Net saving = target re-prefill avoided - mapper - probe - save + load of the cache file - fallback rate x "
        "re-prefill. Probe cost is wall time (each probe is one to five small forwards, whose fixed per-call cost "
        "dominates on these tiny models) and the share of the re-prefill's tokens the target runs for it (audit "
        "included). The full ROC per task and direction, every candidate probe and the cost breakdown are in the "
        "JSON and in `benchmarks/results/handoff_roc.png`.",
    ]
    if session:
        lines += [
            "",
            f"Multi-turn sessions (`benchmarks/handoff/handoff_session.py`, {session_file}): "
            f"{session['run']['conversations']} chat conversations of {session['run']['exchanges']} user turns "
            f"({session['run']['switches_per_conversation']} switches each), the two models answering in turn; each "
            "answer is compared with the same model's answer after its own prefill of the same transcript.",
            "",
            "| pair | direction | switches | same answer as own prefill | mean sync (ms) | own re-prefill (ms) |",
            "|---|---|---|---|---|---|",
        ]
        for pair, data in session["pairs"].items():
            for direction, entry in data["per_direction"].items():
                how = "mapped" if entry["mapped"] else "no mapper: prefilled"
                lines.append(
                    f"| {pair} | {direction} ({how}) | {entry['switches']} | {_pct(entry['same_as_own_prefill'])} | "
                    f"{entry['mean_sync_ms']:.1f} | {entry['mean_own_prefill_ms']:.1f} |"
                )
        lines += [
            "",
            "| pair | " + " | ".join(f"turn {e}" for e in next(iter(session["pairs"].values()))["per_exchange"]),
        ]
        lines[-1] += " |"
        lines.append("|---|" + "---|" * len(next(iter(session["pairs"].values()))["per_exchange"]))
        for pair, data in session["pairs"].items():
            cells = [
                f"{_pct(x['same_as_own_prefill'])} ({x['session_accuracy']:.2f} vs {x['own_prefill_accuracy']:.2f})"
                for x in data["per_exchange"].values()
            ]
            lines.append(f"| {pair} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "Per turn: share of answers equal to the own-prefill answer (session accuracy vs own-prefill accuracy on "
            "the conversation's facts). Turn 0 is answered before any switch.",
        ]
    return "\n".join(lines) + "\n"
