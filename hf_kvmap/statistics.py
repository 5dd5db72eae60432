"""Sufficient statistics for closed-form KV-cache mappers, collected in one streaming pass over calibration text.

For every part (`"key"`, `"value"`) a `CalibrationStatistics` holds, over all calibration positions kept:

- `count`: the number of positions `N`;
- `source_sum` `(F_s,)` and the Gram `X^T X` `(F_s, F_s)` of the features of *all* source layers and KV heads;
- `target_sum` `(F_t,)`, the per-dim sums of squares `target_sumsq` `(F_t,)` and the cross moments `X^T Y`
  `(F_s, F_t)` of the target features (of every target layer, or of `target_layers` only).

Features are content-space keys (RoPE removed with each model's own rotary embedding) or values, flattened as
`feature = layer * n_kv * head_dim + head * head_dim + dim`. Because the Gram and cross moments cover every source
layer, source-layer selection and the ridge solve for any `k` are sub-block solves of the same object
(see `hf_kvmap.selection`, `hf_kvmap.fitting`). Statistics from several processes or machines are sums: `merge` and
`all_reduce` add them (`hf_kvmap.statistics_merge`); `save` and `load` write and read them (`hf_kvmap.statistics_files`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.utils import logging

from ._compat import model_id, model_revision
from .configuration_mapper import summarize_model_config
from .features import PARTS, batch_features, feature_matrix, input_device
from .geometry import KVGeometry
from .moments import NUM_LIMBS, PartStatistics, dtype_name, fingerprint_hex, limbs, sequence_digest
from .reporting import joined_settings, kernel_settings
from .statistics_files import FORMAT_VERSION, METADATA_FILE, STATISTICS_FILE, SavedStatistics
from .statistics_merge import MergeableStatistics
from .validation import check_int

logger = logging.get_logger(__name__)


_SHARED = ("tokens", "sequences", "fingerprint_limbs")


def _model_id(model_or_config) -> tuple[str | None, str | None]:
    config = getattr(model_or_config, "config", model_or_config)
    return model_id(config), model_revision(config)


def _normalize_target_layers(target_layers, num_layers: int) -> list[int] | None:
    if target_layers is None:
        return None
    layers = sorted({int(layer) for layer in target_layers})
    if not layers:
        raise ValueError("target_layers is empty; pass None for all target layers.")
    bad = [layer for layer in layers if not 0 <= layer < num_layers]
    if bad:
        raise ValueError(f"target_layers names layers {bad}, but the target has {num_layers} layers.")
    return None if layers == list(range(num_layers)) else layers


class CalibrationStatistics(MergeableStatistics, SavedStatistics):
    r"""
    Streaming sufficient statistics between every source layer and every (or selected) target layer.

    Build it with [`CalibrationStatistics.collect`] (one pass of the calibration batches through both models), or
    construct it empty and feed [`update`] directly. One object supports source-layer selection and the ridge solve
    for any `k` (`hf_kvmap.fitting`).

    Args:
        source_config (`PretrainedConfig` or `dict`): the source model config (or its `summarize_model_config`).
        target_config (`PretrainedConfig` or `dict`): the same for the target model.
        parts (`tuple[str, ...]`, *optional*, defaults to `("key", "value")`): which caches to accumulate.
        target_layers (`list[int]`, *optional*): restrict the target side to these layers (all when `None`). The
            cross moments shrink accordingly; a mapper can then only be solved for those layers.
        stride (`int`, *optional*, defaults to 1): keep every `stride`-th position of each sequence.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float64`): accumulation dtype (float64 or float32).
        device (`torch.device` or `str`, *optional*, defaults to `"cpu"`): where the sums live.
        source_model_id, source_revision, target_model_id, target_revision (`str`, *optional*): provenance.
        tokenizer_fingerprint (`str`, *optional*): hash of the shared tokenizer's vocabulary
            (`hf_kvmap.artifacts.tokenizer_fingerprint`), passed on to the mapper config.
        allocate (`bool`, *optional*, defaults to `True`): allocate zero sums; `False` leaves `stats` empty for a
            caller that fills it with its own `PartStatistics` per part (as [`load`] does).

    Example:

    ```python
    >>> import torch
    >>> from transformers import Qwen3Config, Qwen3ForCausalLM
    >>> from hf_kvmap.statistics import CalibrationStatistics
    >>> config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    >>> model = Qwen3ForCausalLM(config)
    >>> stats = CalibrationStatistics.collect(model, model, [torch.randint(0, 64, (2, 16))], stride=2, progress=False)
    >>> stats.count("key"), tuple(stats["key"].gram.shape)
    (16, (32, 32))
    ```
    """

    def __init__(
        self,
        source_config: PretrainedConfig | dict,
        target_config: PretrainedConfig | dict,
        *,
        parts: Sequence[str] = PARTS,
        target_layers: Sequence[int] | None = None,
        stride: int = 1,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
        source_model_id: str | None = None,
        source_revision: str | None = None,
        target_model_id: str | None = None,
        target_revision: str | None = None,
        tokenizer_fingerprint: str | None = None,
        kernel_settings: str | None = None,
        allocate: bool = True,
    ):
        self.source_summary = summarize_model_config(source_config)
        self.target_summary = summarize_model_config(target_config)
        self.source_geometry = KVGeometry.from_config(self.source_summary)
        self.target_geometry = KVGeometry.from_config(self.target_summary)
        parts = tuple(parts)
        if not parts or any(part not in PARTS for part in parts) or len(set(parts)) != len(parts):
            raise ValueError(f"parts={parts!r}: expected a non-empty subset of {PARTS} without repeats.")
        self.parts = tuple(part for part in PARTS if part in parts)
        self.target_layers = _normalize_target_layers(target_layers, self.target_geometry.num_layers)
        check_int("stride", stride, 1)
        self.stride = stride
        dtype_name(dtype)
        self.dtype = dtype
        self.device = torch.device(device)
        self.source_model_id = source_model_id
        self.source_revision = source_revision
        self.target_model_id = target_model_id
        self.target_revision = target_revision
        self.tokenizer_fingerprint = tokenizer_fingerprint
        # the float kernels the sums were gathered with (`hf_kvmap.reporting.kernel_settings`): None while unknown
        self.kernel_settings = kernel_settings
        self.stats: dict[str, PartStatistics] = {}
        # Wall-clock seconds spent by `accumulate` (not saved, not merged): forwards, feature extraction + sums.
        self.timings = {"source_forward": 0.0, "target_forward": 0.0, "accumulate": 0.0}
        self.tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        self.sequences = torch.zeros((), dtype=torch.int64, device=self.device)
        self.fingerprint_limbs = torch.zeros(NUM_LIMBS, dtype=torch.int64, device=self.device)
        if allocate:
            for part in self.parts:
                self.stats[part] = PartStatistics.zeros(self.source_width, self.target_width, dtype, self.device)

    # ------------------------------------------------------------------------------------------------ geometry
    @property
    def covered_target_layers(self) -> list[int]:
        """The target layers whose statistics this object holds (all of them unless `target_layers` was given)."""
        if self.target_layers is None:
            return list(range(self.target_geometry.num_layers))
        return list(self.target_layers)

    @property
    def source_width(self) -> int:
        return self.source_geometry.num_layers * self.source_geometry.layer_width

    @property
    def target_width(self) -> int:
        return len(self.covered_target_layers) * self.target_geometry.layer_width

    def source_columns(self, layers: Sequence[int]) -> torch.Tensor:
        """Feature indices (into `F_s`) of source `layers`, concatenated in the given order."""
        width = self.source_geometry.layer_width
        return torch.cat([torch.arange(layer * width, (layer + 1) * width) for layer in layers])

    def target_columns(self, layer: int) -> slice:
        """The slice of the target features (into `F_t`) that holds target `layer`."""
        covered = self.covered_target_layers
        if layer not in covered:
            raise ValueError(
                f"Target layer {layer} is not in these statistics: they were collected with target_layers={covered}."
            )
        width = self.target_geometry.layer_width
        start = covered.index(layer) * width
        return slice(start, start + width)

    def __getitem__(self, part: str) -> PartStatistics:
        if part not in self.stats:
            raise KeyError(f"These statistics hold parts {self.parts}, not {part!r}.")
        return self.stats[part]

    def count(self, part: str | None = None) -> int:
        """Number of positions accumulated (for `part`, or the first part)."""
        return int(self[part or self.parts[0]].count)

    @property
    def fingerprint(self) -> str:
        """sha256-based fingerprint of the calibration token ids (order independent, additive over sequences)."""
        return fingerprint_hex(self.fingerprint_limbs)

    def provenance(self) -> dict[str, Any]:
        """Calibration provenance, as `MapperConfig.calibration` records it."""
        return {
            "tokens": int(self.tokens),
            "sequences": int(self.sequences),
            "positions": self.count(),
            "stride": self.stride,
            "fingerprint": self.fingerprint,
            "parts": list(self.parts),
            "target_layers": self.target_layers,
            "statistics_dtype": dtype_name(self.dtype),
            "kernel_settings": self.kernel_settings,
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the object by name (`"key.gram"`, ..., `"tokens"`, `"sequences"`, `"fingerprint_limbs"`)."""
        state = {f"{part}.{name}": t for part in self.parts for name, t in self.stats[part].tensors().items()}
        state.update(tokens=self.tokens, sequences=self.sequences, fingerprint_limbs=self.fingerprint_limbs)
        return state

    def nbytes(self) -> int:
        """Bytes held by the statistics tensors."""
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(source={self.source_geometry}, target={self.target_geometry}, parts={self.parts}, "
            f"target_layers={self.target_layers}, positions={self.count()}, stride={self.stride}, dtype={self.dtype})"
        )

    def centered(self, part: str, rows: torch.Tensor | slice, cols: torch.Tensor | slice | None):
        """Float64 centered `(Sxx, Sxy, mean_x, mean_y, ss_tot)` of `part` on the source sub-block `rows` x target
        `cols` (`Sxy` and `ss_tot` are `None` without `cols`): `Xc^T Xc = G - s_x s_x^T / N`, `Xc^T Yc = C - s_x s_y^T /
        N`, `SS_tot = sum(y^2) - s_y^2 / N`."""
        s = self[part]
        n = float(s.count)
        if n < 2:
            raise ValueError(f"The {part} statistics hold {int(n)} positions; at least 2 are needed to fit anything.")
        sx = s.source_sum[rows].double()
        if isinstance(rows, torch.Tensor):  # gather the sub-block directly, without copying whole rows first
            gram = s.gram[rows[:, None], rows[None, :]].double()
        else:
            gram = s.gram[rows, rows].double()
        sxx = gram - torch.outer(sx, sx) / n
        if cols is None:
            return sxx, None, sx / n, None, None
        sy = s.target_sum[cols].double()
        sxy = s.cross[rows, cols].double() - torch.outer(sx, sy) / n
        ss_tot = s.target_sumsq[cols].double() - sy.square() / n
        return sxx, sxy, sx / n, sy / n, ss_tot

    # ------------------------------------------------------------------------------------------------ memory
    @classmethod
    def memory_estimate(
        cls,
        source_config: PretrainedConfig | dict,
        target_config: PretrainedConfig | dict,
        *,
        parts: Sequence[str] = PARTS,
        target_layers: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> dict[str, int]:
        """Bytes the statistics of this pair will hold, from the two configs alone (no model needed).

        Returns a dict with the bytes of each part, `"shared"` (provenance counters), `"total"`, the feature widths
        `"source_features"`/`"target_features"`, and `"per_position_features"`: the bytes per kept position of the
        per-batch feature buffers that `collect` adds on top while a batch is processed (per part, not summed).
        """
        source = KVGeometry.from_config(summarize_model_config(source_config))
        target = KVGeometry.from_config(summarize_model_config(target_config))
        layers = _normalize_target_layers(target_layers, target.num_layers)
        n_target = target.num_layers if layers is None else len(layers)
        f_s, f_t = source.num_layers * source.layer_width, n_target * target.layer_width
        item = torch.empty((), dtype=dtype).element_size()
        per_part = 8 + item * (f_s + 2 * f_t + f_s * f_s + f_s * f_t)
        parts = [part for part in PARTS if part in tuple(parts)]
        shared = 8 * (2 + NUM_LIMBS)
        estimate = {part: per_part for part in parts}
        estimate.update(
            shared=shared,
            total=per_part * len(parts) + shared,
            source_features=f_s,
            target_features=f_t,
            per_position_features=item * (f_s + f_t),
        )
        return estimate

    # ------------------------------------------------------------------------------------------------ accumulation
    @torch.no_grad()
    def update(
        self,
        source_keys=None,
        source_values=None,
        target_keys=None,
        target_values=None,
        *,
        keep: torch.Tensor | None = None,
    ) -> None:
        """Accumulate one batch of content-space features (the low-level entry that `collect` uses).

        Each argument is either a sequence with one `(batch, n_kv, seq, head_dim)` tensor per layer (keys already
        RoPE-stripped; positions already subsampled; all target layers, the restriction to `target_layers` is applied
        here), or a 2-D feature matrix `(N, F)` already flattened as `layer * n_kv * head_dim + head * head_dim + dim`
        (the target matrix restricted to `target_layers`). Arguments of a part that is not accumulated may be `None`.

        Args:
            keep (`torch.Tensor`, *optional*): boolean `(N,)` (rows in `(batch, seq)` order) selecting the positions
                to accumulate, e.g. to drop padding.
        """
        pairs = {"key": (source_keys, target_keys), "value": (source_values, target_values)}
        for part in self.parts:
            source, target = pairs[part]
            if source is None or target is None:
                raise ValueError(f"These statistics accumulate {part}s: pass both source and target {part}s.")
            num_source, num_target = self.source_geometry.num_layers, self.target_geometry.num_layers
            x = feature_matrix(source, range(num_source), num_source, self.source_width, f"Source {part}s")
            y = feature_matrix(target, self.covered_target_layers, num_target, self.target_width, f"Target {part}s")
            if x.shape[0] != y.shape[0]:
                raise ValueError(f"Source {part}s give {x.shape[0]} positions but target {part}s give {y.shape[0]}.")
            x, y = x.to(self.device, self.dtype), y.to(self.device, self.dtype)
            if keep is not None:
                keep_rows = keep.reshape(-1).to(self.device, torch.bool)
                x, y = x[keep_rows], y[keep_rows]
            self.stats[part].update(x, y)

    def _record_sequences(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        for row in range(input_ids.shape[0]):
            ids = input_ids[row] if attention_mask is None else input_ids[row][attention_mask[row].bool()]
            self.fingerprint_limbs += limbs(sequence_digest(ids)).to(self.device)
            self.tokens += int(ids.numel())
            self.sequences += 1

    def _check_model(self, model, side: str) -> None:
        expected = self.source_summary if side == "source" else self.target_summary
        got = summarize_model_config(model.config)
        if KVGeometry.from_config(got) != KVGeometry.from_config(expected) or got.get(
            "rope_parameters"
        ) != expected.get("rope_parameters"):
            raise ValueError(
                f"The {side} model ({KVGeometry.from_config(got)}, rope {got.get('rope_parameters')}) does not match "
                f"the {side} these statistics were started with ({KVGeometry.from_config(expected)}, "
                f"rope {expected.get('rope_parameters')})."
            )

    @torch.no_grad()
    def accumulate(
        self, source_model, target_model, calibration: Iterable, *, progress: bool = True
    ) -> CalibrationStatistics:
        """Run every calibration batch once through each model and add its features; returns `self`.

        Batches are `(batch, seq)` LongTensors of token ids, or dicts with `input_ids` and `attention_mask` (left or
        right padding: padded positions are skipped and positions follow the mask as `generate` derives them).
        """
        self._check_model(source_model, "source")
        self._check_model(target_model, "target")
        devices = (input_device(source_model), input_device(target_model), self.device)  # forwards and sums
        self._add_settings(joined_settings(*map(kernel_settings, devices)), int(self.tokens) > 0)
        for side, model in (("source", source_model), ("target", target_model)):
            if getattr(model, "training", False):
                logger.warning(
                    f"The {side} model is in training mode (dropout active); call `.eval()` before fitting."
                )
        for batch in batch_features(
            source_model,
            target_model,
            calibration,
            stride=self.stride,
            parts=self.parts,
            timings=self.timings,
            devices=(self.device,),
            progress=progress,
            postfix=lambda: {"positions": self.count()},
        ):
            keep = None if batch.attention_mask is None else batch.attention_mask[:, :: self.stride].bool()
            self.update(*batch.source, *batch.target, keep=keep)
            self._record_sequences(batch.input_ids, batch.attention_mask)
        return self

    @classmethod
    def collect(
        cls,
        source_model,
        target_model,
        calibration: Iterable,
        *,
        stride: int = 1,
        dtype: torch.dtype = torch.float64,
        parts: Sequence[str] = PARTS,
        target_layers: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        progress: bool = True,
        tokenizer_fingerprint: str | None = None,
    ) -> CalibrationStatistics:
        r"""
        Collect statistics in one pass of `calibration` through both models.

        Each batch runs once through each model (`model(ids, use_cache=True)` under `torch.no_grad`; the ids are
        moved to each model's input device), keys are RoPE-stripped with each model's rotary embedding, every
        `stride`-th position is kept, and the features are accumulated in `dtype` on `device`.

        Args:
            source_model, target_model (`PreTrainedModel`): causal LMs sharing a tokenizer.
            calibration (iterable): `(batch, seq)` LongTensors of token ids (or dicts with `input_ids` and
                `attention_mask`).
            stride (`int`, *optional*, defaults to 1): keep every `stride`-th position.
            dtype (`torch.dtype`, *optional*, defaults to `torch.float64`): accumulation dtype.
            parts (`tuple[str, ...]`, *optional*, defaults to `("key", "value")`).
            target_layers (`list[int]`, *optional*): restrict the target side (see `memory_estimate`).
            device (`torch.device`, *optional*): where the sums live; defaults to the source model's input device.
            progress (`bool`, *optional*, defaults to `True`): show a tqdm progress bar.
            tokenizer_fingerprint (`str`, *optional*): recorded with the statistics (see the class docstring).
        """
        source_id, source_revision = _model_id(source_model)
        target_id, target_revision = _model_id(target_model)
        stats = cls(
            source_model.config,
            target_model.config,
            parts=parts,
            target_layers=target_layers,
            stride=stride,
            dtype=dtype,
            device=device if device is not None else input_device(source_model),
            source_model_id=source_id,
            source_revision=source_revision,
            target_model_id=target_id,
            target_revision=target_revision,
            tokenizer_fingerprint=tokenizer_fingerprint,
        )
        return stats.accumulate(source_model, target_model, calibration, progress=progress)


__all__ = ["FORMAT_VERSION", "METADATA_FILE", "STATISTICS_FILE", "CalibrationStatistics"]
