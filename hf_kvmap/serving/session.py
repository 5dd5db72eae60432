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
tokens some other model has already processed beyond this model's cache are mapped from that model's cache (the
mapper's widest context window (`max_context_window`) of earlier positions is read along, so a windowed mapper sees the same inputs as when it maps
a whole prompt); the remaining tokens (typically the new user turn) are prefilled by the model itself.
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
from ..repair import DecodeRefresh, RepairConfig, apply_repair
from ..repair.repair import recomputed_mask
from .forwards import answer_margin, run_tokens
from .ladder import GuardLadder, below_margin, rung_name
from .probes import ProbeContext, probe_from_dict

logger = logging.get_logger(__name__)

#: probes a session's ladder can use: they read the answering model on its cache of the whole transcript (the model
#: whose cache was mapped from has seldom processed the newest user turn, so a probe that drafts with it cannot run)
SESSION_PROBES = ("lookahead_margin",)


@dataclass
class SessionTurn:
    r"""
    One `HandoffSession.respond` call.

    Args:
        model (`str`): the model that answered.
        tokens (`list[int]`): the generated tokens (appended to the transcript).
        mapped_from (`str`, *optional*): the model whose cache the new tokens were mapped from (`None`: none mapped).
        mapped_tokens (`int`): tokens mapped into this model's cache at this switch.
        window_tokens (`int`): earlier source positions read along for the mapper's context window.
        prefilled_tokens (`int`): tokens this model prefilled itself before generating.
        repaired_tokens (`int`): mapped tokens this model then recomputed itself (`HandoffSession(repair=...)`, or
            the ladder's repairing rung).
        rung (`str`, *optional*): with a ladder, the rung this switch took (`"mapped"`, `"repair:<f>"`, or
            `"fallback"`: the model prefilled the tokens it would have mapped); `None` without a ladder or a mapping.
        risk (`float`, *optional*): the ladder probe's risk on this switch.
        margin (`float`, *optional*): with a ladder that checks after its rung (`min_margin`), the answering model's
            margin on its first answer token over the cache its rung served ([`~hf_kvmap.serving.forwards.answer_margin`]).
        checked (`str`, *optional*): the rung the check sent back to the fallback (then `rung` is `"fallback"`).
        short (`bool`): the ladder's `min_tokens` found the unseen tokens too few to map: the model prefilled them
            (then `rung` is `"fallback"` and no probe ran).
        refresh (`dict`, *optional*): with `respond(refresh=...)` on a cache holding mapped positions, what
            [`~hf_kvmap.repair.DecodeRefresh`] recomputed of them while the model decoded (`refreshes`, `recomputed`,
            `seconds`, ...); `None` otherwise.
        first_logits (`torch.Tensor`, *optional*): `(vocab,)` logits of the first generated token.
        timings (`dict[str, float]`): seconds spent mapping, prefilling and generating.
    """

    model: str
    tokens: list[int]
    mapped_from: str | None = None
    mapped_tokens: int = 0
    window_tokens: int = 0
    prefilled_tokens: int = 0
    repaired_tokens: int = 0
    rung: str | None = None
    risk: float | None = None
    margin: float | None = None
    checked: str | None = None
    short: bool = False
    refresh: dict | None = None
    first_logits: torch.Tensor | None = None
    timings: dict[str, float] = field(default_factory=dict)


