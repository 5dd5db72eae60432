"""FLOP arithmetic for the latency bound of a handoff (docs/method.md, "The FLOP bound").

Everything here is counted from configs (no weights, no torch): a model config (`PretrainedConfig` or its
`to_dict()`) for the target, and a `MapperConfig` (or the two geometries and `k`) for the mapper.

Conventions (one multiply-add = 2 FLOPs):

- mapper FLOPs = `2 * T * params_mapper`, biases included (they cost one add per output, counted as two). The
  RoPE strip/apply around the matmul is elementwise (`O(T * width)`) and not counted.
- target body FLOPs = `2 * T * params_body + L * attention`, where `params_body` are the parameters of the decoder
  layers (attention projections and their biases, the MLP, the per-layer and per-head norms); embeddings, the final
  norm and the LM head are excluded.
- attention per layer = `2 * T**2 * n_heads * head_dim`: `QK^T` and `AV` each cost `2 * T**2 * n_heads * head_dim`
  without a mask, i.e. `4 * T**2 * n_heads * head_dim` together, and a causal mask halves it (the exact causal count
  is `2 * T * (T + 1) * n_heads * head_dim`; the difference is below 1/T).
- bound = body FLOPs / mapper FLOPs: the speedup a mapper could reach over re-prefilling if both ran at the same
  FLOP rate. For Qwen3 14B->32B with k=8 at 32K tokens it is about 45x (docs/method.md; `tests/test_benchmarks.py`).

Example:

```python
>>> from hf_kvmap.flops import flop_bound, ridge_mapper_parameters
>>> qwen3_32b = dict(model_type="qwen3", hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
...                  num_key_value_heads=8, head_dim=128, intermediate_size=25600)
>>> ridge_mapper_parameters((40, 8, 128), (64, 8, 128), k=8, bias=False)
1073741824
>>> round(flop_bound(ridge_mapper_parameters((40, 8, 128), (64, 8, 128), k=8), qwen3_32b, 32768).ratio)
45

```
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "FINETUNE_OBJECTIVES",
    "FlopBound",
    "attention_flops",
    "finetune_step_cost",
    "body_parameters",
    "flop_bound",
    "mapper_parameters",
    "prefill_flops",
    "repair_flops",
    "ridge_mapper_parameters",
]


def _text_fields(config: Any) -> dict[str, Any]:
    """A flat dict of the decoder text config (accepts a `PretrainedConfig`, a multimodal one, or a dict)."""
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return config.to_dict()


def _geometry(config: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """(layers, hidden, heads, kv_heads, head_dim) of a text config dict."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return int(config["num_hidden_layers"]), hidden, heads, kv_heads, head_dim


def body_parameters(config: Any) -> int:
    """Parameters of the decoder layers of a llama-like model (`llama`, `mistral`, `ministral*`, `qwen2`, `qwen3`).

    Counts q/k/v/o projections (+ biases: all four with `attention_bias`, q/k/v for `qwen2`), the gated MLP
    (`3 * hidden * intermediate`, + biases with `mlp_bias`), the two RMSNorms per layer and Qwen3's per-head q/k norms.
    Embeddings, the final norm and the LM head are excluded. Matches `sum(p.numel() for p in model.model.layers
    .parameters())` for every architecture in the test registry.
    """
    config = _text_fields(config)
    layers, hidden, heads, kv_heads, head_dim = _geometry(config)
    model_type = config.get("model_type", "")
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
    if config.get("attention_bias", False):
        attention += q_width + 2 * kv_width + hidden
    elif model_type == "qwen2":  # Qwen2 always biases q/k/v, never o
        attention += q_width + 2 * kv_width
    if model_type == "qwen3":  # per-head RMSNorm on q and k
        attention += 2 * head_dim
    intermediate = int(config["intermediate_size"])
    mlp = 3 * hidden * intermediate
    if config.get("mlp_bias", False):
        mlp += 2 * intermediate + hidden
    norms = 2 * hidden
    return layers * (attention + mlp + norms)


def attention_flops(config: Any, tokens: int) -> int:
    """Causal self-attention FLOPs of a prefill of `tokens` tokens, all layers: `L * 2 * T**2 * n_heads * head_dim`."""
    layers, _, heads, _, head_dim = _geometry(_text_fields(config))
    return layers * 2 * tokens * tokens * heads * head_dim


def prefill_flops(config: Any, tokens: int) -> int:
    """Target body prefill FLOPs: `2 * T * body_parameters + attention_flops` (no embeddings, no LM head)."""
    return 2 * tokens * body_parameters(config) + attention_flops(config, tokens)


