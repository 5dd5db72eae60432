"""`MapperModel`: a fitted map from a source model's KV cache to a target model's, packaged as a `PreTrainedModel`.

The model computes: `MapperModel.forward` is the whole mapping (RoPE strip with the source's rotary embedding, the
input features of `hf_kvmap.layout.mapper_inputs`, one map per target layer and K/V, re-rope with the target's).
`MappedCache.from_source` validates a cache, calls it, and stores the result. What a map is depends on the mapper
kind, through one registry (`hf_kvmap.kinds`): an `nn.Linear` (`"ridge"`) or a `HeadwiseMLP` (`"mlp"`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import logging

from ._compat import mapper_load_kwargs
from .artifacts import (
    EVALUATION_FILE,
    content_hash,
    results_belong_to,
    results_hash,
    serving_hash,
    side_mismatches,
    tokenizer_mismatch,
    verify_artifact,
    write_folder_atomically,
)
from .configuration_mapper import MapperConfig, summarize_model_config
from .geometry import KVGeometry, check_supported_layout
from .key_norm import normalize_keys
from .kinds import KIND_REGISTRY
from .mapping import map_target_layer
from .modeling_mlp import HeadwiseMLP
from .placement import execution_devices
from .rope import RotaryCodec

#: reads of a local mapper folder before `from_pretrained` gives up on a folder that other saves keep replacing
LOAD_ATTEMPTS = 5
logger = logging.get_logger(__name__)


# ------------------------------------------------------------------------------------------------ kinds
#: The module of one map per mapper kind: `(config, in_features) -> nn.Module` taking `(..., in_features)` to
#: `(..., n_kv_target * head_dim_target)`; a view of `hf_kvmap.kinds.KIND_REGISTRY` (a new kind is one file there).
MAP_MODULES: dict[str, Callable[[MapperConfig, int], nn.Module]] = {
    name: kind.build_map for name, kind in KIND_REGISTRY.items()
}


# ------------------------------------------------------------------------------------------------ validation
def check_source_tensors(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], config: MapperConfig
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-layer `(keys, values)` of a source cache as a list, checked against the mapper config.

    Raises `ValueError` naming the mismatch (layer count, KV heads, head dim, sequence lengths, dtype).
    """
    geometry = config.source_geometry
    pairs = [tuple(pair) for pair in pairs]
    if len(pairs) != geometry.num_layers:
        raise ValueError(
            f"The source cache has {len(pairs)} layers but the mapper expects {geometry.num_layers} "
            f"(source model {config.source_model_id or config.source_summary.get('model_type')}). "
            "Pass the cache of the source model the mapper was fitted for."
        )
    expected = None
    for idx, pair in enumerate(pairs):
        if len(pair) != 2 or pair[0] is None or pair[1] is None:
            raise ValueError(f"Source cache layer {idx} is empty: prefill the source model before mapping its cache.")
        keys, values = pair
        for name, tensor, dim in (("keys", keys, geometry.head_dim), ("values", values, geometry.head_dim)):
            if tensor.dim() != 4:
                raise ValueError(
                    f"Source cache layer {idx} {name} have shape {tuple(tensor.shape)}; expected 4 dims "
                    "(batch, num_kv_heads, seq, head_dim)."
                )
            if tensor.shape[1] != geometry.num_kv_heads:
                raise ValueError(
                    f"Source cache layer {idx} {name} have {tensor.shape[1]} KV heads but the mapper expects "
                    f"{geometry.num_kv_heads}."
                )
            if tensor.shape[3] != dim:
                raise ValueError(
                    f"Source cache layer {idx} {name} have head_dim {tensor.shape[3]} but the mapper expects {dim}."
                )
            if not tensor.is_floating_point():
                raise ValueError(f"Source cache layer {idx} {name} have dtype {tensor.dtype}; expected a float dtype.")
        if keys.shape != values.shape:
            raise ValueError(
                f"Source cache layer {idx} keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape."
            )
        if expected is None:
            expected = keys.shape
        elif keys.shape[0] != expected[0] or keys.shape[2] != expected[2]:
            raise ValueError(
                f"Source cache layer {idx} has batch x seq {tuple(keys.shape[::2][:2])}, layer 0 has "
                f"{(expected[0], expected[2])}: all layers must cover the same tokens."
            )
    return pairs


