"""Diagnostics of a mapper on held-out text: K/V R^2 per layer and head, and the attention-output cosine.

The attention-output cosine is the diagnostic the reference paper found predictive of retention: for target layer
`l`, the target's own queries attend once over its true K/V and once over the mapped K/V of that layer (every other
layer keeps its true cache, so the queries reaching layer `l` are exactly the target's); the cosine between the two
per-head attention outputs (the input of `o_proj`) is averaged over query tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ._compat import cache_kwargs, output_cache
from .cache import MappedCache
from .evaluation import HandoffEvaluation, evaluate_items
from .regression import r2_score
from .rope import RotaryCodec, positions_from_attention_mask


def _r2_per_head(predicted: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """R^2 per head of `(batch, heads, seq, dim)` tensors: 1 - SS_res / SS_tot (centered per dim over tokens)."""
    predicted, true = predicted.double(), true.double()
    flat_true = true.transpose(0, 1).reshape(true.shape[1], -1, true.shape[-1])
    flat_pred = predicted.transpose(0, 1).reshape(true.shape[1], -1, true.shape[-1])
    ss_res = (flat_pred - flat_true).square().sum(dim=(1, 2))
    ss_tot = (flat_true - flat_true.mean(dim=1, keepdim=True)).square().sum(dim=(1, 2))
    return r2_score(ss_res, ss_tot)


def _attention_inputs(model, layer_idx: int, ids, cache):
    """Run `ids` on top of `cache` and return the input of layer `layer_idx`'s `o_proj` (all heads concatenated)."""
    captured = {}
    layer = model.get_decoder().layers[layer_idx]

    def hook(_module, args):
        captured["x"] = args[0].detach()

    handle = layer.self_attn.o_proj.register_forward_pre_hook(hook)
    try:
        model(input_ids=ids, use_cache=True, **cache_kwargs(cache))
    finally:
        handle.remove()
    return captured["x"]


def _with_layer(cache_layers, layer_idx: int, keys, values) -> DynamicCache:
    data = [(k.clone(), v.clone()) for k, v in cache_layers]
    data[layer_idx] = (keys.clone(), values.clone())
    return DynamicCache(ddp_cache_data=data)


