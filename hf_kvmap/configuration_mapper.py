"""`MapperConfig`: everything needed to apply a KV-cache mapper without guessing; `FitOptions`: how one is fitted.

Every default of fitting (`ridge_lambda`, `top_k`, the mapper kinds, the MLP training settings) and its validation
live here, once: the library's functions, `MapperModel.fit` and the command line all take them from `FitOptions`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from transformers import PretrainedConfig

from ._version import __version__
from .geometry import KVGeometry, text_config

MAPPER_KINDS = ("ridge", "mlp")
INPUT_KINDS = ("same", "both")
LAMBDA_CONVENTIONS = ("absolute", "per_token")
MLP_INITS = ("ridge", "random")
OBJECTIVES = ("mse", "kl", "attention", "attention+kl")
ATTENTION_LOSSES = ("output", "logits")
ATTENTION_SPACES = ("residual", "heads")
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


def check_choice(name: str, value, choices: tuple) -> None:
    """Raise `ValueError` unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}.")


def check_int(name: str, value, minimum: int, *, allow_none: bool = False, meaning: str = "") -> None:
    """Raise `ValueError` unless `value` is an integer (not a bool) `>= minimum` (or `None` with `allow_none`)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name}={value!r} must be {what}{meaning}.")


def check_number(name: str, value, minimum: float, *, strict: bool = False, below: float | None = None) -> None:
    """Raise `ValueError` unless `value` is a real number `>= minimum` (`> minimum` with `strict`, `< below`)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > minimum if strict else value >= minimum) and (below is None or value < below)
    if not ok:
        bound = f"{'>' if strict else '>='} {minimum}" + (f" and < {below}" if below is not None else "")
        raise ValueError(f"{name}={value!r} must be a number {bound}.")


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


def part_inputs(layer_inputs: dict, layer: int, part: str, context_window: int, input_kinds: str) -> tuple[int, str]:
    """`(context_window, input_kinds)` of target `layer`'s `part` map: its `layer_inputs` entry, else the global
    ones."""
    spec = layer_inputs.get(str(layer), {}).get(part, {})
    return spec.get("context_window", context_window), spec.get("input_kinds", input_kinds)