def _check_finite(tensor: torch.Tensor, what: str) -> None:
    if tensor.device.type != "meta" and not torch.isfinite(tensor).all():
        bad = ~torch.isfinite(tensor)
        where = bad.nonzero()[0].tolist()
        value = tensor[tuple(where)].item()
        at = f" at row {where[0]}, head {where[1]}, position {where[2]}" if tensor.dim() == 4 else ""
        raise ValueError(
            f"{what} contains NaN or inf values ({value}{at}; {int(bad.sum())} in all); refusing to map a corrupted "
            "cache. Check the source model's weights and dtype (float16 overflows show as inf)."
        )


def check_finite_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`_check_finite` for every layer at once: one `aminmax` pass per tensor (NaN propagates, +-inf shows in the
    max/min) and a single host sync for the whole cache instead of one per tensor."""
    extremes, home = [], None
    for keys, values in pairs:
        for tensor in (keys, values):
            if tensor.device.type == "meta":
                continue
            home = tensor.device if home is None else home
            extremes.append(torch.stack(torch.aminmax(tensor)).float().to(home, non_blocking=True))
    if extremes and not torch.isfinite(torch.cat(extremes)).all():
        for idx, (keys, values) in enumerate(pairs):  # slow path, only to name the layer
            _check_finite(keys, f"Source cache layer {idx} keys")
            _check_finite(values, f"Source cache layer {idx} values")


# ------------------------------------------------------------------------------------------------ modules
class MapperLayer(nn.Module):
    """The maps that produce one target layer: keys and values, all target KV heads at once.

    `key_proj` takes the content-space keys of the selected source layers, concatenated in the order of
    `config.source_layers[layer_idx]`, each flattened over `(kv_head, head_dim)`; it returns the content-space keys
    of every target KV head, flattened the same way. `value_proj` does the same for values. (With
    `config.input_kinds="both"`, a `config.context_window` or its `config.layer_inputs` entry, a map reads the wider
    inputs of [`mapper_inputs`].) The module of each map is its kind's `build_map` (`hf_kvmap.kinds`). With `config.key_norm`
    the keys pass through the target's key norm (`hf_kvmap.key_norm`; its weight is the buffer `key_norm_weight`).
    """

    def __init__(self, config: MapperConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        build = KIND_REGISTRY[config.kind].build_map
        self.key_proj = build(config, config.input_width(layer_idx, "key"))
        self.value_proj = build(config, config.input_width(layer_idx, "value"))
        self.head_dim = config.target_geometry.head_dim
        self.key_norm_eps = config.key_norm_eps
        self.register_buffer("key_norm_weight", torch.ones(self.head_dim) if config.key_norm else None)

    def map_part(self, part: str, features: torch.Tensor) -> torch.Tensor:
        """The `"key"` (normalised with `key_norm`) or `"value"` map of `(..., in_features)` features."""
        if part == "value":
            return self.value_proj(features)
        keys = self.key_proj(features)
        if self.key_norm_weight is None:
            return keys
        return normalize_keys(keys, self.key_norm_weight, self.head_dim, self.key_norm_eps)

    def forward(self, key_features: torch.Tensor, value_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(..., in_features)` features -> `(..., n_kv_target * head_dim_target)` keys and values."""
        return self.map_part("key", key_features), self.map_part("value", value_features)


class MapperPreTrainedModel(PreTrainedModel):
    config_class = MapperConfig
    base_model_prefix = "mapper"
    main_input_name = "source_keys"
    _no_split_modules = ["MapperLayer"]
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, HeadwiseMLP):  # plain parameters that the generic init does not know
            module.reset_parameters()


