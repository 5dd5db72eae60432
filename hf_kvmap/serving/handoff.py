"""The guarded handoff: gate, map, probe, then serve the mapped cache or the target's own prefill.

```python
cache, report = handoff(source, target, mapper, input_ids)
tokens = target.generate(input_ids, cache=cache, max_new_tokens=64)  # `past_key_values=` on transformers 5.23
```

`cache` covers every prompt token but the last, so `generate` runs exactly the last one. When the probe refuses the
mapped cache (or the gate refuses the models), `policy="fallback"` serves the target's own prefill instead, and the
generation is then token-identical to `target.generate(input_ids)`; `policy="fail"` raises [`HandoffRefusedError`].
The probe and its threshold come from the mapper's config (`MapperConfig.handoff_probe`, written by
[`calibrate_probe`]), or are passed explicitly. How a request is served, stage by stage, is
`hf_kvmap.serving.pipeline`; this module is its front door: it checks and resolves the arguments.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache

from .._compat import cache_argument
from ..input_checks import check_left_padding_mask, check_threshold, check_token_ids, derive_mask
from ..repair import RepairConfig
from ..request_context import RequestContext
from ..validation import check_bool, check_choice, check_int
from .ladder import GuardLadder
from .pipeline import serve, uncalibrated_error
from .probes import Probe, probe_from_dict
from .report import HandoffRefusedError, HandoffReport

POLICIES = ("fallback", "fail")


@torch.no_grad()
def handoff(
    source,
    target,
    mapper,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    source_cache: Cache | None = None,
    policy: str = "fallback",
    probe: Probe | str | dict | None = None,
    threshold: float | None = None,
    tokenizer=None,
    audit_tokens: int = 8,
    source_position_ids: torch.Tensor | None = None,
    target_first_layer: bool = False,
    same_weights: bool = False,
    repair: RepairConfig | dict | None = None,
    ladder: GuardLadder | dict | bool | None = None,
) -> tuple[Cache, HandoffReport]:
    r"""
    Hand a prompt from the source model to the target: check, map, probe, then serve the mapped cache or fall back.

    The stages are `hf_kvmap.serving.pipeline`'s (gate, source prefill, map, repair, held-back tokens, exactness audit,
    probe, a decision for the batch or a ladder rung per row). A refused batch gets the target's own prefill under
    `policy="fallback"` (then `generate` is token-identical to the target alone) and raises [`HandoffRefusedError`]
    under `policy="fail"`; a gate or mapping failure (e.g. NaN in the source cache) goes to the same policy.

    Args:
        source, target (`PreTrainedModel`): the two causal LMs; mapper ([`MapperModel`]): fitted for `source -> target`.
        input_ids (`torch.Tensor`): `(batch, T)` integer prompt, `T >= 2`; left padding with `attention_mask`.
        attention_mask (`torch.Tensor`, *optional*): `(batch, T)`; without it, the mask `generate` would infer from
            the pad token (recorded in `report.notes`).
        source_cache (`Cache`, *optional*): the source's cache of these `T` tokens (checked against them at every
            position from its first layer); without it the source prefills them.
        policy (`str`, *optional*, defaults to `"fallback"`): `"fallback"` or `"fail"`.
        probe (`Probe`, `str` or `dict`, *optional*), threshold (`float`, *optional*): override the calibrated ones.
        tokenizer (*optional*): checked against the mapper's tokenizer fingerprint when given.
        audit_tokens (`int`, *optional*, defaults to 8): size of the exactness audit (0 turns it off).
        source_position_ids (`torch.Tensor`, *optional*): `(batch, T)` positions a given `source_cache` was built at,
            when not a plain forward's `0 .. T-1`.
        target_first_layer (`bool`, *optional*, defaults to `False`): the target computes its first layer from the ids.
        same_weights (`bool`, *optional*, defaults to `False`): the models are the mapper's weights loaded from another
            location: the gate does not compare model ids.
        repair ([`~hf_kvmap.repair.RepairConfig`] or `dict`, *optional*): a fixed repair before the audit and probe.
        ladder ([`~hf_kvmap.serving.ladder.GuardLadder`], `dict` or `bool`, *optional*): a rung per row; defaults to
            `config.handoff_ladder` unless `probe=`, `threshold=` or `repair=` is given; `False` turns it off.

    Returns:
        `(cache, report)`: a cache of the first `T - 1` tokens for the target (a `MappedCache` when accepted, a
        `DynamicCache` of the target's own prefill otherwise) and a [`HandoffReport`]. The decision is taken for the
        whole batch: one refused row makes every row fall back, except under a ladder, where each row gets its own rung.

    Example:

    ```python
    >>> from hf_kvmap import MapperModel, handoff, zoo
    >>> source, target = zoo.load_model("tiny-m"), zoo.load_model("tiny-l")  # doctest: +SKIP
    >>> mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-m", "tiny-l"))  # doctest: +SKIP
    >>> cache, report = handoff(source, target, mapper, input_ids)  # doctest: +SKIP
    >>> out = target.generate(input_ids, cache=cache, max_new_tokens=8)  # doctest: +SKIP
    ```
    """
    check_choice("policy", policy, POLICIES)
    check_int("audit_tokens", audit_tokens, 0, meaning=" (0 turns the audit off)")
    check_bool("same_weights", same_weights)
    check_bool("target_first_layer", target_first_layer)
    _check_tokenizer(tokenizer)
    input_ids, attention_mask, notes = _check_inputs(source, target, mapper, input_ids, attention_mask, source_cache)
    ladder = resolve_ladder(mapper, ladder, probe=probe, threshold=threshold, repair=repair)
    if ladder is not None:
        probe, threshold = probe_from_dict(ladder.probe), math.inf
    else:
        probe, threshold = resolve_probe(mapper, probe, threshold, optional=bool(audit_tokens))
    repair = None if repair is None else RepairConfig.from_dict(repair)  # bad settings raise, never fall back
    request = RequestContext(
        source=source,
        target=target,
        mapper=mapper,
        input_ids=input_ids,
        attention_mask=attention_mask,
        source_cache=source_cache,
        source_position_ids=source_position_ids,
        tokenizer=tokenizer,
        target_first_layer=target_first_layer,
        same_weights=same_weights,
    )
    guard = dict(probe=probe, threshold=threshold, ladder=ladder, repair=repair, audit_tokens=audit_tokens)
    return serve(request, policy=policy, notes=notes, **guard)


def resolve_probe(
    mapper, probe: Probe | str | dict | None = None, threshold: float | None = None, *, optional: bool = False
):
    """The probe and threshold a handoff uses: the arguments if given, else the mapper config's `handoff_probe`.

    Raises `ValueError` when neither names a probe or a threshold (a mapper that was never calibrated), unless
    `optional=True` and neither is known (then `(None, None)`: only an exact mapping can be served). A NaN threshold
    is refused.
    """
    stored = getattr(mapper.config, "handoff_probe", None) or {}
    where = "argument" if threshold is not None else "config.handoff_probe"
    if probe is None:
        probe = stored.get("probe")
        if threshold is None:
            threshold = stored.get("threshold")
    if optional and probe is None and threshold is None:
        return None, None
    if probe is None or threshold is None:
        raise uncalibrated_error("probe" if probe is None else "threshold")
    threshold = check_threshold(threshold, where)
    if not isinstance(probe, Probe):
        probe = probe_from_dict(probe)
    return probe, threshold


def resolve_ladder(mapper, ladder=None, *, probe=None, threshold=None, repair=None) -> GuardLadder | None:
    """The ladder a handoff climbs: `ladder` if given (`False`: none), else the mapper config's `handoff_ladder`
    unless the caller chose a binary guard or a fixed repair (`probe=`, `threshold=`, `repair=`). A ladder given
    together with any of these raises: the ladder holds its own probe, thresholds and repair."""
    if ladder is False:
        return None
    if ladder is None or ladder is True:
        stored = getattr(mapper.config, "handoff_ladder", None)
        if ladder is True and not stored:
            raise ValueError(
                "ladder=True but the mapper has no calibrated ladder (`config.handoff_ladder`); calibrate one with "
                "`hf-kvmap calibrate-ladder` or pass a `GuardLadder`."
            )
        if not stored or (ladder is None and (probe is not None or threshold is not None or repair is not None)):
            return None
        ladder = stored
    if probe is not None or threshold is not None or repair is not None:
        raise ValueError(
            "A ladder holds its own probe, thresholds and repair strategy: pass `ladder=` without `probe=`, "
            "`threshold=` or `repair=` (or `ladder=False` to use those)."
        )
    return GuardLadder.from_dict(ladder)


def _check_tokenizer(tokenizer) -> None:
    """Refuse a tokenizer given by name or as anything without a vocabulary (its fingerprint is checked)."""
    if tokenizer is None:
        return
    if isinstance(tokenizer, (str, bytes)) or not callable(getattr(tokenizer, "get_vocab", None)):
        raise TypeError(
            f"tokenizer is a {type(tokenizer).__name__}; pass the tokenizer object, e.g. "
            f"`AutoTokenizer.from_pretrained({tokenizer!r})`"
            if isinstance(tokenizer, str)
            else f"tokenizer is a {type(tokenizer).__name__} without get_vocab(); pass a transformers tokenizer."
        )


def _check_inputs(source, target, mapper, input_ids, attention_mask, source_cache):
    """`(input_ids, attention_mask, notes)` checked; the mask `generate` would infer when none is given."""
    from ..modeling_mapper import MapperModel

    if not isinstance(mapper, MapperModel):
        raise TypeError(f"mapper is a {type(mapper).__name__}; pass a `MapperModel` (`MapperModel.from_pretrained`).")
    input_ids = check_token_ids(input_ids, (source, target))
    if input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids has {input_ids.shape[1]} token(s): a handoff maps all prompt tokens but the last, so it needs "
            "at least 2. Let the target prefill a 1-token prompt itself."
        )
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {tuple(input_ids.shape)}."
        )
    if attention_mask is not None:
        check_left_padding_mask(attention_mask)
    if source_cache is not None and not isinstance(source_cache, Cache):
        raise TypeError(
            f"source_cache is a {type(source_cache).__name__}; pass a transformers `Cache` (the legacy tuple of "
            f"(key, value) pairs is gone in transformers 5): `source(input_ids, use_cache=True).{cache_argument()}`, "
            "or `DynamicCache(ddp_cache_data=pairs)` to wrap the pairs."
        )
    if source_cache is not None:
        seq = source_cache.get_seq_length()
        if seq != input_ids.shape[1]:
            raise ValueError(
                f"source_cache covers {seq} tokens but input_ids has {input_ids.shape[1]}: pass the source's cache of "
                f"exactly these prompt tokens (`source(input_ids, use_cache=True).{cache_argument()}`)."
            )
    notes = []
    if attention_mask is None:
        attention_mask = derive_mask(target, input_ids)
        if attention_mask is not None:
            notes.append(
                f"attention_mask derived as generate derives it: input_ids != pad_token_id "
                f"({target.generation_config.pad_token_id}); pass attention_mask to say otherwise"
            )
    return input_ids, attention_mask, notes


__all__ = ["POLICIES", "HandoffRefusedError", "HandoffReport", "handoff", "resolve_ladder", "resolve_probe"]
