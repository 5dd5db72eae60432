"""`MapperModel`: a fitted map from a source model's KV cache to a target model's, packaged as a `PreTrainedModel`."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import logging

from ._compat import model_id, model_revision
from .configuration_mapper import MapperConfig, summarize_model_config
from .rope import KVGeometry, RotaryCodec, check_supported_layout

logger = logging.get_logger(__name__)

EVALUATION_FILE = "evaluation.json"


def window_features(
    features: torch.Tensor, context_window: int, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    r"""
    The features of each position followed by those of the `context_window` positions before it.

    Args:
        features (`torch.Tensor`): `(batch, seq, F)`.
        context_window (`int`): `w`, the number of earlier positions appended.
        position_ids (`torch.Tensor`, *optional*): `(batch, seq)` positions of the tokens. A shift `s` at a token
            whose position is below `s` reaches before the sequence's first token (left padding) and is zero.
            Without them the tokens are at `0 .. seq - 1`.

    Returns:
        `(batch, seq, (w + 1) * F)`: `[x_t, x_{t-1}, ..., x_{t-w}]`, zeros where `t - s` is not a token.
    """
    if context_window == 0:
        return features
    batch, length, width = features.shape
    out = features.new_zeros(batch, length, context_window + 1, width)
    out[:, :, 0] = features
    for shift in range(1, min(context_window, length - 1) + 1):
        out[:, shift:, shift] = features[:, :-shift]
    if position_ids is not None:
        shifts = torch.arange(1, context_window + 1, device=features.device)
        reaches_before = position_ids.to(features.device).unsqueeze(-1) < shifts  # (batch, seq, w)
        out[:, :, 1:].masked_fill_(reaches_before.unsqueeze(-1), 0)
    return out.view(batch, length, (context_window + 1) * width)


def mapper_inputs(
    config: MapperConfig,
    key_features: torch.Tensor,
    value_features: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""
    The inputs of one target layer's key and value maps, from the content-space features of its selected source
    layers. The one definition of the input layout, shared by fitting and by `MappedCache.from_source`.

    Args:
        config ([`MapperConfig`]): its `input_kinds` and `context_window` decide the layout.
        key_features, value_features (`torch.Tensor`): `(batch, seq, k * n_kv_src * head_dim_src)` RoPE-stripped
            source keys and source values of the selected layers (layer-major, then head, then dim).
        position_ids (`torch.Tensor`, *optional*): `(batch, seq)` token positions (see [`window_features`]).

    Returns:
        `(key_inputs, value_inputs)`, each `(batch, seq, config.input_width(layer))`, laid out as
        `[position t, t - 1, ..., t - w]`, each `[keys, values]` with `input_kinds="both"` (else its own kind).
    """
    window = config.context_window
    if config.input_kinds == "both":
        both = window_features(torch.cat([key_features, value_features], dim=-1), window, position_ids)
        return both, both
    return window_features(key_features, window, position_ids), window_features(value_features, window, position_ids)


def _build_map(config: MapperConfig, in_features: int) -> nn.Module:
    target = config.target_geometry
    if config.kind == "ridge":
        return nn.Linear(in_features, target.layer_width, bias=True)
    from .mlp import HeadwiseMLP

    return HeadwiseMLP(in_features, config.mlp_hidden_size, target.num_kv_heads, target.head_dim)


