"""The few ways every results page writes a number, a rung of the guard ladder and a break-even length, shared by
the renderers under `benchmarks/` so that one quantity reads the same on every page."""

from __future__ import annotations

import inspect
import json
import re


def pct(value, digits: int = 0, missing: str = "n/a") -> str:
    """`0.125` -> `12 %` (`digits` after the point); `missing` for a value that was not measured (None)."""
    return missing if value is None else f"{100 * value:.{digits}f} %"


def fraction_text(value: float) -> str:
    """`0.05` -> `5 %` (as many digits as the fraction has)."""
    return f"{100 * value:.10g} %"


def number_text(value, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def retention_text(value) -> str:
    """A retention (`hf_kvmap.reporting.floor_retention`): `None` is a target that does not beat chance."""
    return "not measurable" if value is None else number_text(value)


def rung_order(name: str) -> tuple[int, float]:
    """Sort key of a ladder outcome's rung names: `mapped`, then `sparse:<fraction>` and `repair:<fraction>` by
    fraction (a sparse rung just below the repair of its fraction, as in a ladder), then the fallback, then `short`
    (below the ladder's `min_tokens`)."""
    if name == "mapped":
        return 0, 0.0
    if name.startswith(("repair:", "sparse:")):
        return 1, float(name.split(":", 1)[1]) + (0.0 if name.startswith("repair:") else -1e-9)
    return (3 if name == "short" else 2), 0.0


def rung_label(name: str) -> str:
    """`repair:0.2` -> `recompute 20 %`, `sparse:0.2` -> `sparse prefill 20 %`, `fallback` -> `prefill`, `short` ->
    `prefill, too short to map`, `mapped` as it is."""
    if name.startswith("repair:"):
        return f"recompute {fraction_text(float(name.split(':', 1)[1]))}"
    if name.startswith("sparse:"):
        return f"sparse prefill {fraction_text(float(name.split(':', 1)[1]))}"
    return {"fallback": "prefill", "short": "prefill, too short to map"}.get(name, name)


def strategy_text(strategy: dict | str) -> str:
    """A repair strategy by its name and the options it sets otherwise than its defaults: the record key
    `draft_branches:branches=3:draft_tokens=8:last_tokens=0:stop_at_eos=True` (or those settings) reads
    `draft_branches`, `query_overlap:...:fill=draft_branches:...` reads `query_overlap:fill=draft_branches`. A name
    the registry does not hold is shown with every option."""
    from hf_kvmap.calibration.ladder_items import option_text
    from hf_kvmap.repair import STRATEGIES

    if isinstance(strategy, str):
        name, *parts = re.split(r":(?=[A-Za-z_]\w*=)", strategy)  # a nested option's JSON holds colons too
        options = dict(part.split("=", 1) for part in parts)
    else:
        name = strategy["name"]
        options = {k: v if isinstance(v, str) else option_text(v) for k, v in strategy.items() if k != "name"}
    defaults = {}
    if name in STRATEGIES:
        signature = inspect.signature(STRATEGIES[name].__init__)
        defaults = {k: option_text(p.default) for k, p in signature.parameters.items() if p.default is not p.empty}
    kept = []
    for key, value in sorted(options.items()):
        if value.startswith("{") and '"name"' in value:  # a nested strategy (a fill, a component) reads short too
            value = strategy_text(json.loads(value))
        elif key == "skip" and value.startswith("["):  # token ids (`skip=markup` resolved): how many, not which
            value = f"{len(json.loads(value))} ids"
        if defaults.get(key, object()) != value:
            kept.append(f"{key}={value}")
    return ":".join([name, *kept])


def break_even_text(entry: dict) -> str:
    """Of a `long_switch_report.break_even_length` entry: `about 1,234 tokens`, or which side of every length
    measured the break-even lies on."""
    if "tokens" in entry:
        return f"about {entry['tokens']:,} tokens"
    if "below" in entry:
        return f"below {entry['below']:,.0f} tokens (pays at every length measured)"
    return f"above {entry['above']:,.0f} tokens (pays at none measured)"


__all__ = ["break_even_text", "fraction_text", "number_text", "pct", "rung_label", "rung_order", "strategy_text"]
