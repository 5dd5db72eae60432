"""`MapperConfig`: everything needed to apply a KV-cache mapper without guessing (how one is fitted is
`hf_kvmap.fit_options.FitOptions`), and the validators every option bundle shares."""

from __future__ import annotations

import copy
from typing import Any

from transformers import PretrainedConfig

from ._version import __version__
from .geometry import KVGeometry, text_config
from .kinds import MAPPER_KINDS
from .kinds.ridge import LAMBDA_CONVENTIONS
from .layout import part_inputs
from .validation import check_choice, check_int, check_number

INPUT_KINDS = ("same", "both")
OBJECTIVES = ("mse", "kl", "attention", "attention+kl")
PARTS = ("key", "value")

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


#: Summary fields that count something (layers, heads, widths) and must be positive integers where present.
_POSITIVE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers")


def summarize_model_config(config: PretrainedConfig | dict) -> dict[str, Any]:
    """The subset of a (text) model config that a `MapperConfig` records for one side."""
    config = text_config(config)
    full = config.to_dict()
    summary = {key: copy.deepcopy(full[key]) for key in _MODEL_CONFIG_KEYS if key in full}
    summary["model_type"] = config.model_type
    return summary


def normalize_layer_inputs(layer_inputs: dict | None) -> dict[str, dict[str, dict[str, Any]]]:
    """`layer_inputs` in the form a config records: `{"<target layer>": {"key"|"value": {"context_window": int,
    "input_kinds": str}}}` (string layer keys, as JSON stores them); raises `ValueError` naming a bad entry."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for layer, parts in (layer_inputs or {}).items():
        if isinstance(layer, bool) or not str(layer).isdigit():
            raise ValueError(f"layer_inputs key {layer!r} is not a target layer index.")
        if not isinstance(parts, dict) or not parts:
            raise ValueError(f"layer_inputs[{layer!r}] must map 'key' and/or 'value' to their inputs, got {parts!r}.")
        entry = {}
        for part, spec in parts.items():
            check_choice(f"layer_inputs[{layer!r}] part", part, PARTS)
            unknown = sorted(set(spec) - {"context_window", "input_kinds"})
            if unknown:
                raise ValueError(
                    f"layer_inputs[{layer!r}][{part!r}] has unknown fields {unknown}; "
                    "expected 'context_window' and/or 'input_kinds'."
                )
            spec = dict(spec)
            if "context_window" in spec:
                check_int(f"layer_inputs[{layer!r}][{part!r}].context_window", spec["context_window"], 0)
            if "input_kinds" in spec:
                check_choice(f"layer_inputs[{layer!r}][{part!r}].input_kinds", spec["input_kinds"], INPUT_KINDS)
            entry[part] = spec
        out[str(int(layer))] = entry
    return out


class MapperConfig(PretrainedConfig):
    r"""
    Configuration of a [`MapperModel`]: a directional map from a source model's KV cache to the cache a target
    model of the same family expects.

    Args:
        source_summary (`dict`):
            The fields of the source model's config a mapper needs (`summarize_model_config`): geometry and rope
            parameters. Configs saved before this name (`"source_config"`) are read the same way.
        target_summary (`dict`):
            The same for the target model (formerly `"target_config"`).
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
        layer_inputs (`dict`, *optional*):
            Per-map exceptions to `context_window` and `input_kinds`: `{"<target layer>": {"key"|"value":
            {"context_window": w, "input_kinds": "same"|"both"}}}`. Context costs parameters and time in every map
            that reads it, and usually only one or a few layers need it (the ones `hf_kvmap.diagnostics.layer_swap`
            shows breaking a task, e.g. an induction layer's keys): give them a window, keep the paper's
            per-position map elsewhere.
        key_norm (`bool`, *optional*, defaults to `False`):
            Whether each predicted key head passes through the target's own key normalisation (Qwen3's per-head
            `k_norm`, an RMSNorm with weight `g`): `k = g * n(k_hat / g)`, `n(u) = u / rms(u)`. The target's keys
            all lie on that surface; a regression's prediction (a conditional mean) shrinks towards the origin
            where it is unsure, which flattens the attention logits of a sharp layer. The weights `g` are copied from
            the target into the mapper (`layers.<i>.key_norm_weight`).
        key_norm_eps (`float`, *optional*, defaults to 1e-6):
            The epsilon of that normalisation (the target's `rms_norm_eps`).
        objective (`str`, *optional*):
            What the weights were fitted for, one of `OBJECTIVES` (see `FitOptions.objective`): `"mse"` (the fit
            alone), or the fine-tunes that followed it (`"kl"`, `"attention"`, `"attention+kl"`). `None`: not
            recorded (configs written before this field; their fine-tunes are in `calibration`).
        objective_settings (`dict`, *optional*):
            `{stage: settings}` of each fine-tune of `objective` (`FitOptions.objective_settings`); what each run
            did is in `calibration["kl_finetune"]` / `calibration["attention_finetune"]`.
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
        content_hash (`str`, *optional*): sha256 of the saved weights and the mapping fields of this config
            (`hf_kvmap.artifacts.content_hash`), written by `save_pretrained` and checked by
            `from_pretrained`.
        serving_hash (`str`, *optional*): sha256 of the content hash and the fields that decide what is served
            (`hf_kvmap.artifacts.SERVING_FIELDS`: `handoff_probe`, `handoff_ladder`, `tokenizer_fingerprint`, model
            ids and revisions), written by `save_pretrained` and checked by `from_pretrained`.
        handoff_probe (`dict`, *optional*): the calibrated guard of `hf_kvmap.serving.handoff`: `{"probe": {"name": ...,
            "tokens": ...}, "threshold": ..., "max_false_alarm": ..., "calibration": {...}}`, written by
            `hf_kvmap.calibrate_probe`. `None` (older configs) means not calibrated.
        handoff_ladder (`dict`, *optional*): the calibrated guard ladder of `hf_kvmap.serving.ladder` (`GuardLadder.to_dict()`:
            probe, repair strategy, rungs of `max_risk` and repair `fraction`, calibration), written by
            `hf-kvmap calibrate-ladder`; when set, `handoff` serves each row the rung its risk calls for (the mapped
            cache, a repair, or the target's prefill). `None` means no ladder: the handoff serves or falls back.

    Example:

    ```python
    >>> from transformers import Qwen3Config
    >>> from hf_kvmap import MapperConfig
    >>> from hf_kvmap.configuration_mapper import summarize_model_config
    >>> side = summarize_model_config(Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=16))
    >>> MapperConfig(source_summary=side, target_summary=side).source_layers
    [[0], [1]]
    ```
    """

    model_type = "kvmap_mapper"

    def __init__(
        self,
        source_summary: dict | None = None,
        target_summary: dict | None = None,
        source_layers: list[list[int]] | None = None,
        kind: str = "ridge",
        ridge_lambda: float = 0.01,
        lambda_convention: str = "absolute",
        mlp_hidden_size: int = 1024,
        input_kinds: str = "same",
        context_window: int = 0,
        layer_inputs: dict | None = None,
        key_norm: bool = False,
        key_norm_eps: float = 1e-6,
        objective: str | None = None,
        objective_settings: dict | None = None,
        source_model_id: str | None = None,
        source_revision: str | None = None,
        target_model_id: str | None = None,
        target_revision: str | None = None,
        tokenizer_fingerprint: str | None = None,
        calibration: dict | None = None,
        selection_scores: list[list[float]] | None = None,
        library_version: str | None = None,
        content_hash: str | None = None,
        serving_hash: str | None = None,
        handoff_probe: dict | None = None,
        handoff_ladder: dict | None = None,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        # the names of these two fields in configs written before they were renamed
        source_summary = kwargs.pop("source_config", None) if source_summary is None else source_summary
        target_summary = kwargs.pop("target_config", None) if target_summary is None else target_summary
        self.source_summary = dict(source_summary) if source_summary is not None else None
        self.target_summary = dict(target_summary) if target_summary is not None else None
        self.kind = kind
        self.ridge_lambda = float(ridge_lambda)
        self.lambda_convention = lambda_convention
        self.mlp_hidden_size = int(mlp_hidden_size)
        self.input_kinds = input_kinds
        self.context_window = context_window
        self.layer_inputs = normalize_layer_inputs(layer_inputs)
        self.key_norm = bool(key_norm)
        self.key_norm_eps = float(key_norm_eps)
        self.objective = objective
        self.objective_settings = copy.deepcopy(dict(objective_settings)) if objective_settings else {}
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
        self.serving_hash = serving_hash
        self.handoff_probe = dict(handoff_probe) if handoff_probe else None
        self.handoff_ladder = copy.deepcopy(dict(handoff_ladder)) if handoff_ladder else None
        if source_layers is not None and (
            not isinstance(source_layers, (list, tuple))
            or any(
                not isinstance(layers, (list, tuple))
                or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)
                for layers in source_layers
            )
        ):
            raise ValueError(
                f"source_layers={source_layers!r} must be a list of source-layer lists, one per target layer (e.g. "
                "[[0], [1, 2]] for a 2-layer target); omit it for layer l -> layer l."
            )
        if source_layers is None and self.source_summary is not None and self.target_summary is not None:
            source_layers = [[layer] for layer in range(self.target_summary["num_hidden_layers"])]
        self.source_layers = [list(map(int, layers)) for layers in source_layers] if source_layers else None
        super().__init__(**kwargs)
        self.validate()

    # Geometry of each side, derived from the recorded model configs.
    @property
    def source_geometry(self) -> KVGeometry:
        return KVGeometry.from_config(self.source_summary)

    @property
    def target_geometry(self) -> KVGeometry:
        return KVGeometry.from_config(self.target_summary)

    def part_inputs(self, target_layer: int, part: str) -> tuple[int, str]:
        """`(context_window, input_kinds)` of the `part` (`"key"`/`"value"`) map of `target_layer`: its
        `layer_inputs` entry, else the global `context_window` and `input_kinds`."""
        return part_inputs(self.layer_inputs, target_layer, part, self.context_window, self.input_kinds)

    @property
    def max_context_window(self) -> int:
        """The longest context window any map reads."""
        layers = range(len(self.source_layers or ()))
        return max([self.context_window] + [self.part_inputs(t, p)[0] for t in layers for p in PARTS])

    def input_width(self, target_layer: int, part: str = "key") -> int:
        """Width of the features feeding `target_layer`'s `part` map: k selected layers x KV heads x head dim of the
        source, times 2 with `input_kinds="both"`, times `1 + context_window` positions (that map's own, see
        `part_inputs`)."""
        window, input_kinds = self.part_inputs(target_layer, part)
        parts = 2 if input_kinds == "both" else 1
        return len(self.source_layers[target_layer]) * self.source_geometry.layer_width * parts * (1 + window)

    def validate(self) -> None:
        """Raise `ValueError` naming the bad value if the config is inconsistent."""
        check_choice("kind", self.kind, MAPPER_KINDS)
        check_choice("lambda_convention", self.lambda_convention, LAMBDA_CONVENTIONS)
        check_choice("input_kinds", self.input_kinds, INPUT_KINDS)
        check_int("context_window", self.context_window, 0, meaning=" (0: per position)")
        check_int("mlp_hidden_size", self.mlp_hidden_size, 1)
        check_number("ridge_lambda", self.ridge_lambda, 0)
        check_number("key_norm_eps", self.key_norm_eps, 0)
        if self.objective is not None:
            check_choice("objective", self.objective, OBJECTIVES)
        stages = [stage for stage in (self.objective or "").split("+") if stage and stage != "mse"]
        unknown = sorted(set(self.objective_settings) - set(stages))
        if unknown:
            raise ValueError(
                f"objective_settings names {unknown}, which are not fine-tunes of objective={self.objective!r} "
                f"(its stages: {stages})."
            )
        if self.source_summary is None or self.target_summary is None:
            return  # a bare config (e.g. `MapperConfig()` while loading) is completed by `from_dict`
        for side, summary in (("source_summary", self.source_summary), ("target_summary", self.target_summary)):
            if "model_type" not in summary:
                raise ValueError(f"{side} has no `model_type`; build it with `summarize_model_config(config)`.")
            for name in _POSITIVE_KEYS:
                value = summary.get(name)
                check_int(
                    f"{side}.{name}",
                    value,
                    1,
                    allow_none=True,
                    meaning=": the config was edited or built by hand; record the model's own config with "
                    "`summarize_model_config(model.config)`",
                )
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
        bad = sorted(int(layer) for layer in self.layer_inputs if int(layer) >= target.num_layers)
        if bad:
            raise ValueError(f"layer_inputs names target layers {bad}, but the target has {target.num_layers} layers.")