def repair_flops(config: Any, positions: list[int]) -> int:
    """FLOP bound of recomputing the cached `positions` (0-based) of one row: their linear work and their causal
    attention over the positions up to each (`hf_kvmap.flops` conventions)."""
    layers, _, heads, _, head_dim = _geometry(_text_fields(config))
    attention = layers * 4 * heads * head_dim * sum(p + 1 for p in positions)
    return 2 * len(positions) * body_parameters(config) + attention


def ridge_mapper_parameters(
    source: tuple[int, int, int], target: tuple[int, int, int], k: int | list[list[int]], bias: bool = True
) -> int:
    """Parameters of a ridge mapper from geometries `(layers, kv_heads, head_dim)`.

    `k` is the number of source layers per target layer (or the `source_layers` lists themselves). Per target layer
    and K or V: `(k * n_kv_src * d_src) x (n_kv_tgt * d_tgt)` weights (+ `n_kv_tgt * d_tgt` biases). Without biases
    this is the paper's (docs/method.md) `2 * L_t * n_kv_t * (k * n_kv_s * d_s) * d_t`.
    """
    _, src_kv, src_dim = source
    tgt_layers, tgt_kv, tgt_dim = target
    counts = [len(selected) for selected in k] if isinstance(k, list) else [int(k)] * tgt_layers
    out = tgt_kv * tgt_dim
    return sum(2 * (count * src_kv * src_dim * out + (out if bias else 0)) for count in counts)


def mapper_parameters(config: Any) -> int:
    """Parameters of the `MapperModel` a `MapperConfig` describes (ridge: one affine map per target layer and K/V;
    mlp: per target layer, KV head and K/V, `d_in -> h -> h -> head_dim`), `d_in` being each map's
    `config.input_width(layer, part)` (which grows with `input_kinds="both"` and a `context_window`, globally or in
    that map's `layer_inputs` entry), plus the `head_dim` key-norm weights per target layer with `key_norm`."""
    target = config.target_geometry
    total = 0
    for layer in range(target.num_layers):
        if getattr(config, "key_norm", False):
            total += target.head_dim
        for part in ("key", "value"):
            width = config.input_width(layer, part)
            if config.kind == "ridge":
                total += width * target.layer_width + target.layer_width
                continue
            hidden, out = config.mlp_hidden_size, target.head_dim
            per_head = width * hidden + hidden + hidden * hidden + hidden + hidden * out + out
            total += target.num_kv_heads * per_head
    return total


@dataclass(frozen=True)
class FlopBound:
    """FLOPs of mapping vs re-prefilling `tokens` tokens, and their ratio (the speedup bound)."""

    tokens: int
    mapper_parameters: int
    body_parameters: int
    mapper_flops: int
    body_linear_flops: int
    attention_flops: int
    prefill_flops: int
    ratio: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def flop_bound(mapper: Any, target_config: Any, tokens: int) -> FlopBound:
    """The FLOP bound of mapping `tokens` tokens with `mapper` (a `MapperConfig`, a `MapperModel`, or a parameter
    count) instead of prefilling them with the target body described by `target_config`."""
    if isinstance(mapper, int):
        params = mapper
    else:
        params = mapper_parameters(getattr(mapper, "config", mapper))
    body = body_parameters(target_config)
    attention = attention_flops(target_config, tokens)
    linear = 2 * tokens * body
    mapper_flops = 2 * tokens * params
    return FlopBound(
        tokens=tokens,
        mapper_parameters=params,
        body_parameters=body,
        mapper_flops=mapper_flops,
        body_linear_flops=linear,
        attention_flops=attention,
        prefill_flops=linear + attention,
        ratio=(linear + attention) / mapper_flops,
    )


#: The fine-tunes [`finetune_step_cost`] counts.
FINETUNE_OBJECTIVES = ("attention", "kl")


def _lm_head_flops(config: dict[str, Any], tokens: int) -> int:
    return 2 * tokens * int(config["hidden_size"]) * int(config["vocab_size"])


