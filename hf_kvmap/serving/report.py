"""What serving a request decided and what each stage cost ([`HandoffReport`]), the error `policy="fail"` raises with
it ([`HandoffRefusedError`]), and the clock that times the stages."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


class HandoffRefusedError(RuntimeError):
    """Raised by `handoff(..., policy="fail")` when the gate or the probe refuses the mapped cache.

    Its `report` ([`HandoffReport`]) says why.
    """

    def __init__(self, message: str, report: HandoffReport):
        super().__init__(message)
        self.report = report


@dataclass
class HandoffReport:
    r"""
    What `handoff` decided and what each stage cost.

    Args:
        accepted (`bool`): the mapped cache was served.
        reason (`str`): why (`"probe passed"`, `"probe refused"`, `"incompatible: ..."`, `"mapping failed: ..."`).
        probe (`dict`, *optional*): settings of the probe that ran (`None` when the gate refused first).
        score (`float`, *optional*): the largest risk over the batch rows (the decision is taken on it).
        scores (`list[float]`): the risk of every row.
        threshold (`float`, *optional*): the risk above which the mapped cache is refused.
        policy (`str`): `"fallback"` or `"fail"`.
        hold_back (`int`): final prompt tokens the target ran itself on the mapped cache.
        audit_error (`float`, *optional*): the audit's worst relative key/value error: every layer on the first
            `audit_tokens` tokens and, once that is within `EXACT_TOLERANCE`, the first layer at every position.
        mapped_tokens (`int`): tokens the mapper produced.
        window_tokens (`int`): a session's switch (`hf_kvmap.serving.spans`): earlier source positions the mapper
            read along for its context window; 0 for a whole prompt.
        same_weights (`bool`): the caller said the models are the weights the mapper was fitted for, loaded from
            another location (the gate skipped the model-id comparison).
        notes (`list[str]`): what the handoff derived on its own (e.g. the attention mask `generate` infers).
        repair (`dict`, *optional*): what the target recomputed of the mapped cache (`mapping_info["repair"]`:
            strategy, budget, positions per row); `None` without `repair=`.
        ladder (`dict`, *optional*): what the guard ladder served each row (`rows`: `rung`, `fraction`, `risk`,
            `recomputed` tokens; `short` on a row below the ladder's `min_tokens`; with a check after the rung, each
            served row's `margin`, and `checked`, the rung a row the check sent back had) and the ladder's probe,
            strategy, `min_margin`, `check_tokens` (where not 1) and `min_tokens` (where set); `None` without a
            ladder.
        timings (`dict[str, float]`): seconds per stage (`gate`, `source_prefill`, `map`, `repair`, `held_back`, `audit`,
            `probe`, `check`, `fallback`: the target's own prefill of the rows the check sent back, `fallback_prefill`,
            `total`); a stage that did not run is absent.
    """

    accepted: bool
    reason: str
    probe: dict[str, Any] | None = None
    score: float | None = None
    scores: list[float] = field(default_factory=list)
    threshold: float | None = None
    policy: str = "fallback"
    hold_back: int = 1
    audit_error: float | None = None
    mapped_tokens: int = 0
    window_tokens: int = 0
    repair: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    ladder: dict[str, Any] | None = None
    same_weights: bool = False
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Clock:
    """Seconds per stage of one request (`stage(name)` is a context manager; `done()` adds the total)."""

    def __init__(self):
        self.timings: dict[str, float] = {}
        self._start = time.perf_counter()

    def stage(self, name: str):
        clock = self

        class _Stage:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                clock.timings[name] = clock.timings.get(name, 0.0) + time.perf_counter() - self.start

        return _Stage()

    def done(self) -> dict[str, float]:
        self.timings["total"] = time.perf_counter() - self._start
        return self.timings


__all__ = ["Clock", "HandoffRefusedError", "HandoffReport"]