@torch.no_grad()
def diagnose(source, target, mapper, batches: Iterable[torch.Tensor], query_tokens: int = 16) -> dict:
    """Per target layer and head: R^2 of mapped keys (content space) and values, and attention-output cosine.

    Args:
        source, target (`PreTrainedModel`): the two models.
        mapper ([`MapperModel`]): the mapper to diagnose.
        batches (iterable of `LongTensor (batch, seq)`): held-out token ids; the first `seq - query_tokens` tokens
            are mapped, the last `query_tokens` are the queries.
        query_tokens (`int`, *optional*, defaults to 16).

    Returns:
        `dict` with `layers` (one entry per target layer: `key_r2`, `value_r2`, `attention_cosine`, each a list per
        KV head / attention head) and `summary` (means).
    """
    codec = RotaryCodec(target.config)
    num_layers = mapper.config.target_geometry.num_layers
    sums = {"key_r2": [], "value_r2": [], "attention_cosine": []}
    for ids in batches:
        if ids.shape[1] <= query_tokens + 1:
            raise ValueError(f"Diagnostic sequences need more than {query_tokens + 1} tokens; got {ids.shape[1]}.")
        prefix, queries = ids[:, :-query_tokens], ids[:, -query_tokens:]
        mapped = MappedCache.from_source(output_cache(source(input_ids=prefix, use_cache=True)), mapper, hold_back=1)
        true = output_cache(target(input_ids=prefix, use_cache=True))
        true.crop(-1)
        true_layers = [(layer.keys, layer.values) for layer in true.layers]
        positions = torch.arange(prefix.shape[1] - 1).expand(prefix.shape[0], -1)
        table = codec.table(positions)
        # the held-back token plus the query tokens are run by the target on top of each cache
        run_ids = torch.cat([prefix[:, -1:], queries], dim=1)
        rows = {"key_r2": [], "value_r2": [], "attention_cosine": []}
        for layer_idx in range(num_layers):
            mk, mv = mapped.layers[layer_idx].keys, mapped.layers[layer_idx].values
            tk, tv = true_layers[layer_idx]
            rows["key_r2"].append(_r2_per_head(table.strip(mk.to(tk.device)), table.strip(tk)))
            rows["value_r2"].append(_r2_per_head(mv.to(tv.device), tv))
            reference = _attention_inputs(target, layer_idx, run_ids, DynamicCache(ddp_cache_data=true_layers))
            hybrid = _attention_inputs(target, layer_idx, run_ids, _with_layer(true_layers, layer_idx, mk, mv))
            heads = target.config.num_attention_heads
            reference = reference.view(*reference.shape[:2], heads, -1).double()
            hybrid = hybrid.view(*hybrid.shape[:2], heads, -1).double()
            rows["attention_cosine"].append(
                torch.nn.functional.cosine_similarity(hybrid, reference, dim=-1).mean((0, 1))
            )
        for key in sums:
            sums[key].append(torch.stack(rows[key]))
    if not sums["key_r2"]:
        raise ValueError("diagnose() got no batches.")
    means = {key: torch.stack(values).mean(0) for key, values in sums.items()}
    layers = [{key: [round(v, 6) for v in means[key][layer].tolist()] for key in means} for layer in range(num_layers)]
    return {
        "layers": layers,
        "summary": {
            "mean_key_r2": means["key_r2"].mean().item(),
            "mean_value_r2": means["value_r2"].mean().item(),
            "mean_attention_cosine": means["attention_cosine"].mean().item(),
            "min_layer_attention_cosine": means["attention_cosine"].mean(-1).min().item(),
            "query_tokens": query_tokens,
            "sequences": sum(1 for _ in sums["key_r2"]),
        },
    }


@dataclass
class _SwapHandoff(HandoffEvaluation):
    """A handoff whose `mapped` mode reads the target's own cache except for the mapped `layers` / `parts`, and
    its own cache at the first `own_tokens` positions of every prompt in every layer.

    Caches come from `base` (any [`HandoffEvaluation`], so one that keeps its prefills on disk keeps them here too)."""

    base: HandoffEvaluation | None = None
    layers: tuple = ()
    parts: tuple = ("keys", "values")
    own_tokens: int = 0

    def context_cache(self, mode: str, ids: torch.Tensor, mask: torch.Tensor | None = None):
        if mode != "mapped":
            return self.base.context_cache(mode, ids, mask)
        reader, true = self.base.context_cache("target", ids, mask)
        _, mapped = self.base.context_cache("mapped", ids, mask)
        if self.own_tokens:
            length = true.layers[0].keys.shape[-2]
            positions = positions_from_attention_mask(mask, ids.shape[0], ids.shape[1], ids.device)[:, :length]
            exact = (positions < self.own_tokens)[:, None, :, None]  # (batch, 1, length, 1): the first tokens
        data = []
        for idx, (own, other) in enumerate(zip(true.layers, mapped.layers)):
            swap = idx in self.layers
            keys = other.keys.to(own.keys) if swap and "keys" in self.parts else own.keys
            values = other.values.to(own.values) if swap and "values" in self.parts else own.values
            if self.own_tokens:
                keys, values = torch.where(exact, own.keys, keys), torch.where(exact, own.values, values)
            data.append((keys, values))
        return reader, DynamicCache(ddp_cache_data=data)