class MapperLayer(nn.Module):
    """The maps that produce one target layer: keys and values, all target KV heads at once.

    `key_proj` takes the content-space keys of the selected source layers, concatenated in the order of
    `config.source_layers[layer_idx]`, each flattened over `(kv_head, head_dim)`; it returns the content-space keys
    of every target KV head, flattened the same way. `value_proj` does the same for values. (With
    `config.input_kinds="both"` or a `config.context_window`, both read the wider inputs of [`mapper_inputs`].) For `kind="ridge"` each
    is one `nn.Linear`; for `kind="mlp"` a `HeadwiseMLP` (one MLP per target head, batched).
    """

    def __init__(self, config: MapperConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        in_features = config.input_width(layer_idx)
        self.key_proj = _build_map(config, in_features)
        self.value_proj = _build_map(config, in_features)

    def forward(self, key_features: torch.Tensor, value_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(..., in_features)` features -> `(..., n_kv_target * head_dim_target)` keys and values."""
        return self.key_proj(key_features), self.value_proj(value_features)


class MapperPreTrainedModel(PreTrainedModel):
    config_class = MapperConfig
    base_model_prefix = "mapper"
    main_input_name = "source_keys"
    _no_split_modules = ["MapperLayer"]
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
        super()._init_weights(module)
        if type(module).__name__ == "HeadwiseMLP":  # plain parameters that the generic init does not know
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
        if config.source_config is None or config.target_config is None:
            raise ValueError("MapperConfig needs `source_config` and `target_config` to build a MapperModel.")
        check_supported_layout(config.source_config)
        check_supported_layout(config.target_config)
        self.layers = nn.ModuleList(MapperLayer(config, layer) for layer in range(len(config.source_layers)))
        self._codecs: dict[str, RotaryCodec] = {}
        self.post_init()

    def rotary(self, side: str) -> RotaryCodec:
        """The `RotaryCodec` of the `"source"` or `"target"` model, rebuilt from the recorded config."""
        if side not in self._codecs:
            summary = self.config.source_config if side == "source" else self.config.target_config
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
        config = MapperConfig(source_config=source, target_config=target, ridge_lambda=0.0, **config_kwargs)
        model = cls(config)
        # position t of the same kind: the first block of the inputs, or the second (values) with input_kinds="both"
        value_offset = source_geometry.layer_width if config.input_kinds == "both" else 0
        with torch.no_grad():
            for layer in model.layers:
                for proj, offset in ((layer.key_proj, 0), (layer.value_proj, value_offset)):
                    proj.weight.zero_()
                    proj.weight[:, offset : offset + proj.out_features] = torch.eye(proj.out_features)
                    proj.bias.zero_()
        return model.to(dtype)

    @torch.no_grad()
    def forward(
        self,
        source_keys: Sequence[torch.Tensor],
        source_values: Sequence[torch.Tensor],
        position_ids: torch.Tensor | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Map per-layer source keys/values `(batch, n_kv_src, seq, head_dim_src)` to target ones.

        Returns one `(keys, values)` pair per target layer, `(batch, n_kv_tgt, seq, head_dim_tgt)`, on the device of
        the mapper layer that produced it. `position_ids` `(batch, seq)` default to `arange(seq)`.
        """
        from .cache import MappedCache, source_tensors

        source_kv = source_tensors(list(zip(source_keys, source_values)), self.config)
        batch, _, length, _ = source_kv[0][0].shape
        if position_ids is None:
            position_ids = torch.arange(length, device=source_kv[0][0].device).expand(batch, length)
        cache = MappedCache.map_tensors(source_kv, self, position_ids)
        return [(layer.keys, layer.values) for layer in cache.layers]

    @classmethod
    def from_statistics(
        cls, statistics, *, top_k: int | None = 8, ridge_lambda: float = 0.01, **kwargs
    ) -> MapperModel:
        """Closed-form ridge mapper from `CalibrationStatistics` (selection + solve); see `hf_kvmap.fitting`."""
        from .fitting import mapper_from_statistics

        return mapper_from_statistics(statistics, top_k=top_k, ridge_lambda=ridge_lambda, **kwargs)

    @classmethod
    def fit(
        cls, source_model, target_model, calibration, *, top_k: int | None = 8, ridge_lambda: float = 0.01, **kwargs
    ) -> MapperModel:
        """Collect calibration statistics in one pass through both models, then solve; see `hf_kvmap.fitting`."""
        from .fitting import fit_mapper

        return fit_mapper(source_model, target_model, calibration, top_k=top_k, ridge_lambda=ridge_lambda, **kwargs)

    # ------------------------------------------------------------------------------------------ artifacts

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *args,
        evaluation: dict | None = None,
        repo_id: str | None = None,
        **kwargs,
    ):
        """`PreTrainedModel.save_pretrained` (safetensors, sharded by `max_shard_size`), plus the content hash in the
        config and a model card (`README.md`, see `write_card`), rewritten idempotently.

        Args:
            evaluation (`dict`, *optional*): results JSON of `hf-kvmap eval`/`demo`; saved as `evaluation.json` and
                rendered into the card. Without it, an `evaluation.json` already in the folder is used.
            repo_id (`str`, *optional*): the Hub id the card names (defaults to the folder name).
        """
        from .card import content_hash

        if kwargs.get("safe_serialization") is False:
            raise ValueError("hf-kvmap saves safetensors only; drop `safe_serialization=False`.")
        self.config.content_hash = content_hash(self.state_dict())
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            self.write_card(save_directory, evaluation=evaluation, repo_id=repo_id)

    def write_card(
        self, folder: str | os.PathLike, evaluation: dict | None = None, repo_id: str | None = None
    ) -> Path:
        """(Re)render `folder/README.md` from the config and the evaluation results.

        A given `evaluation` is stored as `folder/evaluation.json`; without it, the one already there (if any) is used.
        The card is named after `repo_id` (or the folder). Returns the card's path.
        """
        from .card import render_card
        from .reporting import write_json

        folder = Path(folder)
        if evaluation is not None:
            write_json(folder / EVALUATION_FILE, evaluation)
        elif (folder / EVALUATION_FILE).exists():
            evaluation = json.loads((folder / EVALUATION_FILE).read_text())
        model_name = repo_id.split("/")[-1] if repo_id else folder.resolve().name
        render_card(self, evaluation, model_name=model_name, repo_id=repo_id).save(folder / "README.md")
        return folder / "README.md"

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, verify: bool = True, **kwargs) -> MapperModel:
        """`PreTrainedModel.from_pretrained` (folder or Hub id, `dtype=`, `device_map=`), then verify the weights
        against the content hash recorded at save time (`verify=False` skips it). A tampered or mismatched weight
        file raises `ValueError`.
        """
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        expected = model.config.content_hash
        if verify and expected:
            actual = stored_content_hash(pretrained_model_name_or_path, **kwargs)
            if actual != expected:
                raise ValueError(
                    f"The weights at {pretrained_model_name_or_path} hash to {actual}, but the config records "
                    f"{expected}: the artifact was modified or mixed with another one. Re-download or re-save it "
                    "(or pass verify=False to load it anyway for debugging)."
                )
        return model

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

    def check_compatible(self, source_model=None, target_model=None, tokenizer=None, *, allow_mismatch: bool = False):
        """Compare the models (and tokenizer) in hand with the approval tuple recorded in the config.

        Checked: model type, KV geometry and rope parameters of each side; the recorded revision and id of each side
        when both the mapper and the model know them; the tokenizer fingerprint. A mismatch raises `ValueError`
        naming both values; `allow_mismatch=True` logs them instead (for experiments).
        """
        problems = []
        for side, model in (("source", source_model), ("target", target_model)):
            if model is None:
                continue
            problems += _side_mismatches(self.config, side, model.config)
        if tokenizer is not None and self.config.tokenizer_fingerprint:
            from .fitting import tokenizer_fingerprint

            found = tokenizer_fingerprint(tokenizer)
            if found != self.config.tokenizer_fingerprint:
                problems.append(
                    f"tokenizer: the mapper was fitted with fingerprint {self.config.tokenizer_fingerprint}, "
                    f"the tokenizer in hand has {found}"
                )
        if problems:
            message = "The mapper does not match the models in hand:\n- " + "\n- ".join(problems)
            if not allow_mismatch:
                raise ValueError(message + "\nUse the mapper fitted for these models, or allow_mismatch=True.")
            logger.warning(message)
        return problems


def _side_mismatches(config: MapperConfig, side: str, model_config) -> list[str]:
    from .rope import text_config

    recorded = getattr(config, f"{side}_config")
    found = summarize_model_config(model_config)
    problems = []
    if found["model_type"] != recorded["model_type"]:
        problems.append(f"{side} model_type: mapper expects {recorded['model_type']}, model is {found['model_type']}")
    expected_geometry, found_geometry = KVGeometry.from_config(recorded), KVGeometry.from_config(found)
    if expected_geometry != found_geometry:
        problems.append(f"{side} geometry: mapper expects {expected_geometry}, model has {found_geometry}")
    if recorded.get("rope_parameters") != found.get("rope_parameters"):
        problems.append(
            f"{side} rope_parameters: mapper expects {recorded.get('rope_parameters')}, "
            f"model has {found.get('rope_parameters')}"
        )
    text = text_config(model_config)
    for what, expected, actual in (
        ("revision", getattr(config, f"{side}_revision"), model_revision(text) or model_revision(model_config)),
        ("id", getattr(config, f"{side}_model_id"), model_id(model_config)),
    ):
        if expected and actual and expected != actual:
            problems.append(f"{side} {what}: mapper expects {expected}, model has {actual}")
    return problems


def _weight_files(pretrained_model_name_or_path, **kwargs) -> list[Path]:
    path = Path(pretrained_model_name_or_path)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(
            snapshot_download(
                str(pretrained_model_name_or_path),
                revision=kwargs.get("revision"),
                cache_dir=kwargs.get("cache_dir"),
                local_files_only=kwargs.get("local_files_only", False),
                token=kwargs.get("token"),
                allow_patterns=["*.safetensors", "*.json"],
            )
        )
    subfolder = kwargs.get("subfolder") or ""
    return sorted((path / subfolder).glob("*.safetensors"))


def stored_content_hash(pretrained_model_name_or_path, **kwargs) -> str:
    """The content hash of the safetensors weights of a saved mapper, read one tensor at a time as stored."""
    from contextlib import ExitStack

    from safetensors import safe_open

    from .card import content_hash

    with ExitStack() as stack:
        handles = {}
        for file in _weight_files(pretrained_model_name_or_path, **kwargs):
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            handles.update(dict.fromkeys(handle.keys(), handle))

        class _Lazy(dict):
            def __getitem__(self, name):
                return handles[name].get_tensor(name)

        return content_hash(_Lazy(handles))
