"""`hf-kvmap demo`'s long rows and its first screen: where the switch pays, and where it does not (read by
`hf_kvmap.payoff`).

The long forms of recall and chat (`hf_kvmap.zoo.long_items`: a prompt of the family's own filler, one fact stated
`reach` tokens before its end, the question about it last) are served the four ways of `demo_ways` at each length
asked, every length warmed up before it is timed, accuracy and the median time to the first token side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..payoff import (
    BREAK_EVEN_RULE,
    HANDOFF_WAYS,
    TOLERANCE,
    break_even_text,
    break_evens,
    kept_text,
    paying_text,
    pays,
)

#: the long rows' prompt lengths (tokens) and the tokens from the fact to the prompt's end (the family is trained on
#: 256-token windows, and its target does not recall a fact stated first much beyond them: `--reach first` shows it)
DEFAULT_LONG_LENGTHS = (256, 384, 512)
DEFAULT_REACH = 96
DEFAULT_LONG_ITEMS = 32


def serve_long(
    ways, tasks: Sequence[str], lengths: Sequence[int], items: int, seed: int, reach: int | None, progress=None
) -> dict:
    """Each task's long form at each length, served by `ways` (`demo_ways.DemoWays`) four ways: `{task: [row]}`, a row
    `{"tokens", "prompt_tokens": [min, max], "target_does_task", "ways": {way: DemoWays.task's row}}`. Each length's
    items are served once, untimed, before they are timed (`DemoWays.warm_up`)."""
    from ..reporting import retention_measurable
    from ..zoo.long_items import make_long_set

    out: dict[str, list[dict]] = {}
    for task in tasks:
        rows = out.setdefault(task, [])
        for length in lengths:
            long_items = make_long_set(task, items, length, seed=seed, reach=reach)
            stop = long_items[0].stop
            ways.warm_up(long_items, stop)
            served = ways.task(long_items, stop, progress=progress)
            target = served["target"]["accuracy"]
            rows.append(
                {
                    "tokens": length,
                    "prompt_tokens": [min(i.tokens for i in long_items), max(i.tokens for i in long_items)],
                    "target_does_task": retention_measurable({"target": target, "n_items": items, "chance": 0.0}),
                    "ways": served,
                }
            )
    return out


def _cell(row: dict, way: str) -> str:
    served = row["ways"][way]
    mark = " +" if way != "target" and pays(row, way) else "  "
    return f"{served['accuracy']:.3f} / {served['ttft_ms']:6.1f}{mark}"


def _wrapped(text: str, indent: str = "") -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=116, initial_indent=indent, subsequent_indent=indent + "  ")


def first_screen(results: dict) -> str:
    """What `hf-kvmap demo` prints first: the long rows, where the switch pays, and the break-even lengths."""
    long = results.get("long") or {}
    run = results["run"]
    lines = [f"hf-kvmap demo: {run['source']} -> {run['target']} (mapper {run['mapper']}): where the switch pays"]
    rows_by_task = long.get("tasks") or {}
    if not rows_by_task:
        return lines[0] + "\n(no long rows: --long-lengths was empty)"
    reach = long["reach"]
    where = "stated first" if reach is None else f"stated {reach} tokens before the prompt's end"
    why = (
        " (the tiny target, trained on 256-token windows, does not recall a fact stated first much past them: "
        "--reach first measures it)"
        if reach is not None
        else ""
    )
    lines += _wrapped(
        f"Long prompts of the family's own text, one fact {where}{why} and the question about it last, "
        f"{long['items']} items per task and length; accuracy / median ms to the first token from the source's "
        "prefill, each length warmed up first:"
    )
    header = "".join(f"{label:<19}" for label in ("target alone", *HANDOFF_WAYS)).rstrip()
    lines += ["", f"{'task':<8}{'tokens':>7}   {header}"]
    for task, rows in rows_by_task.items():
        for row in rows:
            cells = "".join(f"{_cell(row, way):<19}" for way in ("target", *HANDOFF_WAYS)).rstrip()
            note = "" if row["target_does_task"] else "  (the target alone does not beat chance here)"
            lines.append(f"{task:<8}{row['tokens']:>7}   {cells}{note}")
    tolerance = long.get("tolerance", TOLERANCE)
    lines += [f"+ pays: the first token sooner than the target alone's, the accuracy within {tolerance:.2f} of it", ""]
    for sentence in paying_text(rows_by_task, tolerance):
        lines += _wrapped(sentence)
    lines += _wrapped(kept_text(rows_by_task, tolerance))
    lines += _wrapped(f"Where it does not pay: below the break-even length, {BREAK_EVEN_RULE}:")
    for task, entries in long.get("break_even", {}).items():
        text = "; ".join(f"{way} {break_even_text(e)}" for way, e in entries.items())
        lines += _wrapped(f"{task}: {text}", indent="  ")
    latency = results.get("latency_break_even") or {}
    if latency:
        text = "; ".join(f"{way} {break_even_text(e)}" for way, e in latency.items())
        lines += _wrapped(f"random tokens (the latency rows below): {text}", indent="  ")
    lines += _wrapped("Below it the target alone's first token comes sooner, as on the short prompts below.")
    return "\n".join(lines)


def measure_long(ways, kept: Sequence[str], args, progress: Callable[[], None] | None = None) -> dict:
    """The `long` block of the demo's results: the rows of the long forms of the kept tasks, their break-even lengths
    and the settings they were measured with."""
    from ..zoo.long_items import LONG_TASKS

    tasks = [task for task in LONG_TASKS if task in kept]
    rows = serve_long(ways, tasks, args.long_lengths, args.long_items, args.seed, args.reach, progress)
    return {
        "lengths": list(args.long_lengths),
        "reach": args.reach,
        "items": args.long_items,
        "seed": args.seed,
        "tolerance": TOLERANCE,
        "tasks": rows,
        "break_even": break_evens(rows),
        "break_even_rule": BREAK_EVEN_RULE,
    }
