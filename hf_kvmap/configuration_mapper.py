"""`MapperConfig`: everything needed to apply a KV-cache mapper without guessing."""

from __future__ import annotations

import copy
from typing import Any

from transformers import PretrainedConfig

MAPPER_KINDS = ("ridge", "mlp")
INPUT_KINDS = ("same", "both")
LAMBDA_CONVENTIONS = ("absolute", "per_token")

# Fields of a model config that the mapper keeps (enough to rebuild its rotary embedding and check its geometry).
_MODEL_CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "max_position_embeddings",
    "rope_parameters",
    "partial_rotary_factor",
    "sliding_window",
    "use_sliding_window",
    "layer_types",
    "vocab_size",
)


def summarize_model_config(config: PretrainedConfig | dict) -> dict[str, Any]:
    """The subset of a (text) model config that a `MapperConfig` records for one side."""
    from .rope import text_config

    config = text_config(config)
    full = config.to_dict()
    summary = {key: copy.deepcopy(full[key]) for key in _MODEL_CONFIG_KEYS if key in full}
    summary["model_type"] = config.model_type
    return summary


class MapperConfig(PretrainedConfig):
    r"""
    Configuration of a [`MapperModel`]: a directional map from a source model's KV cache to the cache a target
    model of the same family expects.

    Args:
        source_config (`dict`):
            The source model's config fields (see `summarize_model_config`): geometry and rope parameters.
        target_config (`dict`):
            The same for the target model.
        source_layers (`list[list[int]]`, *optional*):
            For every target layer, the source layers whose keys (values) feed its key (value) map. Defaults to
            layer `l` for target layer `l` (only valid when both sides have the same depth).
        kind (`str`, *optional*, defaults to `"ridge"`):
            The mapper family. `"ridge"`: one affine map per target layer and K/V, all heads at once. `"mlp"`: per
            target layer, KV head and K/V, an MLP `d_in -> h -> h -> head_dim` (ReLU) on the same inputs.
        mlp_hidden_size (`int`, *optional*, defaults to 1024):
            `h` of the `"mlp"` kind.
        input_kinds (`str`, *optional*, defaults to `"same"`):
            What each map reads from the selected source layers. `"same"` (the paper's): the key map reads source
            keys, the value map source values. `"both"`: both maps read the source keys and values.
        context_window (`int`, *optional*, defaults to 0):
            How many earlier positions each map also reads: the inputs at position `t` are the features of `t`,
            `t - 1`, ..., `t - context_window` (zeros before the first token). 0 is the paper's per-position map. A
            target layer whose keys depend on the preceding tokens (an induction layer) needs them: a source cache
            holds that information only in a form no per-position linear map recovers.
        ridge_lambda (`float`, *optional*, defaults to 0.01):
            The ridge penalty the weights were fitted with.
        lambda_convention (`str`, *optional*, defaults to `"absolute"`):
            `"absolute"`: `(X^T X + lambda I)`; `"per_token"`: `(X^T X + N lambda I)` with `N` calibration tokens.
        source_model_id, target_model_id (`str`, *optional*): Hub ids or paths of the two models.
        source_revision, target_revision (`str`, *optional*): the exact revisions (commit hashes) they were at.
        tokenizer_fingerprint (`str`, *optional*): hash of the shared tokenizer's vocabulary.
        calibration (`dict`, *optional*): provenance of the fitting data (tokens, stride, fingerprint, ...).
        selection_scores (`list[list[float]]`, *optional*): the R^2 score of each selected source layer.
        library_version (`str`, *optional*): the hf-kvmap version that wrote the config.
        content_hash (`str`, *optional*): sha256 of the saved weights, written by `save_pretrained` and checked by
            `from_pretrained`.

    Example:

    ```python
    >>> from transformers import Qwen3Config
    >>> from hf_kvmap import MapperConfig
    >>> from hf_kvmap.configuration_mapper import summarize_model_config
    >>> side = summarize_model_config(Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=16))
    >>> MapperConfig(source_config=side, target_config=side).source_layers
    [[0], [1]]
    ```
    """

    model_type = "kvmap_mapper"

    def __init__(
        self,
        source_config: dict | None = None,
        target_config: dict | None = None,
        source_layers: list[list[int]] | None = None,
        kind: str = "ridge",
        ridge_lambda: float = 0.01,
        lambda_convention: str = "absolute",
        mlp_hidden_size: int = 1024,
        input_kinds: str = "same",
        context_window: int = 0,
        source_model_id: str | None = None,
        source_revision: str | None = None,
        target_model_id: str | None = None,
        target_revision: str | None = None,
        tokenizer_fingerprint: str | None = None,
        calibration: dict | None = None,
        selection_scores: list[list[float]] | None = None,
        library_version: str | None = None,
        content_hash: str | None = None,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        from . import __version__

        self.source_config = dict(source_config) if source_config is not None else None
        self.target_config = dict(target_config) if target_config is not None else None
        self.kind = kind
        self.ridge_lambda = float(ridge_lambda)
        self.lambda_convention = lambda_convention
        self.mlp_hidden_size = int(mlp_hidden_size)
        self.input_kinds = input_kinds
        self.context_window = context_window
        self.source_model_id = source_model_id
        self.source_revision = source_revision
        self.target_model_id = target_model_id
        self.target_revision = target_revision
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.calibration = dict(calibration) if calibration else {}
        self.selection_scores = selection_scores
        self.library_version = library_version or __version__
        self.initializer_range = initializer_range
        self.content_hash = content_hash
        if source_layers is None and self.source_config is not None and self.target_config is not None:
            source_layers = [[layer] for layer in range(self.target_config["num_hidden_layers"])]
        self.source_layers = [list(map(int, layers)) for layers in source_layers] if source_layers else None
        super().__init__(**kwargs)
        self.validate()

    # Geometry of each side, derived from the recorded model configs.
    @property
    def source_geometry(self):
        from .rope import KVGeometry

        return KVGeometry.from_config(self.source_config)

    @property
    def target_geometry(self):
        from .rope import KVGeometry

        return KVGeometry.from_config(self.target_config)

    def input_width(self, target_layer: int) -> int:
        """Width of the features feeding `target_layer`'s maps: k selected layers x KV heads x head dim of the
        source, times 2 with `input_kinds="both"`, times `1 + context_window` positions."""
        parts = 2 if self.input_kinds == "both" else 1
        return (
            len(self.source_layers[target_layer])
            * self.source_geometry.layer_width
            * parts
            * (1 + self.context_window)
        )

    def validate(self) -> None:
        """Raise `ValueError` naming the bad value if the config is inconsistent."""
        if self.kind not in MAPPER_KINDS:
            raise ValueError(f"kind={self.kind!r} is not a mapper kind; expected one of {MAPPER_KINDS}.")
        if self.lambda_convention not in LAMBDA_CONVENTIONS:
            raise ValueError(f"lambda_convention={self.lambda_convention!r} is not one of {LAMBDA_CONVENTIONS}.")
        if self.input_kinds not in INPUT_KINDS:
            raise ValueError(f"input_kinds={self.input_kinds!r} is not one of {INPUT_KINDS}.")
        if (
            isinstance(self.context_window, bool)
            or not isinstance(self.context_window, int)
            or self.context_window < 0
        ):
            raise ValueError(
                f"context_window={self.context_window!r} must be a non-negative integer (0: per position)."
            )
        if self.mlp_hidden_size < 1:
            raise ValueError(f"mlp_hidden_size={self.mlp_hidden_size} must be a positive integer.")
        if self.ridge_lambda < 0:
            raise ValueError(f"ridge_lambda={self.ridge_lambda} must be >= 0.")
        if self.source_config is None or self.target_config is None:
            return  # a bare config (e.g. `MapperConfig()` while loading) is completed by `from_dict`
        for side, summary in (("source_config", self.source_config), ("target_config", self.target_config)):
            if "model_type" not in summary:
                raise ValueError(f"{side} has no `model_type`; build it with `summarize_model_config(config)`.")
        source, target = self.source_geometry, self.target_geometry
        if self.source_layers is None or len(self.source_layers) != target.num_layers:
            got = None if self.source_layers is None else len(self.source_layers)
            raise ValueError(
                f"source_layers has {got} entries but the target has {target.num_layers} layers: "
                "give one list of source layers per target layer."
            )
        for layer, selected in enumerate(self.source_layers):
            if not selected:
                raise ValueError(
                    f"source_layers[{layer}] is empty: every target layer needs at least one source layer."
                )
            bad = [s for s in selected if not 0 <= s < source.num_layers]
            if bad:
                raise ValueError(
                    f"source_layers[{layer}] names source layers {bad}, but the source has {source.num_layers} layers."
                )
            if len(set(selected)) != len(selected):
                raise ValueError(f"source_layers[{layer}]={selected} repeats a layer.")