@dataclasses.dataclass
class FitOptions:
    r"""
    How a mapper is fitted (the one home of every fitting default and its validation).

    Args:
        kind (`str`, *optional*, defaults to `"ridge"`): the mapper kind, one of `MAPPER_KINDS`.
        top_k (`int`, *optional*, defaults to 8): source layers per target layer, chosen by the single-source probe
            (`None`: all). Ignored when `source_layers` is given.
        source_layers (`list[list[int]]`, *optional*): explicit source layers per target layer (skips selection).
        ridge_lambda (`float`, *optional*, defaults to 0.01): ridge penalty (of the ridge kind, of the MLP's ridge
            initialization and of its comparison ridge).
        lambda_convention (`str`, *optional*, defaults to `"absolute"`): `"absolute"` adds `lambda I`,
            `"per_token"` adds `N lambda I` with `N` calibration positions.
        input_kinds (`str`, *optional*, defaults to `"same"`), context_window (`int`, *optional*, defaults to 0): what
            each map reads (see `MapperConfig`).
        layer_inputs (`dict`, *optional*): per-map exceptions to those two, e.g. `{3: {"key": {"context_window": 3,
            "input_kinds": "both"}}}`: a context window only where a layer needs one (see `MapperConfig`).
        key_norm (`bool`, *optional*, defaults to `False`): normalise each predicted key head with the target's own
            key norm (see `MapperConfig`); the target must have one (`self_attn.k_norm`, e.g. Qwen3).
        objective (`str`, *optional*, defaults to `"mse"`): `"mse"`: the maps minimise the content-space error of
            the keys and values (closed form or MLP training). `"kl"`: that fit is then fine-tuned end to end, so
            that the frozen target reading the mapped cache reproduces its own next-token distributions on
            calibration text (`hf_kvmap.objectives.kl_finetune`). `"attention"`: that fit is then fine-tuned so that
            in every target layer the target's own queries read the same attention output from the mapped cache as
            from its own (`hf_kvmap.attention_objective.attention_finetune`; no backward through the target).
            `"attention+kl"`: the attention fine-tune, then the KL one.
        kl_steps, kl_lr, kl_batch_size, kl_eval_every, kl_patience, kl_val_sequences, kl_min_prefix,
            kl_cache_references: the end-to-end
            fine-tune (see `hf_kvmap.objectives.kl_finetune`).
        attn_steps, attn_lr, attn_batch_size, attn_eval_every, attn_patience, attn_val_sequences, attn_min_prefix,
            attn_loss, attn_space, attn_normalize, attn_cache_references: the attention fine-tune (see
            `hf_kvmap.attention_objective.attention_finetune`).
        hidden_size (`int`, *optional*, defaults to 1024): `h` of the MLP kind.
        epochs, batch_tokens, lr, warmup_steps, patience, init, seed: MLP training (see
            `hf_kvmap.training.train_headwise_mlp`).
        val_fraction (`float`, *optional*, defaults to 0.1): share of calibration sequences held out (MLP only).
        stride (`int`, *optional*, defaults to 1): keep every `stride`-th calibration position.
        statistics_dtype (`torch.dtype`, *optional*, defaults to `torch.float64`): accumulation dtype.
        max_memory_bytes (`int`, *optional*, defaults to 16 GiB): bound on calibration features kept in memory.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the fitted mapper's weights.
    """

    kind: str = "ridge"
    top_k: int | None = 8
    source_layers: list[list[int]] | None = None
    ridge_lambda: float = 0.01
    lambda_convention: str = "absolute"
    input_kinds: str = "same"
    context_window: int = 0
    layer_inputs: dict | None = None
    key_norm: bool = False
    objective: str = "mse"
    kl_steps: int = 400
    kl_lr: float = 3e-4
    kl_batch_size: int = 8
    kl_eval_every: int = 25
    kl_patience: int | None = 6
    kl_val_sequences: int = 32
    kl_min_prefix: int = 32
    kl_cache_references: bool = False
    attn_steps: int = 400
    attn_lr: float = 1e-3
    attn_batch_size: int = 8
    attn_eval_every: int = 25
    attn_patience: int | None = 6
    attn_val_sequences: int = 32
    attn_min_prefix: int = 32
    attn_loss: str = "output"
    attn_space: str = "residual"
    attn_normalize: bool = True
    attn_cache_references: bool = False
    hidden_size: int = 1024
    epochs: int = 20
    batch_tokens: int = 4096
    lr: float = 1e-3
    warmup_steps: int = 50
    val_fraction: float = 0.1
    patience: int | None = 3
    init: str = "ridge"
    seed: int = 0
    stride: int = 1
    statistics_dtype: torch.dtype = torch.float64
    max_memory_bytes: int | None = 16 * 2**30
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the first bad value."""
        check_choice("kind", self.kind, MAPPER_KINDS)
        check_choice("init", self.init, MLP_INITS)
        check_choice("input_kinds", self.input_kinds, INPUT_KINDS)
        check_choice("lambda_convention", self.lambda_convention, LAMBDA_CONVENTIONS)
        check_int("top_k", self.top_k, 1, allow_none=True, meaning=", or None for all source layers")
        check_int("context_window", self.context_window, 0, meaning=" (0: per position)")
        self.layer_inputs = normalize_layer_inputs(self.layer_inputs) or None
        check_choice("objective", self.objective, OBJECTIVES)
        check_int("kl_steps", self.kl_steps, 0)
        check_number("kl_lr", self.kl_lr, 0, strict=True)
        check_int("kl_batch_size", self.kl_batch_size, 1)
        check_int("kl_eval_every", self.kl_eval_every, 1)
        check_int("kl_patience", self.kl_patience, 0, allow_none=True)
        check_int("kl_val_sequences", self.kl_val_sequences, 1)
        check_int("kl_min_prefix", self.kl_min_prefix, 1)
        check_int("attn_steps", self.attn_steps, 0)
        check_number("attn_lr", self.attn_lr, 0, strict=True)
        check_int("attn_batch_size", self.attn_batch_size, 1)
        check_int("attn_eval_every", self.attn_eval_every, 1)
        check_int("attn_patience", self.attn_patience, 0, allow_none=True)
        check_int("attn_val_sequences", self.attn_val_sequences, 1)
        check_int("attn_min_prefix", self.attn_min_prefix, 1)
        check_choice("attn_loss", self.attn_loss, ATTENTION_LOSSES)
        check_choice("attn_space", self.attn_space, ATTENTION_SPACES)
        check_number("ridge_lambda", self.ridge_lambda, 0)
        check_int("hidden_size", self.hidden_size, 1)
        check_int("epochs", self.epochs, 0)
        check_int("batch_tokens", self.batch_tokens, 1)
        check_number("lr", self.lr, 0, strict=True)
        check_int("warmup_steps", self.warmup_steps, 0)
        check_number("val_fraction", self.val_fraction, 0, below=1)
        check_int("patience", self.patience, 0, allow_none=True)
        check_int("stride", self.stride, 1)
        check_int("max_memory_bytes", self.max_memory_bytes, 1, allow_none=True)

    @property
    def fits_on_features(self) -> bool:
        """Whether the mapper is fitted on calibration features kept in memory: the MLP, and any input the
        sufficient statistics do not cover; only the per-position ridge is solved from statistics alone."""
        if self.kind == "mlp" or self.input_kinds != "same" or self.context_window > 0:
            return True
        return any(
            spec.get("context_window", 0) > 0 or spec.get("input_kinds", "same") != "same"
            for parts in (self.layer_inputs or {}).values()
            for spec in parts.values()
        )

    def kl_settings(self) -> dict[str, Any]:
        """The settings `hf_kvmap.objectives.kl_finetune` takes from these options (and the seed)."""
        names = (
            "steps",
            "lr",
            "batch_size",
            "eval_every",
            "patience",
            "val_sequences",
            "min_prefix",
            "cache_references",
        )
        return {name: getattr(self, f"kl_{name}") for name in names} | {"seed": self.seed}

    def attention_settings(self) -> dict[str, Any]:
        """The settings `hf_kvmap.attention_objective.attention_finetune` takes from these options (and the seed)."""
        names = ("steps", "lr", "batch_size", "eval_every", "patience", "val_sequences", "min_prefix", "loss")
        names += ("space", "normalize", "cache_references")
        return {name: getattr(self, f"attn_{name}") for name in names} | {"seed": self.seed}

    @property
    def objective_stages(self) -> tuple[str, ...]:
        """The fine-tunes after the fit, in order (`()` for `"mse"`)."""
        return tuple(stage for stage in self.objective.split("+") if stage != "mse")

    def objective_settings(self) -> dict[str, dict[str, Any]]:
        """`{stage: its settings}` of every fine-tune of the objective (what `MapperConfig.objective_settings`
        records)."""
        return {stage: getattr(self, f"{stage}_settings")() for stage in self.objective_stages}

    def mlp_settings(self) -> dict[str, Any]:
        """The settings `hf_kvmap.training.train_headwise_mlp` takes from these options (all but the seed)."""
        names = ("hidden_size", "epochs", "batch_tokens", "lr", "patience", "init", "ridge_lambda")
        return {name: getattr(self, name) for name in (*names, "lambda_convention", "warmup_steps")}

    def replace(self, **changes) -> FitOptions:
        """A copy with `changes` (validated); unknown names raise `TypeError` naming them."""
        unknown = sorted(set(changes) - {field.name for field in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"Unknown fitting options {unknown}; see `hf_kvmap.FitOptions` for the known ones.")
        return dataclasses.replace(self, **changes)


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
            (`hf_kvmap.artifacts.SERVING_FIELDS`: `handoff_probe`, `tokenizer_fingerprint`, model ids and revisions),
            written by `save_pretrained` and checked by `from_pretrained`.
        handoff_probe (`dict`, *optional*): the calibrated guard of `hf_kvmap.handoff`: `{"probe": {"name": ...,
            "tokens": ...}, "threshold": ..., "max_false_alarm": ..., "calibration": {...}}`, written by
            `hf_kvmap.calibrate_probe`. `None` (older configs) means not calibrated.

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
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ValueError(
                        f"{side}.{name}={value!r} must be a positive integer: the config was edited or built by hand; "
                        "record the model's own config with `summarize_model_config(model.config)`."
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
