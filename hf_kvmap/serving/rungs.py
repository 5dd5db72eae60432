"""How one request is served, named in one word: the target alone, the mapped cache, a repair at a fraction, the
mapper's calibrated guard or its ladder (the `rung=` of the lm-evaluation-harness model, `hf_kvmap.lm_eval_model`).

```python
rung = parse_rung("repaired:draft_attention@0.2")
cache, report = rung.serve(source, target, mapper, input_ids)  # cache=None: the target prefills the prompt itself
```

Each kind is one entry of `RUNG_KINDS`: a function from the text after the kind's `:` (and the options a front end
holds, such as a ladder file) to the keyword arguments of `handoff`, or `None` for the target alone. A new way of
serving is one more entry there. `sparse:<strategy>@<fraction>` serves the map-free rung (`hf_kvmap.repair.sparse_prefill`)
as a one-rung ladder; a batch of several rows is repaired at that fraction instead (its report rows say so).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..repair import RepairConfig, strategy_from_dict
from .handoff import handoff
from .ladder import GuardLadder, LadderRung
from .probes.prefix_audit import PrefixAuditProbe

#: the probe of a forced rung: it reads the first prompt token only and never refuses (threshold `inf`), so the rung
#: is served as named and the report still records how far the first mapped token is from the target's own
_FORCED = dict(probe=PrefixAuditProbe(tokens=1), threshold=math.inf, ladder=False, audit_tokens=0, policy="fail")


def _target(argument: str, options: dict) -> None:
    _no_argument("target", argument)
    return None


def _mapped(argument: str, options: dict) -> dict:
    _no_argument("mapped", argument)
    return dict(_FORCED)


def _strategy_at(kind: str, argument: str) -> tuple[dict, float]:
    """`<strategy>@<fraction>` (or `@<fraction>` for `tail`) -> (the strategy's settings, the fraction)."""
    strategy, at, fraction = argument.rpartition("@")
    if not at:
        raise ValueError(
            f"rung '{kind}:{argument}' names no fraction; pass `{kind}:<strategy>@<fraction>` "
            f"(e.g. `{kind}:draft_attention@0.2`, or `{kind}@0.2` for the default strategy `tail`)."
        )
    try:
        share = float(fraction)
    except ValueError:
        raise ValueError(
            f"rung '{kind}:{argument}': {fraction!r} after '@' is not a number; pass a fraction in [0, 1] "
            f"(e.g. `{kind}:tail@0.2`)."
        ) from None
    return strategy_from_dict(strategy.strip() or "tail").settings(), share  # an unknown strategy raises


def _repaired(argument: str, options: dict) -> dict:
    strategy, share = _strategy_at("repaired", argument)
    return dict(_FORCED, repair=RepairConfig(strategy, fraction=share))


def _guarded(argument: str, options: dict) -> dict:
    _no_argument("guarded", argument)
    return {}


def _ladder(argument: str, options: dict) -> dict:
    _no_argument("ladder", argument)
    path = options.get("ladder")
    if path is None:
        return {"ladder": True}
    if isinstance(path, (GuardLadder, dict)):
        return {"ladder": GuardLadder.from_dict(path)}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"ladder={path}: {err}; pass a JSON file of `GuardLadder.to_dict()`.") from None
    return {"ladder": GuardLadder.from_dict(data)}


def _sparse(argument: str, options: dict) -> dict:
    strategy, share = _strategy_at("sparse", argument)
    if not 0.0 < share < 1.0:
        raise ValueError(f"rung 'sparse:{argument}': the fraction prefilled must be in (0, 1); got {share}.")
    # a one-rung ladder taking every risk: the target's prefill of the strategy's selection alone (one row a request)
    ladder = GuardLadder({"name": "prefix_audit", "tokens": 1}, strategy, [LadderRung(1e300, share, sparse=True)])
    return {"ladder": ladder, "audit_tokens": 0, "policy": "fail"}


def _no_argument(kind: str, argument: str) -> None:
    if argument:
        raise ValueError(f"rung {kind!r} takes no argument (got '{kind}:{argument}'); pass `rung={kind}`.")


#: kind -> a function of (the text after `kind:`, a front end's options) returning `handoff`'s keyword arguments, or
#: `None` for the target alone
RUNG_KINDS: dict[str, Callable[[str, dict], dict | None]] = {
    "target": _target,
    "mapped": _mapped,
    "repaired": _repaired,
    "guarded": _guarded,
    "ladder": _ladder,
    "sparse": _sparse,
}


@dataclass
class Rung:
    r"""
    One way of serving a request, parsed from its text by [`parse_rung`].

    Args:
        text (`str`): what was parsed (`"target"`, `"mapped"`, `"repaired:tail@0.2"`, `"sparse:tail@0.2"`, `"guarded"`,
            `"ladder"`).
        kind (`str`): the key of `RUNG_KINDS`.
        handoff_kwargs (`dict`, *optional*): the keyword arguments of `handoff`; `None` for the target alone.

    Example:

    ```python
    >>> from hf_kvmap.serving.rungs import parse_rung
    >>> parse_rung("repaired:tail@0.5").handoff_kwargs["repair"].to_dict()
    {'strategy': {'name': 'tail'}, 'fraction': 0.5, 'tokens': None}
    >>> parse_rung("target").handoff_kwargs is None
    True
    ```
    """

    text: str
    kind: str
    handoff_kwargs: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def is_target(self) -> bool:
        """The target alone: no handoff at all."""
        return self.handoff_kwargs is None

    def serve(
        self, source, target, mapper, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> tuple[Any, dict[str, Any]]:
        """`(cache, report)` for a `(batch, T)` prompt: the served cache of its first `T - 1` tokens and the
        `HandoffReport` as a dict (`rung` added), or `(None, {"rung": "target", ...})` for the target alone, which
        then prefills the prompt itself. A prompt of one token has nothing to hand off and is the target's too."""
        if self.is_target or input_ids.shape[1] < 2:
            why = "the rung is the target alone" if self.is_target else "a one-token prompt has nothing to hand off"
            return None, {"rung": "target", "reason": why}
        cache, report = handoff(
            source, target, mapper, input_ids, attention_mask=attention_mask, **self.handoff_kwargs, **kwargs
        )
        return cache, {"rung": self.text, **report.to_dict()}


def parse_rung(text: str, **options) -> Rung:
    """A [`Rung`] from its text, `kind` or `kind:argument` (`repaired:draft_attention@0.2`); `options` are what a
    front end adds (`ladder=`: a ladder's JSON file, a dict or a `GuardLadder`, for the `ladder` kind). A `ValueError`
    names the known kinds or what the kind expects."""
    if not isinstance(text, str):
        raise TypeError(f"rung={text!r} must be a string such as 'target', 'mapped' or 'repaired:tail@0.2'.")
    kind, _, argument = text.strip().partition(":")
    for name in ("repaired", "sparse"):
        if kind.startswith(f"{name}@"):  # `repaired@0.2`: the default strategy
            kind, argument = name, kind[len(name) :]
    if kind not in RUNG_KINDS:
        raise ValueError(f"Unknown rung {text!r}; the kinds are {', '.join(RUNG_KINDS)} (e.g. `repaired:tail@0.2`).")
    return Rung(text.strip(), kind, RUNG_KINDS[kind](argument.strip(), options))


__all__ = ["RUNG_KINDS", "Rung", "parse_rung"]
