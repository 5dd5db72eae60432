"""Input features of a mapper: the content-space keys/values of a model, and the layout a mapper reads them in.

- [`model_features`]: one forward of a model on a batch, returning its per-layer content-space keys (RoPE
  stripped with the model's own rotary embedding) and values. [`batch_features`] runs every calibration batch
  through both models with it: the one feature extraction behind `CalibrationStatistics` (sums) and
  [`gather_features`] (features kept in memory).
- What a map reads from them (its own part or both, the earlier positions of a context window) is the one layout of
  `hf_kvmap.layout` ([`window_features`], [`mapper_inputs`]), shared by `MapperModel.forward` and fitting.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

from ._compat import output_cache
from .configuration_mapper import check_int
from .fit_options import FitOptions
from .geometry import KVGeometry
from .layout import PARTS, window_features
from .rope import RotaryCodec, positions_from_attention_mask

logger = logging.get_logger(__name__)


def input_device(model) -> torch.device:
    """The device a model's input ids go to (its input embeddings', else its first parameter's)."""
    embeddings = model.get_input_embeddings()
    if embeddings is not None:
        return embeddings.weight.device
    return next(model.parameters()).device


def unpack_batch(batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(input_ids, attention_mask or None)` of a calibration batch: a `(batch, seq)` (or `(seq,)`) LongTensor, a
    dict with `input_ids` (and `attention_mask`), or an `(input_ids, attention_mask)` pair. Raises `ValueError`."""
    if isinstance(batch, Mapping):
        input_ids, attention_mask = batch["input_ids"], batch.get("attention_mask")
    elif isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor):
        input_ids, attention_mask = batch
    else:
        input_ids, attention_mask = batch, None
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            "Each calibration batch must be a LongTensor (batch, seq) of token ids, or a dict with `input_ids` "
            f"(and optionally `attention_mask`); got {type(input_ids).__name__}."
        )
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
        attention_mask = None if attention_mask is None else attention_mask.reshape(1, -1)
    if input_ids.dim() != 2:
        raise ValueError(f"Calibration input_ids have shape {tuple(input_ids.shape)}; expected (batch, seq).")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; input_ids have {tuple(input_ids.shape)}."
        )
    return input_ids.long(), attention_mask


@torch.no_grad()
def model_features(
    model, codec: RotaryCodec, input_ids, attention_mask, position_ids, stride: int, parts: Sequence[str] = PARTS
) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """Run `model` once on a batch; return its per-layer content-space keys and values at every `stride`-th
    position, `(batch, n_kv, ceil(seq / stride), head_dim)` on each layer's device (`None` for a part not in
    `parts`). Keys are RoPE-stripped with `codec` (the model's `RotaryCodec`) at `position_ids`."""
    device = input_device(model)
    kwargs = {"use_cache": True}
    if attention_mask is not None:
        kwargs.update(attention_mask=attention_mask.to(device), position_ids=position_ids.to(device))
    cache = output_cache(model(input_ids.to(device), **kwargs))
    keys, values = None, None
    if "key" in parts:
        table = codec.table(position_ids[:, ::stride])
        keys = [table.strip(layer.keys[:, :, ::stride]) for layer in cache.layers]
    if "value" in parts:
        values = [layer.values[:, :, ::stride] for layer in cache.layers]
    return keys, values


class _Clock:
    """`time.perf_counter`, after synchronizing the CUDA devices involved (so per-stage timings are honest)."""

    def __init__(self, devices):
        self.cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)

    def __call__(self) -> float:
        for device in self.cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()


@dataclass
class BatchFeatures:
    """One calibration batch through both models (see [`batch_features`]).

    Attributes:
        input_ids (`torch.Tensor`): `(batch, seq)`.
        attention_mask (`torch.Tensor`, *optional*): `(batch, seq)`, `None` for unpadded batches.
        position_ids (`torch.Tensor`): `(batch, seq)`, as `generate` derives them from the mask.
        source, target (`tuple`): `(keys, values)` per-layer lists as [`model_features`] returns them.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    source: tuple
    target: tuple


def batch_features(
    source_model,
    target_model,
    calibration: Iterable,
    *,
    stride: int,
    parts: Sequence[str] = PARTS,
    source_stride: int | None = None,
    timings: dict[str, float] | None = None,
    devices: Iterable[torch.device] = (),
    desc: str = "calibration",
    progress: bool = True,
    postfix=None,
) -> Iterator[BatchFeatures]:
    """Run each calibration batch once through each model and yield its content-space features.

    Args:
        stride (`int`): keep every `stride`-th position of the target (and of the source unless `source_stride`).
        parts (`tuple[str, ...]`): `"key"` and/or `"value"`.
        source_stride (`int`, *optional*): the source's stride (1 for a context window, which reaches between the
            kept positions).
        timings (`dict`, *optional*): seconds are added to `"source_forward"`, `"target_forward"` and
            `"accumulate"` (the time the consumer spends on each batch).
        devices (*optional*): further devices to synchronize before reading the clock.
        desc, progress: the tqdm bar; `postfix` (a callable returning a dict) is shown after each batch.
    """
    from tqdm.auto import tqdm

    source_codec, target_codec = RotaryCodec(source_model.config), RotaryCodec(target_model.config)
    total = len(calibration) if hasattr(calibration, "__len__") else None
    bar = tqdm(calibration, total=total, desc=desc, unit="batch", disable=not progress)
    clock = _Clock({input_device(source_model), input_device(target_model), *devices})
    timings = {} if timings is None else timings
    for batch in bar:
        input_ids, attention_mask = unpack_batch(batch)
        size, length = input_ids.shape
        position_ids = positions_from_attention_mask(attention_mask, size, length, input_ids.device)
        start = clock()
        source = model_features(
            source_model, source_codec, input_ids, attention_mask, position_ids, source_stride or stride, parts
        )
        middle = clock()
        target = model_features(target_model, target_codec, input_ids, attention_mask, position_ids, stride, parts)
        end = clock()
        yield BatchFeatures(input_ids, attention_mask, position_ids, source, target)
        timings["source_forward"] = timings.get("source_forward", 0.0) + middle - start
        timings["target_forward"] = timings.get("target_forward", 0.0) + end - middle
        timings["accumulate"] = timings.get("accumulate", 0.0) + clock() - end
        if postfix is not None:
            bar.set_postfix(postfix(), refresh=False)


def feature_matrix(tensors, layers: Sequence[int], num_layers: int, width: int, what: str) -> torch.Tensor:
    """`(N, len(layers) * layer_width)` features of `layers` (rows in `(batch, seq)` order, flattened as
    `layer * n_kv * head_dim + head * head_dim + dim`) from per-layer `(B, n_kv, T, d)` tensors of all `num_layers`
    layers, or a 2-D matrix already in that layout; in the dtype and on the device of the first tensor."""
    if isinstance(tensors, torch.Tensor) and tensors.dim() == 2:
        if tensors.shape[1] != width:
            raise ValueError(f"{what} features have width {tensors.shape[1]}; expected {width}.")
        return tensors
    tensors = list(tensors)
    if len(tensors) != num_layers:
        raise ValueError(f"{what} come as {len(tensors)} per-layer tensors; the model has {num_layers} layers.")
    chosen = [tensors[layer] for layer in layers]
    first = chosen[0]
    rows = first.shape[0] * first.shape[2]
    out = torch.empty(rows, width, dtype=first.dtype, device=first.device)
    layer_width = width // len(layers)
    for slot, tensor in enumerate(chosen):
        if tensor.dim() != 4 or tensor.shape[1] * tensor.shape[3] != layer_width:
            raise ValueError(
                f"{what} layer {layers[slot]} has shape {tuple(tensor.shape)}; expected (batch, n_kv, seq, "
                f"head_dim) with n_kv * head_dim = {layer_width}."
            )
        if tensor.shape[0] * tensor.shape[2] != rows:
            raise ValueError(
                f"{what} layer {layers[slot]} covers {tuple(tensor.shape)}; layer 0 covers {tuple(first.shape)}."
            )
        flat = tensor.transpose(1, 2).reshape(rows, layer_width)
        out[:, slot * layer_width : (slot + 1) * layer_width] = flat.to(out.device)
    return out


# ------------------------------------------------------------------------------------------------ features kept in memory
@dataclass
class CalibrationFeatures:
    r"""
    Content-space features of a calibration set kept in memory, as [`gather_features`] returns them.

    Attributes:
        source (`dict[str, torch.Tensor]`): part (`"key"`/`"value"`) -> `(N, (1 + context_window) *
            len(source_layers) * n_kv_s * d_s)` float32: for position `t`, then `t - 1`, ... (see
            [`window_features`]), the source layers in `source_layers` order, each flattened over `(kv_head, dim)`
            (keys RoPE-stripped).
        target (`dict[str, torch.Tensor]`): part -> `(N, L_t * n_kv_t * d_t)` float32, every target layer.
        source_layers (`list[int]`): the source layers held, in column order.
        groups (`torch.Tensor`): `(N,)` int64, the calibration sequence each position comes from.
        source_width, target_width (`int`): `n_kv * head_dim` of one layer of each side.
        provenance (`dict`): tokens, sequences, positions, stride and bytes held.
        context_window (`int`): earlier positions held beside each position (0: none).
    """

    source: dict[str, torch.Tensor]
    target: dict[str, torch.Tensor]
    source_layers: list[int]
    groups: torch.Tensor
    source_width: int
    target_width: int
    provenance: dict[str, Any]
    context_window: int = 0

    @property
    def num_positions(self) -> int:
        return int(self.groups.shape[0])

    def inputs(
        self,
        part: str,
        layers: Sequence[int],
        rows: torch.Tensor | None = None,
        input_kinds: str = FitOptions.input_kinds,
        context_window: int | None = None,
    ) -> torch.Tensor:
        """The inputs of a `part` (`"key"`/`"value"`) map reading source `layers` (in that order), laid out as
        [`mapper_inputs`] lays them out: for each position `t, t - 1, ..., t - context_window` (default: all held),
        the layers' features of `part`, or of keys then values with `input_kinds="both"`."""
        missing = [layer for layer in layers if layer not in self.source_layers]
        if missing:
            raise ValueError(f"Source layers {missing} were not gathered (held: {self.source_layers}).")
        window = self.context_window if context_window is None else context_window
        if window > self.context_window:
            raise ValueError(
                f"context_window={window}, but the features hold {self.context_window} earlier positions."
            )
        parts = PARTS if input_kinds == "both" else (part,)
        missing = [name for name in parts if name not in self.source]
        if missing:
            raise ValueError(f"The {missing} features were not gathered (held: {list(self.source)}).")
        width, held = self.source_width, len(self.source_layers)
        data = {name: self.source[name] if rows is None else self.source[name][rows] for name in parts}
        pieces = []
        for shift in range(window + 1):
            cols = torch.cat(
                [
                    torch.arange(start, start + width)
                    for start in ((shift * held + self.source_layers.index(layer)) * width for layer in layers)
                ]
            )
            for name in parts:
                pieces.append(data[name].index_select(1, cols.to(data[name].device)))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def outputs(self, part: str, layer: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`(N, target_width)` content-space targets of target `layer` for `part`."""
        data = self.target[part] if rows is None else self.target[part][rows]
        return data[:, layer * self.target_width : (layer + 1) * self.target_width]


def feature_bytes_per_position(
    source_config, target_config, num_source_layers: int, parts: Sequence[str] = PARTS, context_window: int = 0
) -> int:
    """Bytes per calibration position that [`gather_features`] keeps: float32 source features of
    `num_source_layers` layers (at `1 + context_window` positions) and of every target layer, per part."""
    source, target = KVGeometry.from_config(source_config), KVGeometry.from_config(target_config)
    source_width = (1 + context_window) * num_source_layers * source.layer_width
    return 4 * len(parts) * (source_width + target.num_layers * target.layer_width)


def _count_positions(batches: Sequence, stride: int) -> int:
    total = 0
    for batch in batches:
        input_ids, attention_mask = unpack_batch(batch)
        if attention_mask is None:
            total += input_ids.shape[0] * len(range(0, input_ids.shape[1], stride))
        else:
            total += int(attention_mask[:, ::stride].bool().sum())
    return total


@torch.no_grad()
def gather_features(
    source_model,
    target_model,
    calibration: Iterable,
    *,
    source_layers: Sequence[int] | None = None,
    stride: int = 1,
    parts: Sequence[str] = PARTS,
    context_window: int = 0,
    device: torch.device | str = "cpu",
    max_memory_bytes: int | None = FitOptions.max_memory_bytes,
    progress: bool = True,
) -> CalibrationFeatures:
    r"""
    One streaming pass of `calibration` through both models, keeping the content-space features in memory.

    The features are exactly those `CalibrationStatistics` accumulates ([`batch_features`]: keys RoPE-stripped with
    each model's rotary embedding, every `stride`-th position, padded positions dropped), stored as float32
    matrices.
    Memory: `feature_bytes_per_position(...) * positions` =
    `4 * len(parts) * (len(source_layers) * n_kv_s * d_s + L_t * n_kv_t * d_t)` bytes per kept position; the pass is
    refused with `MemoryError` *before any forward* when that exceeds `max_memory_bytes`.

    Args:
        source_model, target_model (`PreTrainedModel`): the pair.
        calibration (iterable): `(batch, seq)` LongTensors of token ids or dicts with `input_ids`/`attention_mask`
            (materialized into a list: the positions are counted before the pass).
        source_layers (`list[int]`, *optional*): the source layers to keep (all when `None`), in column order.
        stride (`int`, *optional*, defaults to 1): keep every `stride`-th position.
        parts (`tuple[str, ...]`, *optional*, defaults to `("key", "value")`).
        context_window (`int`, *optional*, defaults to 0): also keep, beside each kept position, the source features
            of the `context_window` positions before it (computed before striding, zeros before the first token),
            as a mapper with that `context_window` reads them.
        device (*optional*, defaults to `"cpu"`): where the features live.
        max_memory_bytes (`int`, *optional*, defaults to 16 GiB): refuse larger feature sets; `None`: no bound.
        progress (`bool`, *optional*, defaults to `True`): tqdm progress bar.
    """
    check_int("stride", stride, 1)
    check_int("context_window", context_window, 0)
    parts = tuple(part for part in PARTS if part in tuple(parts))
    if not parts:
        raise ValueError("parts must include 'key' and/or 'value'.")
    source_geometry = KVGeometry.from_config(source_model.config)
    target_geometry = KVGeometry.from_config(target_model.config)
    if source_layers is None:
        source_layers = list(range(source_geometry.num_layers))
    source_layers = [int(layer) for layer in source_layers]
    bad = [layer for layer in source_layers if not 0 <= layer < source_geometry.num_layers]
    if bad or not source_layers or len(set(source_layers)) != len(source_layers):
        raise ValueError(
            f"source_layers={source_layers} must be distinct layers of the source "
            f"({source_geometry.num_layers} layers)."
        )
    batches = list(calibration)
    positions = _count_positions(batches, stride)
    per_position = feature_bytes_per_position(
        source_model.config, target_model.config, len(source_layers), parts, context_window
    )
    needed = per_position * positions
    if max_memory_bytes is not None and needed > max_memory_bytes:
        raise MemoryError(
            f"Keeping the calibration features for MLP training needs {needed / 2**30:.2f} GiB ({positions} positions "
            f"x {per_position} bytes: float32 K/V of {len(source_layers)} source layers and all "
            f"{target_geometry.num_layers} target layers), over max_memory_bytes={max_memory_bytes / 2**30:.2f} GiB. "
            "Use a larger stride, fewer calibration sequences, a smaller top_k, or raise max_memory_bytes."
        )
    if positions == 0:
        raise ValueError("The calibration holds no positions to train on.")
    logger.info(
        f"Gathering {positions} positions x {per_position} bytes = {needed / 2**20:.1f} MiB of float32 features "
        f"({len(source_layers)} source layers, {target_geometry.num_layers} target layers, parts {parts})."
    )
    device = torch.device(device)
    src_width, tgt_width = source_geometry.layer_width, target_geometry.layer_width
    source_columns = (1 + context_window) * len(source_layers) * src_width
    source = {part: torch.empty(positions, source_columns, device=device) for part in parts}
    target = {part: torch.empty(positions, target_geometry.num_layers * tgt_width, device=device) for part in parts}
    groups = torch.empty(positions, dtype=torch.int64, device=device)

    def flatten(tensors, layers, width):
        # (B, n_kv, T, d) per layer -> (B * T, len(layers) * width), rows in (batch, seq) order
        return torch.cat([tensors[layer].transpose(1, 2).reshape(-1, width).float() for layer in layers], dim=1)

    row, sequence, tokens = 0, 0, 0
    passes = batch_features(
        source_model,
        target_model,
        batches,
        stride=stride,
        parts=parts,
        source_stride=1 if context_window else stride,  # a context window reaches between the kept positions
        desc="gathering features",
        progress=progress,
    )
    for batch_index, features in enumerate(passes):
        input_ids, attention_mask, position_ids = features.input_ids, features.attention_mask, features.position_ids
        size, length = input_ids.shape
        kept = len(range(0, length, stride))
        if attention_mask is None:
            keep = torch.ones(size * kept, dtype=torch.bool)
        else:
            keep = attention_mask[:, ::stride].bool().reshape(-1).cpu()
        n = int(keep.sum())
        keep = keep.to(device)
        batch_groups = (sequence + torch.arange(size).repeat_interleave(kept)).to(device)
        groups[row : row + n] = batch_groups[keep]
        for index, part in enumerate(PARTS):
            if part not in parts:
                continue
            if context_window:
                src = torch.cat(
                    [features.source[index][layer].transpose(1, 2).float() for layer in source_layers], dim=2
                )
                src = window_features(src.reshape(size, length, -1), context_window, position_ids)
                src = src[:, ::stride].reshape(size * kept, -1).to(device)
            else:
                src = flatten(features.source[index], source_layers, src_width).to(device)
            tgt = flatten(features.target[index], range(target_geometry.num_layers), tgt_width).to(device)
            for side, values in (("source", src), ("target", tgt)):
                if not bool(torch.isfinite(values[keep]).all()):
                    raise ValueError(
                        f"The {side} {part}s of calibration batch {batch_index} contain NaN or inf; "
                        "refusing to train on them. Check the model's dtype (fp16 overflow?) and the batch."
                    )
            source[part][row : row + n] = src[keep]
            target[part][row : row + n] = tgt[keep]
        row += n
        sequence += size
        tokens += int(input_ids.numel() if attention_mask is None else attention_mask.sum())
    provenance = {
        "tokens": tokens,
        "sequences": sequence,
        "positions": positions,
        "stride": stride,
        "feature_bytes": needed,
    }
    return CalibrationFeatures(
        source, target, source_layers, groups, src_width, tgt_width, provenance, context_window=context_window
    )
