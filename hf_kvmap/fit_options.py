"""`FitOptions`: how a mapper is fitted.

Every default of fitting (`ridge_lambda`, `top_k`, the mapper kinds, the MLP training settings, the fine-tunes) and
its validation live here, once: the library's functions, `hf_kvmap.fit_mapper` and the command line all take them
from `FitOptions`. What a fitted mapper records is `MapperConfig` (`hf_kvmap.configuration_mapper`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .configuration_mapper import (
    INPUT_KINDS,
    LAMBDA_CONVENTIONS,
    MAPPER_KINDS,
    OBJECTIVES,
    check_choice,
    check_int,
    check_number,
    normalize_layer_inputs,
)
from .kinds import KIND_REGISTRY
from .kinds.mlp import MLP_INITS, MLPOptions
from .kinds.ridge import RidgeOptions

ATTENTION_LOSSES = ("output", "logits")
ATTENTION_SPACES = ("residual", "heads")


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
            from its own (`hf_kvmap.objectives.attention_finetune`; no backward through the target).
            `"attention+kl"`: the attention fine-tune, then the KL one.
        kl_steps, kl_lr, kl_batch_size, kl_eval_every, kl_patience, kl_val_sequences, kl_min_prefix,
            kl_cache_references: the end-to-end
            fine-tune (see `hf_kvmap.objectives.kl_finetune`).
        attn_steps, attn_lr, attn_batch_size, attn_eval_every, attn_patience, attn_val_sequences, attn_min_prefix,
            attn_loss, attn_space, attn_normalize, attn_cache_references: the attention fine-tune (see
            `hf_kvmap.objectives.attention_finetune`).
        hidden_size (`int`, *optional*, defaults to 1024): `h` of the MLP kind.
        epochs, batch_tokens, lr, warmup_steps, patience, init, seed: MLP training (see
            `hf_kvmap.kinds.mlp.train_headwise_mlp`).
        val_fraction (`float`, *optional*, defaults to 0.1): share of calibration sequences held out (MLP only).
        stride (`int`, *optional*, defaults to 1): keep every `stride`-th calibration position.
        statistics_dtype (`torch.dtype`, *optional*, defaults to `torch.float64`): accumulation dtype.
        max_memory_bytes (`int`, *optional*, defaults to 16 GiB): bound on calibration features kept in memory.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the fitted mapper's weights.
    """

    kind: str = "ridge"
    top_k: int | None = 8
    source_layers: list[list[int]] | None = None
    ridge_lambda: float = RidgeOptions.ridge_lambda
    lambda_convention: str = RidgeOptions.lambda_convention
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
    hidden_size: int = MLPOptions.hidden_size
    epochs: int = MLPOptions.epochs
    batch_tokens: int = MLPOptions.batch_tokens
    lr: float = MLPOptions.lr
    warmup_steps: int = MLPOptions.warmup_steps
    val_fraction: float = MLPOptions.val_fraction
    patience: int | None = MLPOptions.patience
    init: str = MLPOptions.init
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
        if KIND_REGISTRY[self.kind].needs_features or self.input_kinds != "same" or self.context_window > 0:
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
        """The settings `hf_kvmap.objectives.attention_finetune` takes from these options (and the seed)."""
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
        """The settings `hf_kvmap.kinds.mlp.train_headwise_mlp` takes from these options (all but the seed)."""
        names = ("hidden_size", "epochs", "batch_tokens", "lr", "patience", "init", "ridge_lambda")
        return {name: getattr(self, name) for name in (*names, "lambda_convention", "warmup_steps")}

    def replace(self, **changes) -> FitOptions:
        """A copy with `changes` (validated); unknown names raise `TypeError` naming them."""
        unknown = sorted(set(changes) - {field.name for field in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"Unknown fitting options {unknown}; see `hf_kvmap.FitOptions` for the known ones.")
        return dataclasses.replace(self, **changes)


__all__ = ["ATTENTION_LOSSES", "ATTENTION_SPACES", "MLP_INITS", "FitOptions"]