def _suffix_attention_flops(config: dict[str, Any], prefix: int, suffix: int) -> int:
    """All layers' causal attention of `suffix` queries (positions `prefix..`) over the keys before them:
    `L * 4 * n_heads * head_dim * (suffix * prefix + suffix**2 / 2)` (`QK^T` and `AV`)."""
    layers, _, heads, _, head_dim = _geometry(config)
    return layers * 4 * heads * head_dim * (suffix * prefix + suffix * suffix // 2)


def finetune_step_cost(
    objective: str,
    source_config: Any,
    target_config: Any,
    mapper_params: int,
    *,
    batch: int,
    tokens: int,
    prefix: int,
    dtype_bytes: int = 2,
) -> dict[str, Any]:
    r"""
    FLOPs and memory of one step of a fine-tune (`"attention"`: `hf_kvmap.objectives.attention`; `"kl"`:
    `hf_kvmap.objectives.kl`) on `batch` sequences of `tokens` tokens cut at `prefix`, counted from configs.

    Conventions (beyond the module's): a backward costs twice its forward where weights get gradients (the
    mapper) and once where only activations do (the frozen target's linear layers: no weight gradients), attention
    backward twice its forward; the mapper trains in float32 with Adam (weights, gradients and two moments:
    16 bytes per parameter). Both objectives prefill the source on the prefix and run the target on the whole
    sequence without gradients (the reference).

    - `"attention"`: per target layer, the suffix queries attend over the sequence twice (mapped and own cache)
      and the mapped one is back-propagated; through the output projection (forward both, backward once). Memory for
      the backward: the suffix queries, outputs and their gradients and the sequence's keys and values of one layer
      (float32; each layer is mapped and back-propagated on its own), no target activations.
    - `"kl"`: the reference forward also computes the LM head on the suffix; then the target runs the suffix on the
      mapped cache with gradients, LM head included, and is back-propagated through every layer. Memory for the
      backward: per suffix token and layer the inputs the backward of each op needs (`4 hidden + 3 q_width +
      2 kv_width + 3 intermediate` values in `dtype_bytes`), plus the suffix logits and their gradient (float32).

    Returns:
        `{"objective", "flops": {part: FLOPs}, "total_flops", "target_forwards", "total_flops_cached_references",
        "target_forwards_cached_references", "memory_bytes": {part: bytes}, "total_memory_bytes"}`;
        `target_forwards` is `total_flops` over one no-gradient target forward of the sequences (LM head included);
        the `cached_references` totals leave out the reference forwards (computed once per sequence and kept, as
        `cache_references=True` does, they are shared by every epoch). The memory counts what this implementation
        keeps for one backward (the attention objective: one layer's; KL: every layer's); the cached references
        themselves are not counted.
    """
    if objective not in FINETUNE_OBJECTIVES:
        raise ValueError(f"objective={objective!r} is not one of {FINETUNE_OBJECTIVES}.")
    if not 0 < prefix < tokens:
        raise ValueError(f"prefix={prefix} must cut the {tokens} tokens into two non-empty parts.")
    source, target = _text_fields(source_config), _text_fields(target_config)
    layers, hidden, heads, kv_heads, head_dim = _geometry(target)
    suffix = tokens - prefix
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    flops = {
        "source prefix prefill": batch * prefill_flops(source, prefix),
        "target reference forward": batch * prefill_flops(target, tokens),
        "mapper forward and backward": batch * 6 * prefix * mapper_params,
    }
    memory = {"mapper and Adam state": 16 * mapper_params}
    attention = batch * _suffix_attention_flops(target, prefix, suffix)
    if objective == "attention":
        projection = batch * layers * 2 * suffix * q_width * hidden
        flops["attention of the suffix queries (mapped, own, backward)"] = 4 * attention
        flops["output projections (mapped, own, backward)"] = 3 * projection
        memory["queries, outputs and gradients of the suffix, keys and values (one layer at a time)"] = (
            4 * batch * (3 * suffix * q_width + 2 * hidden * suffix + 2 * tokens * kv_width)
        )
    else:
        linear = batch * 2 * suffix * body_parameters(target)
        lm_head = batch * _lm_head_flops(target, suffix)
        flops["target reference forward"] += lm_head
        flops["target suffix forward on the mapped cache"] = linear + attention + lm_head
        flops["target suffix backward (activations only)"] = linear + 2 * attention + lm_head
        per_token = 4 * hidden + 3 * q_width + 2 * kv_width + 3 * int(target["intermediate_size"])
        memory["target activations of the suffix"] = dtype_bytes * batch * suffix * layers * per_token
        memory["suffix logits and gradients"] = 4 * 3 * batch * suffix * int(target["vocab_size"])
        memory["mapped cache (leaf of the graph)"] = 4 * 2 * batch * layers * prefix * kv_width
    total = sum(flops.values())
    references = flops["source prefix prefill"] + flops["target reference forward"]
    forward = batch * (prefill_flops(target, tokens) + _lm_head_flops(target, tokens))
    return {
        "objective": objective,
        "batch": batch,
        "tokens": tokens,
        "prefix": prefix,
        "flops": flops,
        "total_flops": total,
        "target_forwards": total / forward,
        "total_flops_cached_references": total - references,
        "target_forwards_cached_references": (total - references) / forward,
        "memory_bytes": memory,
        "total_memory_bytes": sum(memory.values()),
    }