def _record_mapped(cache, info: dict) -> None:
    """Set `info`'s token count and approximate flag from its mapped spans, and hang it on `cache`."""
    info["mapped_tokens"] = sum(b - a for a, b in info["mapped_positions"])
    info["approximate"] = cache.approximate = bool(info["mapped_positions"])
    cache.mapping_info = info


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
    model's cache that holds mapped positions is approximate: it carries `approximate = True` and a `mapping_info`
    (`mapped_positions`, the mappers), which `save_cache` records.
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
    def _map_into(self, source: str, target: str, start: int, end: int) -> int:
        """Map transcript tokens `[start, end)` from `source`'s cache onto the end of `target`'s; returns the number
        of earlier source positions read along for the context window."""
        mapper = self.mappers[(source, target)]
        window = mapper.config.max_context_window  # the widest window of any map (layer_inputs included)
        begin = max(0, start - window)
        layers = self.caches[source].layers
        keys = [layer.keys[:, :, begin:end] for layer in layers]
        values = [layer.values[:, :, begin:end] for layer in layers]
        positions = torch.arange(begin, end, device=keys[0].device).unsqueeze(0)
        mapped = mapper(keys, values, position_ids=positions)
        cache = self.caches[target]
        if cache is None:
            cache = self.caches[target] = DynamicCache()
        dtype = next(self.models[target].parameters()).dtype
        for idx, (new_keys, new_values) in enumerate(mapped):
            new_keys, new_values = new_keys[:, :, start - begin :], new_values[:, :, start - begin :]
            if len(cache.layers) > idx and cache.layers[idx].is_initialized:
                dtype, device = cache.layers[idx].keys.dtype, cache.layers[idx].keys.device
            else:
                device = new_keys.device
            cache.update(new_keys.to(device, dtype), new_values.to(device, dtype), idx)
        info = getattr(cache, "mapping_info", None) or {"mapped_positions": [], "mappers": []}
        info["mapped_positions"].append([start, end])
        info["mappers"].append({"from": source, "content_hash": mapper.config.content_hash})
        _record_mapped(cache, info)
        return start - begin

    @torch.no_grad()
    def sync(self, name: str) -> SessionTurn:
        """Bring `name`'s cache to every transcript token but the last: map what another model already processed
        (from the model that has processed the most, when a mapper exists), prefill the rest itself."""
        if name not in self.models:
            raise ValueError(f"Unknown model {name!r}; the session has {sorted(self.models)}.")
        end = self.input_ids.shape[1] - 1
        if end < 0:
            raise ValueError("The transcript is empty: append the first turn before a model responds.")
        record = SessionTurn(model=name, tokens=[])
        have = self.covered(name)
        mapped = None
        donors = [
            other
            for other in self.models
            if other != name and (other, name) in self.mappers and self.covered(other) > have
        ]
        donor = max(donors, key=self.covered) if donors else None
        upto = min(self.covered(donor), end) if donor is not None else have
        if donor is not None and self.ladder is not None and self.ladder.too_short(upto - have):
            record.rung, record.short = rung_name(None), True  # too few to map: the model prefills them below
            logger.info("%s prefills the tokens it has not seen: fewer than the ladder's min_tokens", name)
        elif donor is not None:
            start_time = time.perf_counter()
            record.window_tokens = self._map_into(donor, name, have, upto)
            record.timings["map"] = time.perf_counter() - start_time
            record.mapped_from, record.mapped_tokens = donor, upto - have
            mapped = (donor, have, upto)
            if self.repair is not None:
                start_time = time.perf_counter()
                record.repaired_tokens = self._repair(name, donor, have, upto, self.repair)
                record.timings["repair"] = time.perf_counter() - start_time
            have = upto
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
        if mapped is not None and self.ladder is not None:
            self._take_rung(name, record, *mapped, end)
        return record

    def _repair(self, name: str, donor: str, start: int, upto: int, config: RepairConfig) -> int:
        """`name` recomputes the share of the tokens `[start, upto)` mapped from `donor` that `config` selects;
        returns how many it recomputed."""
        counts = apply_repair(
            self.models[name],
            self.caches[name],
            self.input_ids[:, :upto],
            config,
            source=self.models[donor],
            source_cache=self.caches[donor],
            start=start,
        )
        return counts[0]

    def _take_rung(self, name: str, record: SessionTurn, donor: str, start: int, upto: int, end: int) -> None:
        """The ladder's rung for the tokens `[start, upto)` just mapped from `donor` into `name`'s cache (which now
        covers `end` tokens): keep them, recompute a share, or prefill them; then re-run `[upto, end)` on the result."""
        model, cache = self.models[name], self.caches[name]
        ids = self.input_ids[:, : end + 1]
        start_time = time.perf_counter()
        context = ProbeContext(
            source=self.models[donor],
            target=model,
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.arange(end + 1, device=ids.device).unsqueeze(0),
            cache=cache,
            source_cache=self.caches[donor],
        )
        record.risk = float(self._probe.score(context).float()[0])
        record.timings["probe"] = time.perf_counter() - start_time
        fraction = self.ladder.fraction_for(record.risk)
        record.rung = rung_name(fraction)
        if fraction is None:
            self._own_span(name, record, start, upto, end)
            return
        if fraction:
            start_time = time.perf_counter()
            if cache.get_seq_length() > upto:
                cache.crop(-(cache.get_seq_length() - upto))
            config = RepairConfig(self.ladder.strategy, fraction=fraction)
            record.repaired_tokens = self._repair(name, donor, start, upto, config)
            if end > upto:
                run_tokens(model, cache, self.input_ids, upto, end)
            record.timings["repair"] = time.perf_counter() - start_time
        if self.ladder.min_margin is not None:  # the check after the rung, on the cache it served
            start_time = time.perf_counter()
            record.margin = float(answer_margin(model, cache, ids, tokens=self.ladder.check_tokens)[0])
            record.timings["check"] = time.perf_counter() - start_time
            if below_margin(record.margin, self.ladder.min_margin):
                record.checked, record.rung = record.rung, rung_name(None)
                self._own_span(name, record, start, upto, end)

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
        cache.recomputed = recomputed_mask(cache, 1, length) | own
        return DecodeRefresh(model, cache, **refresh)

    def _own_span(self, name: str, record: SessionTurn, start: int, upto: int, end: int) -> None:
        """The fallback of a switch: `name` prefills the tokens `[start, upto)` it had mapped (its own again), then
        re-runs `[upto, end)` on them."""
        model, cache = self.models[name], self.caches[name]
        start_time = time.perf_counter()
        if cache.get_seq_length() > start:
            cache.crop(-(cache.get_seq_length() - start))
        info = cache.mapping_info
        info["mapped_positions"].pop()
        info["mappers"].pop()
        _record_mapped(cache, info)
        record.prefilled_tokens += upto - start
        if end > start:
            run_tokens(model, cache, self.input_ids, start, end)
        record.timings["fallback"] = time.perf_counter() - start_time

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