class MapperModel(MapperPreTrainedModel):
    r"""
    Maps a source model's KV cache to the cache a target model expects, one target layer at a time.

    Use it through [`MappedCache.from_source`]; `forward` maps a whole cache given as per-layer tensors.

    Example:

    ```python
    >>> from transformers import Qwen3Config
    >>> from hf_kvmap import MapperModel
    >>> config = Qwen3Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    >>> mapper = MapperModel.identity(config)
    >>> [tuple(layer.key_proj.weight.shape) for layer in mapper.layers]
    [(16, 16), (16, 16)]
    ```
    """

    def __init__(self, config: MapperConfig):
        super().__init__(config)
        if config.source_summary is None or config.target_summary is None:
            raise ValueError("MapperConfig needs `source_summary` and `target_summary` to build a MapperModel.")
        check_supported_layout(config.source_summary)
        check_supported_layout(config.target_summary)
        self.layers = nn.ModuleList(MapperLayer(config, layer) for layer in range(len(config.source_layers)))
        self._codecs: dict[str, RotaryCodec] = {}
        self.post_init()

    def rotary(self, side: str) -> RotaryCodec:
        """The `RotaryCodec` of the `"source"` or `"target"` model, rebuilt from the recorded config."""
        if side not in self._codecs:
            summary = self.config.source_summary if side == "source" else self.config.target_summary
            self._codecs[side] = RotaryCodec(summary)
        return self._codecs[side]

    @classmethod
    def identity(
        cls,
        source_config: PretrainedConfig,
        target_config: PretrainedConfig | None = None,
        dtype: torch.dtype = torch.float32,
        **config_kwargs,
    ) -> MapperModel:
        """The exact content-space identity between two rope configurations of the same weights.

        Keys are un-rotated with the source's rotary embedding and re-rotated with the target's; values pass
        through. With `target_config=None` the map is a model onto itself (the cache comes back unchanged up to
        float rounding). Useful to move a cache between rope scalings of one model, and as the exactness baseline.

        Args:
            source_config (`PretrainedConfig`): config of the model that produced the cache.
            target_config (`PretrainedConfig`, *optional*): config of the model that reads it; must have the same
                layer count, KV heads and head dim.
            dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the mapper weights.
        """
        target_config = source_config if target_config is None else target_config
        source, target = summarize_model_config(source_config), summarize_model_config(target_config)
        source_geometry, target_geometry = KVGeometry.from_config(source), KVGeometry.from_config(target)
        if source_geometry != target_geometry:
            raise ValueError(
                f"An identity mapper needs the same KV geometry on both sides; source has {source_geometry}, "
                f"target has {target_geometry}."
            )
        config = MapperConfig(source_summary=source, target_summary=target, ridge_lambda=0.0, **config_kwargs)
        model = cls(config)
        # position t of the same part: the first block of the inputs, or the second (values) with input_kinds="both"
        with torch.no_grad():
            for idx, layer in enumerate(model.layers):
                value_offset = source_geometry.layer_width if config.part_inputs(idx, "value")[1] == "both" else 0
                for proj, offset in ((layer.key_proj, 0), (layer.value_proj, value_offset)):
                    proj.weight.zero_()
                    proj.weight[:, offset : offset + proj.out_features] = torch.eye(proj.out_features)
                    proj.bias.zero_()
        return model.to(dtype)

    # ------------------------------------------------------------------------------------------ mapping
    def forward(
        self,
        source_keys: Sequence[torch.Tensor],
        source_values: Sequence[torch.Tensor],
        position_ids: torch.Tensor | None = None,
        *,
        source_position_ids: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        devices: Sequence[torch.device | str] | None = None,
        layers: Sequence[int] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        r"""
        Map per-layer source keys/values into the target's, built layer by layer (peak extra memory: one layer's
        features plus the RoPE-stripped keys and the values of the source layers still to be read).

        Per target layer (`hf_kvmap.mapping.map_target_layer`), the features of its selected source layers (keys
        stripped of the source's rope, each source layer once per device) are laid out by [`mapper_inputs`],
        multiplied by the layer's key and value maps at once for all target heads (an affine map of plain inputs
        outside autograd accumulates one product per source layer instead of building the feature tensor), and the
        keys re-rotated with the target's rope, written straight into contiguous cache tensors. With gradients
        enabled (not in `MappedCache.from_source`) it is differentiable in the mapper's parameters:
        `hf_kvmap.objectives` trains through it.

        Args:
            source_keys, source_values (sequence of `torch.Tensor`): one `(batch, n_kv_src, seq, head_dim_src)`
                tensor per source layer (keys as the source caches them, i.e. rotated).
            position_ids (`torch.Tensor`, *optional*): `(batch, seq)` positions the target reads the tokens at (its
                rope, and where a context window finds each row's first token); default `arange(seq)`.
            source_position_ids (`torch.Tensor`, *optional*): `(batch, seq)` positions the source built the keys at
                (its rope); default `position_ids`.
            dtype (`torch.dtype`, *optional*): dtype of the mapped tensors; defaults to the source's.
            devices (sequence of devices, *optional*): where each target layer's tensors go; defaults to the device
                of the mapper layer that produces it.
            layers (sequence of `int`, *optional*): map only these target layers (in this order; e.g. one at a time,
                so that a training objective keeps one layer's graph at a time); default every layer.

        Returns:
            One `(keys, values)` pair per target layer (per entry of `layers`), `(batch, n_kv_tgt, seq,
            head_dim_tgt)`.
        """
        config = self.config
        source_kv = check_source_tensors(list(zip(source_keys, source_values)), config)
        batch, _, length, _ = source_kv[0][0].shape
        if position_ids is None:
            position_ids = torch.arange(length, device=source_kv[0][0].device).expand(batch, length)
        num_target = len(config.source_layers)
        if devices is not None and len(devices) != num_target:
            raise ValueError(f"devices has {len(devices)} entries; the target has {num_target} layers.")
        dtype = dtype or source_kv[0][0].dtype
        source_rope = self.rotary("source").table(position_ids if source_position_ids is None else source_position_ids)
        target_rope = self.rotary("target").table(position_ids)
        work_devices = execution_devices(self, self.layers)
        order = list(range(num_target)) if layers is None else [int(layer) for layer in layers]
        if any(not 0 <= layer < num_target for layer in order):
            raise ValueError(f"layers={list(layers)} names a layer outside the target's {num_target} layers.")
        # strip each source layer once per device; drop it after the last target layer that reads it there
        last_use = {}
        for idx in order:
            for source_layer in config.source_layers[idx]:
                last_use[(source_layer, work_devices[idx])] = idx
        content: dict = {}
        mapped = []
        for idx in order:
            keys, values = map_target_layer(
                config,
                idx,
                self.layers[idx],
                source_kv,
                source_rope,
                target_rope,
                length,
                dtype,
                work_devices[idx],
                content,
                position_ids if config.max_context_window else None,
            )
            device = work_devices[idx] if devices is None else torch.device(devices[idx])
            mapped.append((keys.to(device), values.to(device)))
            for key in [key for key, last in last_use.items() if last == idx]:
                content.pop(key, None)
        return mapped

    # ------------------------------------------------------------------------------------------ fitted weights
    @classmethod
    def from_fitted(cls, fitted) -> MapperModel:
        """Package a [`~hf_kvmap.fitting.FittedMapper`] (config and solved or trained weights) as a model, in the
        dtype it was fitted for. A mapper fitted with a fine-tuning objective (`"kl"`, `"attention"`, ...) is
        fine-tuned with both models first: package it with `hf_kvmap.fitting.mapper_from_fitted` (or fit it with
        `hf_kvmap.fit_mapper`)."""
        if fitted.options is not None and fitted.options.objective_stages:
            raise ValueError(
                f"This mapper was fitted with objective={fitted.options.objective!r}, which fine-tunes it with both "
                "models: package it with `hf_kvmap.fitting.mapper_from_fitted(fitted, source_model=..., "
                "target_model=..., calibration=...)`."
            )
        with torch.device("meta"):  # every weight is copied in below; skip the random init
            model = cls(fitted.config)
        model = model.to_empty(device="cpu").to(fitted.dtype)
        with torch.no_grad():
            model.load_state_dict({name: t.to("cpu", fitted.dtype) for name, t in fitted.state_dict.items()})
        return model.eval()

    # ------------------------------------------------------------------------------------------ artifacts

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *args,
        evaluation: dict | None = None,
        repo_id: str | None = None,
        overwrite: bool = False,
        **kwargs,
    ):
        """`PreTrainedModel.save_pretrained` (safetensors, sharded by `max_shard_size`), plus the content hash in the
        config and a model card (`README.md`, see `write_card`).

        The folder is written beside `save_directory` and swapped in at the end, so a crash never destroys the mapper
        that was there; a folder holding other files is refused unless `overwrite=True` (which replaces it whole).

        Args:
            evaluation (`dict`, *optional*): results JSON of `hf-kvmap eval`/`demo`; saved as `evaluation.json` and
                rendered into the card (refused if it records another artifact's content hash). Without it, an
                `evaluation.json` already in the folder is kept only if it records this artifact's hash.
            repo_id (`str`, *optional*): the Hub id the card names (defaults to the folder name).
            overwrite (`bool`, *optional*, defaults to `False`): replace a folder that holds files not of a mapper.
        """
        if kwargs.get("safe_serialization") is False:
            raise ValueError("hf-kvmap saves safetensors only; drop `safe_serialization=False`.")
        if not kwargs.get("is_main_process", True):
            return  # the main process writes the whole folder
        self.config.content_hash = content_hash(self.state_dict(), self.config)
        self.config.serving_hash = serving_hash(self.config)
        destination = Path(save_directory)
        if evaluation is None and (destination / EVALUATION_FILE).exists():
            previous = json.loads((destination / EVALUATION_FILE).read_text())
            if results_belong_to(previous, self.config, self.state_dict()):
                evaluation = previous
            else:
                logger.warning(
                    f"{destination / EVALUATION_FILE} was not measured on this mapper (its recorded content hash "
                    f"is {results_hash(previous)}); it is not carried into the new folder or card."
                )

        def write(folder: Path) -> None:
            super(MapperModel, self).save_pretrained(folder, *args, **kwargs)
            self.write_card(folder, evaluation=evaluation, repo_id=repo_id, name=destination.resolve().name)

        write_folder_atomically(destination, write, overwrite=overwrite)

    def write_card(
        self,
        folder: str | os.PathLike,
        evaluation: dict | None = None,
        repo_id: str | None = None,
        *,
        name: str | None = None,
    ) -> Path:
        """(Re)render `folder/README.md` from the config and the evaluation results (`hf_kvmap.card.write_card`, which
        see); returns the card's path."""
        from .card import write_card  # the card is written at save time only; mapping never loads it

        return write_card(self, folder, evaluation, repo_id, name=name)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, verify: bool = True, **kwargs) -> MapperModel:
        """`PreTrainedModel.from_pretrained` (folder or Hub id, `dtype=`, `device_map=`), then verify the weights
        and the mapping fields of the config against the content hash recorded at save time
        (`hf_kvmap.artifacts.verify_artifact`; `verify=False` skips it). A tampered, edited, mixed or unhashed
        artifact raises `ValueError`, before any weight is loaded; so do a missing local folder, a folder without
        `config.json` and a config that does not validate, each by name.
        """
        from .atomic import folder_version
        from .input_checks import check_mapper_location

        name = pretrained_model_name_or_path
        folder = os.path.join(os.path.expanduser(str(name)), kwargs.get("subfolder") or "")
        local = os.path.isdir(os.path.expanduser(str(name)))
        location = ("revision", "cache_dir", "local_files_only", "token", "subfolder")
        location = {k: kwargs[k] for k in location if k in kwargs}
        for attempt in range(LOAD_ATTEMPTS):  # a save by another process may replace the folder while it is read
            check_mapper_location(name, kwargs.get("subfolder"))
            before = folder_version(folder) if local else None
            try:
                if verify:
                    config = cls.config_class.from_pretrained(name, **location)
                    verify_artifact(name, config, **location)
                model = super().from_pretrained(name, *args, **mapper_load_kwargs(dict(kwargs)))
            except (OSError, ValueError):
                if not local or folder_version(folder) == before or attempt == LOAD_ATTEMPTS - 1:
                    raise
                time.sleep(0.02 * 2**attempt)  # the folder changed under the read: read the version now there
                continue
            if not local or folder_version(folder) == before:
                return model
            time.sleep(0.02 * 2**attempt)
        raise ValueError(
            f"{name} was replaced by another save {LOAD_ATTEMPTS} times while it was read; load it again once the "
            "process saving there is done."
        )

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str = "Upload hf-kvmap mapper",
        private: bool | None = None,
        token: str | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        max_shard_size: str = "5GB",
        evaluation: dict | None = None,
    ):
        """Upload weights, config and the generated card together (the card is the one `save_pretrained` renders,
        not a generic one)."""
        import tempfile

        from huggingface_hub import HfApi

        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, max_shard_size=max_shard_size, evaluation=evaluation, repo_id=repo_id)
            return api.upload_folder(
                repo_id=repo_id,
                folder_path=folder,
                commit_message=commit_message,
                revision=revision,
                create_pr=create_pr,
            )

    def check_compatible(
        self,
        source_model=None,
        target_model=None,
        tokenizer=None,
        *,
        allow_mismatch: bool = False,
        same_weights: bool = False,
    ):
        """Compare the models (and tokenizer) in hand with the approval tuple recorded in the config.

        Checked: model type, KV geometry and rope parameters of each side; the recorded revision and id of each side
        when both the mapper and the model know them; the tokenizer fingerprint. A mismatch raises `ValueError`
        naming both values; `allow_mismatch=True` logs them instead (for experiments). `same_weights=True` says the
        models are the weights the mapper was fitted for, loaded from another location (a local copy, whose model id
        is its path): the ids are not compared, everything else is.
        """
        from .validation import check_bool

        check_bool("allow_mismatch", allow_mismatch)
        check_bool("same_weights", same_weights)
        problems = []
        for side, model in (("source", source_model), ("target", target_model)):
            if model is None:
                continue
            problems += side_mismatches(self.config, side, model.config, same_weights=same_weights)
        problems += tokenizer_mismatch(self.config, tokenizer)
        if problems:
            message = "The mapper does not match the models in hand:\n- " + "\n- ".join(problems)
            if not allow_mismatch:
                raise ValueError(message + "\nUse the mapper fitted for these models, or allow_mismatch=True.")
            logger.warning(message)
        return problems