def layer_swap(
    handoff: HandoffEvaluation,
    task,
    layers: Iterable[int] | None = None,
    own_layers: Iterable[int] = (),
    own_first: Iterable[int] = (),
    own_tokens: Iterable[int] = (),
) -> dict:
    """Which mapped layer (and whether its keys or values) breaks a task, and whether the rest of the map holds.

    The target reads its own cache everywhere except one layer, which comes from the mapper; the task is scored for
    each layer in turn, then with only the keys (only the values) of every layer mapped. A task that survives every
    single swap but not the full mapping fails from accumulated error; one that collapses at one layer points at it.
    For each of `own_layers` the converse is scored too: every layer mapped except that one, which is the target's
    own (does the task hold once that layer is right?), and for each `n` of `own_first` the target's own first `n`
    layers with the rest mapped (how many exact layers does the task need? the cache a target gets by running its
    own first `n` layers and mapping the rest); for each `n` of `own_tokens`, every layer mapped except at the
    prompt's first `n` tokens (the attention sink and the template's opening), which are the target's own in every
    layer (the cache a target gets by prefilling those `n` tokens itself).

    Args:
        handoff ([`~hf_kvmap.evaluation.HandoffEvaluation`]): source, target, mapper and tokenizer; the caches come from its
            `context_cache` (a subclass that keeps prefills on disk serves every swap from them).
        task ([`~hf_kvmap.evaluation.TaskSpec`]): the task to score (accuracy, or perplexity for `perplexity` tasks).
        layers (iterable of `int`, *optional*): target layers to swap one at a time (default: all).
        own_layers (iterable of `int`, *optional*): target layers to keep the target's own, one at a time, with every
            other layer mapped (default: none).
        own_first (iterable of `int`, *optional*): numbers of leading target layers to keep the target's own, with
            every later layer mapped (default: none).
        own_tokens (iterable of `int`, *optional*): numbers of leading prompt tokens to keep the target's own in
            every layer, every later position mapped (default: none).

    Returns:
        `{"target": score, "mapped": score, "layers": {layer: score}, "keys_only": score, "values_only": score}`,
        with `"all_but": {layer: score}` when `own_layers` is given, `"own_first": {n: score}` when `own_first` is and
        `"own_tokens": {n: score}` when `own_tokens` is.
    """
    kwargs = {"stop": task.stop} if task.task_type == "exact_match" else {}
    num_layers = handoff.mapper.config.target_geometry.num_layers
    layers = range(num_layers) if layers is None else layers
    own_layers = list(own_layers)
    if any(not 0 <= layer < num_layers for layer in own_layers):
        raise ValueError(f"own_layers={own_layers} names a layer outside the target's {num_layers} layers.")
    own_first = list(own_first)
    if any(not 0 <= n <= num_layers for n in own_first):
        raise ValueError(
            f"own_first={own_first} asks for more than the target's {num_layers} layers (or fewer than 0)."
        )
    own_tokens = list(own_tokens)
    if any(n < 0 for n in own_tokens):
        raise ValueError(f"own_tokens={own_tokens} has a negative count.")

    def score(mode: str, swap_layers=(), parts=("keys", "values"), tokens: int = 0) -> float:
        probe = _SwapHandoff(
            handoff.source,
            handoff.target,
            handoff.mapper,
            handoff.tokenizer,
            handoff.hold_back,
            base=handoff,
            layers=tuple(swap_layers),
            parts=parts,
            own_tokens=tokens,
        )
        return evaluate_items(probe, task.task_type, task.items, mode, **kwargs)

    result = {
        "task": task.name,
        "target": score("target"),
        "mapped": evaluate_items(handoff, task.task_type, task.items, "mapped", **kwargs),
        "layers": {layer: score("mapped", (layer,)) for layer in layers},
        "keys_only": score("mapped", tuple(range(num_layers)), ("keys",)),
        "values_only": score("mapped", tuple(range(num_layers)), ("values",)),
    }
    if own_layers:
        result["all_but"] = {
            layer: score("mapped", tuple(i for i in range(num_layers) if i != layer)) for layer in own_layers
        }
    if own_first:
        result["own_first"] = {n: score("mapped", tuple(range(n, num_layers))) for n in own_first}
    if own_tokens:
        result["own_tokens"] = {n: score("mapped", tuple(range(num_layers)), tokens=n) for n in own_tokens}
    return result
