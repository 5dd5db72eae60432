"""`HandoffSession`: one conversation served by several models turn by turn, each keeping its own cache, with only the
tokens a model has not seen mapped into it when it takes over.

```python
session = HandoffSession({"small": small, "large": large}, {("small", "large"): s2l, ("large", "small"): l2s})
session.append(tokenizer(user_turn)["input_ids"])
turn = session.respond("large", max_new_tokens=32, eos_token_id=end_id)   # large prefills the user turn itself
session.append(tokenizer(next_user_turn, add_special_tokens=False)["input_ids"])
turn = session.respond("small", max_new_tokens=32, eos_token_id=end_id)   # maps large's new tokens, then answers
```

Invariant: a model's cache covers a prefix of the transcript and never its last token. When a model takes over, the
tokens some other model has already processed beyond this model's cache are mapped from that model's cache through the
pipeline's span request ([`~hf_kvmap.serving.spans.serve_span`]: `MappedCache.from_source_span` reads the mapper's
widest context window (`max_context_window`) of earlier positions along, so a windowed mapper sees the same inputs as
when it maps a whole prompt, and records the span; then the fixed repair or the ladder's rung); the remaining tokens
(typically the new user turn) are prefilled by the model itself.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LogitsProcessorList
from transformers.utils import logging

from .._compat import cache_kwargs, output_cache
from ..input_checks import as_token_row
from ..repair import DecodeRefresh, RepairConfig
from ..repair.repair import recomputed_mask
from ..request_context import RequestContext
from .forwards import run_tokens
from .ladder import GuardLadder, rung_name
from .probes import probe_from_dict
from .report import HandoffReport
from .rows import ladder_settings
from .spans import serve_span

logger = logging.get_logger(__name__)

#: probes a session's ladder can use: they read the answering model on its cache of the whole transcript (the model
#: whose cache was mapped from has seldom processed the newest user turn, so a probe that drafts with it cannot run)
SESSION_PROBES = ("lookahead_margin",)


@dataclass
class SessionTurn:
    r"""
    One `HandoffSession.respond` call. What the switch decided is its [`HandoffReport`] (`report`); the fields below
    read it.

    Args:
        model (`str`): the model that answered.
        tokens (`list[int]`): the generated tokens (appended to the transcript).
        mapped_from (`str`, *optional*): the model whose cache the new tokens were mapped from (`None`: none mapped).
        prefilled_tokens (`int`): tokens this model prefilled itself before generating.
        report ([`HandoffReport`], *optional*): the switch's report ([`~hf_kvmap.serving.spans.serve_span`]; for a
            switch the ladder's `min_tokens` found too short, its refusal); `None` when nothing was mapped.
        refresh (`dict`, *optional*): with `respond(refresh=...)` on a cache holding mapped positions, what
            [`~hf_kvmap.repair.DecodeRefresh`] recomputed of them while the model decoded (`refreshes`, `recomputed`,
            `seconds`, ...); `None` otherwise.
        first_logits (`torch.Tensor`, *optional*): `(vocab,)` logits of the first generated token.
        timings (`dict[str, float]`): seconds spent mapping, repairing, prefilling (`prefill`), probing, checking,
            falling back and generating.

    Read from the report: `mapped_tokens` (tokens mapped into this model's cache at this switch), `window_tokens`
    (earlier source positions read along for the mapper's context window), `repaired_tokens` (mapped tokens this model
    then recomputed itself: `HandoffSession(repair=...)` or the ladder's repairing rung), `rung` (with a ladder, the
    rung this switch took: `"mapped"`, `"repair:<f>"`, or `"fallback"`: the model prefilled the tokens it would have
    mapped; `None` without a ladder or a mapping), `risk` (the ladder probe's risk), `margin` (with a ladder that
    checks after its rung, `min_margin`, the answering model's margin on its first answer tokens over the cache its
    rung served, [`~hf_kvmap.serving.forwards.answer_margin`]), `checked` (the rung the check sent back to the
    fallback) and `short` (the ladder's `min_tokens` found the unseen tokens too few to map: the model prefilled them,
    no probe ran).
    """

    model: str
    tokens: list[int]
    mapped_from: str | None = None
    prefilled_tokens: int = 0
    report: HandoffReport | None = None
    refresh: dict | None = None
    first_logits: torch.Tensor | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def _row(self) -> dict:
        ladder = None if self.report is None else self.report.ladder
        return ladder["rows"][0] if ladder else {}

    @property
    def mapped_tokens(self) -> int:
        return 0 if self.report is None else self.report.mapped_tokens

    @property
    def window_tokens(self) -> int:
        return 0 if self.report is None else self.report.window_tokens

    @property
    def repaired_tokens(self) -> int:
        row = self._row
        if "checked" in row:  # what the rung the check sent back had recomputed
            return row["checked_recomputed"]
        if row:
            return row.get("recomputed", 0) if row["fraction"] is not None else 0
        repair = None if self.report is None else self.report.repair
        return repair["recomputed"][0] if repair else 0

    @property
    def rung(self) -> str | None:
        return self._row.get("rung")

    @property
    def risk(self) -> float | None:
        return self.report.scores[0] if self.report is not None and self.report.scores else None

    @property
    def margin(self) -> float | None:
        return self._row.get("margin")

    @property
    def checked(self) -> str | None:
        return self._row.get("checked")

    @property
    def short(self) -> bool:
        return bool(self._row.get("short"))


def _short_report(ladder: GuardLadder, tokens: int) -> HandoffReport:
    """The report of a switch whose `tokens` unseen tokens are fewer than the ladder's `min_tokens`: nothing mapped."""
    row = {"rung": rung_name(None), "fraction": None, "short": True}
    return HandoffReport(
        False,
        f"ladder: the {tokens} unseen tokens are fewer than min_tokens={ladder.min_tokens}: the model prefills them",
        probe=ladder.probe,
        ladder={**ladder_settings(ladder), "rows": [row]},
    )


class HandoffSession:
    r"""
    A conversation (batch 1) that several models of one family answer in turn.

    Args:
        models (`Mapping[str, PreTrainedModel]`): the models, by name.
        mappers (`Mapping[tuple[str, str], MapperModel]`, *optional*): `(source name, target name) -> mapper`. A switch
            with no mapper for its direction prefills the unseen tokens instead (counted in `SessionTurn`).
        input_ids (`torch.Tensor` or `Sequence[int]`, *optional*): the transcript so far.
        same_weights (`bool`, *optional*, defaults to `False`): the models are the weights their mappers were fitted
            for, loaded from another location (`MapperModel.check_compatible(..., same_weights=True)`).
        repair ([`~hf_kvmap.repair.RepairConfig`], *optional*): after mapping the tokens a model has not seen, it
            recomputes the share of them the config's strategy selects, attending to its cache of the rest.
        ladder ([`~hf_kvmap.serving.ladder.GuardLadder`] or `dict`, *optional*): instead of one fixed repair, a rung per
            switch: once the model's cache covers the transcript, the ladder's probe (one of `SESSION_PROBES`) scores
            it, and the model keeps the mapped tokens, recomputes the share of them the rung calls for, or prefills
            them itself (then the tokens after them run again on what is kept). Recorded in `SessionTurn.rung`. A
            ladder with a `min_margin` then checks the served cache: below it, the model prefills the mapped tokens
            after all (`SessionTurn.margin`, `SessionTurn.checked`). With a `min_tokens`, a switch with fewer unseen
            tokens than that maps none: the model prefills them (`SessionTurn.short`).

    Every mapper is checked against its two models (`MapperModel.check_compatible`) when the session is built. A
    model's cache that holds mapped positions is a [`MappedCache`]: approximate (`approximate = True`) with a
    `mapping_info` (`mapped_positions`, the mappers each span came from), which `save_cache` records.
    """

    def __init__(
        self,
        models: Mapping[str, torch.nn.Module],
        mappers: Mapping[tuple[str, str], torch.nn.Module] | None = None,
        input_ids: torch.Tensor | Sequence[int] | None = None,
        *,
        same_weights: bool = False,
        repair=None,
        ladder=None,
    ):
        from ..modeling_mapper import MapperModel

        if not models:
            raise ValueError("HandoffSession needs at least one model.")
        self.models = dict(models)
        self.mappers = dict(mappers or {})
        self.repair = None if repair is None else RepairConfig.from_dict(repair)
        if ladder is not None and repair is not None:
            raise ValueError(
                "Pass `repair=` (one fixed repair at every switch) or `ladder=` (a rung per switch by its probe's "
                "risk), not both."
            )
        self.ladder = None if ladder is None else GuardLadder.from_dict(ladder)
        if self.ladder is not None and self.ladder.probe["name"] not in SESSION_PROBES:
            raise ValueError(
                f"A session's ladder cannot use probe {self.ladder.probe['name']!r}: a switch maps what another model "
                "processed, which has seldom seen the newest turn, so the probe must read the answering model "
                f"alone. Calibrate the ladder with one of {list(SESSION_PROBES)}."
            )
        self._probe = None if self.ladder is None else probe_from_dict(self.ladder.probe)
        for source, target in self.mappers:
            for name in (source, target):
                if name not in self.models:
                    raise ValueError(f"A mapper names model {name!r}, which is not one of {sorted(self.models)}.")
            mapper = self.mappers[(source, target)]
            if not isinstance(mapper, MapperModel):
                raise TypeError(
                    f"The mapper for {(source, target)} is a {type(mapper).__name__}; pass a `MapperModel`."
                )
            try:
                mapper.check_compatible(self.models[source], self.models[target], same_weights=same_weights)
            except ValueError as err:
                raise ValueError(f"The mapper for {(source, target)} does not fit its models: {err}") from None
        self.caches: dict[str, DynamicCache | None] = dict.fromkeys(self.models)
        self.input_ids = torch.zeros(1, 0, dtype=torch.long)
        self.turns: list[SessionTurn] = []
        if input_ids is not None:
            self.append(input_ids)

    # ---------------------------------------------------------------------------------------------- transcript
    def append(self, token_ids: torch.Tensor | Sequence[int]) -> None:
        """Append tokens (a user turn) to the transcript; no model processes them until it responds.

        `token_ids`: a 1-D or `(1, n)` integer tensor, a list of ints, or a tokenizer's output (its `input_ids`);
        strings, float or bool tensors, several rows and ids outside the models' vocabulary are refused."""
        ids = as_token_row(token_ids, list(self.models.values())).to(self.input_ids.device)
        self.input_ids = torch.cat([self.input_ids, ids], dim=1)

    def covered(self, name: str) -> int:
        """Transcript tokens model `name`'s cache holds."""
        cache = self.caches[name]
        return 0 if cache is None else cache.get_seq_length()

    # ---------------------------------------------------------------------------------------------------- sync
    @torch.no_grad()
    def sync(self, name: str) -> SessionTurn:
        """Bring `name`'s cache to every transcript token but the last: map what another model already processed
        (from the model that has processed the most, when a mapper exists) through the pipeline's span request
        ([`~hf_kvmap.serving.spans.serve_span`]: the map, the repair or the ladder's rung), prefill the rest itself."""
        if name not in self.models:
            raise ValueError(f"Unknown model {name!r}; the session has {sorted(self.models)}.")
        end = self.input_ids.shape[1] - 1
        if end < 0:
            raise ValueError("The transcript is empty: append the first turn before a model responds.")
        record = SessionTurn(model=name, tokens=[])
        have = self.covered(name)
        donors = [
            other
            for other in self.models
            if other != name and (other, name) in self.mappers and self.covered(other) > have
        ]
        donor = max(donors, key=self.covered) if donors else None
        upto = min(self.covered(donor), end) if donor is not None else have
        if donor is not None and self.ladder is not None and self.ladder.too_short(upto - have):
            record.report = _short_report(self.ladder, upto - have)  # the model prefills them below
            logger.info("%s prefills the tokens it has not seen: fewer than the ladder's min_tokens", name)
        elif donor is not None:
            request = RequestContext(
                source=self.models[donor],
                target=self.models[name],
                mapper=self.mappers[(donor, name)],
                input_ids=self.input_ids[:, : end + 1],
                source_cache=self.caches[donor],
                cache=self.caches[name],
                span_start=have,
                hold_back=end + 1 - upto,
            )
            self.caches[name], record.report = serve_span(
                request, repair=self.repair, ladder=self.ladder, probe=self._probe, label=donor
            )
            record.mapped_from = donor
            record.prefilled_tokens = end - (have if record.rung == rung_name(None) else upto)
            timings = {k: v for k, v in record.report.timings.items() if k != "total"}
            if "held_back" in timings:
                timings["prefill"] = timings.pop("held_back")
            record.timings.update(timings)
            have = end
        elif any(self.covered(other) > have for other in self.models if other != name):
            logger.info("no mapper into %s: it prefills the tokens other models processed", name)
        if end > have:
            start_time = time.perf_counter()
            cache = self.caches[name]
            if cache is None:
                cache = self.caches[name] = DynamicCache()
            run_tokens(self.models[name], cache, self.input_ids, have, end)
            record.timings["prefill"] = time.perf_counter() - start_time
            record.prefilled_tokens = end - have
        return record

    def _check_generate_options(self, name: str, refresh, generate_kwargs: dict) -> None:
        """Refuse, by name, what a turn cannot serve: a conversation is one row, so one sequence of one beam
        (`num_beams`, `num_return_sequences`, also from the model's generation config), and refresh settings that
        `DecodeRefresh` does not take."""
        import inspect

        if name in self.models:
            config = generate_kwargs.get("generation_config") or self.models[name].generation_config
            for option in ("num_beams", "num_return_sequences"):
                value = generate_kwargs.get(option, getattr(config, option, 1))
                if value not in (None, 1):
                    where = "" if option in generate_kwargs else f" (from {name!r}'s generation config)"
                    raise ValueError(
                        f"{option}={value!r}{where}: a session's turn continues its one conversation, one sequence of "
                        f"one beam on a batch-1 cache; pass {option}=1 (sample several answers in separate sessions)."
                    )
        if refresh is None:
            return
        if not isinstance(refresh, dict):
            raise TypeError(
                f"refresh= takes the settings of a DecodeRefresh as a dict (e.g. {{'every': 16, 'fraction': 0.0125}}); "
                f"got a {type(refresh).__name__}."
            )
        known = [
            p for p in inspect.signature(DecodeRefresh).parameters if p not in ("target", "cache", "attention_mask")
        ]
        unknown = sorted(set(refresh) - set(known))
        if unknown:
            raise ValueError(f"refresh= does not take {', '.join(map(repr, unknown))}; DecodeRefresh takes {known}.")

    @staticmethod
    def _refresher(model, cache, refresh: dict | None) -> DecodeRefresh | None:
        """The refresh while decoding of `respond(refresh=...)` on `cache`, with every position but the mapped ones
        marked as recomputed (what a refresh skips); `None` without `refresh` or without mapped positions."""
        if refresh is None:
            return None
        if not isinstance(refresh, dict):
            raise TypeError(
                f"refresh= takes the settings of a DecodeRefresh as a dict (e.g. {{'every': 16, 'fraction': 0.0125}}); "
                f"got a {type(refresh).__name__}."
            )
        spans = (getattr(cache, "mapping_info", None) or {}).get("mapped_positions") or []
        if not spans:  # no cache yet, or one the model computed all of itself
            return None
        length = cache.get_seq_length()
        own = torch.ones(1, length, dtype=torch.bool)
        for start, end in spans:
            own[0, start : min(end, length)] = False
        cache.record_recomputed(recomputed_mask(cache, 1, length) | own)
        return DecodeRefresh(model, cache, **refresh)

    # ------------------------------------------------------------------------------------------------ respond
    @torch.no_grad()
    def respond(
        self, name: str, max_new_tokens: int, *, refresh: dict | None = None, **generate_kwargs
    ) -> SessionTurn:
        """Switch to model `name`, bring its cache up to date (`sync`), and generate greedily (unless
        `generate_kwargs` say otherwise); the generated tokens are appended to the transcript.

        With `refresh` (the settings of a [`~hf_kvmap.repair.DecodeRefresh`]: `every`, `tokens` or `fraction`,
        `limit`, `strategy`), the model also recomputes, while it decodes, the mapped positions of its cache its
        latest queries read most: the positions it computed itself (its own turns, what it prefilled, what a repair
        or an earlier refresh recomputed) are never touched. What it recomputed is in `SessionTurn.refresh`.

        Returns the [`SessionTurn`], with the first step's logits.
        """
        self._check_generate_options(name, refresh, generate_kwargs)  # before the sync changes anything
        record = self.sync(name)
        model = self.models[name]
        cache = self.caches[name]
        start_time = time.perf_counter()
        generate_kwargs.setdefault("do_sample", False)
        refresher = self._refresher(model, cache, refresh)
        if refresher is not None:
            generate_kwargs["logits_processor"] = LogitsProcessorList(
                [*(generate_kwargs.get("logits_processor") or []), refresher]
            )
        out = model.generate(
            self.input_ids,
            **cache_kwargs(cache if cache is not None and cache.get_seq_length() else None),
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=True,
            output_scores=True,
            **generate_kwargs,
        )
        record.timings["generate"] = time.perf_counter() - start_time
        if cache is None or not cache.get_seq_length():
            self.caches[name] = output_cache(out)
        new = out.sequences[:, self.input_ids.shape[1] :]
        record.tokens = new[0].tolist()
        record.first_logits = out.scores[0][0].float() if out.scores else None
        if refresher is not None:
            record.refresh = dict(cache.mapping_info["refresh"])
            record.timings["refresh"] = refresher.seconds
        self.input_ids = torch.cat([self.input_ids, new.to(self.input_ids.device)], dim=1)
        # generate leaves the last generated token unprocessed: the invariant (a cache never covers the last token)
        if self.covered(name) >= self.input_ids.shape[1]:
            self.caches[name].crop(-(self.covered(name) - self.input_ids.shape[1] + 1))
        self.turns.append(record)
        return record
