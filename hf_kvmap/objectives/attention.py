"""The per-layer attention objective: fine-tune a fitted mapper so that, in every target layer, the target's own
queries read the same attention output from the mapped cache as from its own.

The error of a key or value matters only through what the target's attention makes of it: in a sharp layer a small
key error along the directions its queries read moves the lookup, while large errors elsewhere cost nothing. Here a
calibration sequence is cut at a point `p` (as in serving, `hf_kvmap.finetune`); the frozen target runs the whole
sequence once, and its queries at positions `>= p` (each layer's, as its attention receives them: RoPE applied at
their own positions, every query head of each GQA group) attend causally over

- the mapped cache at positions `< p` and the target's own keys and values from `p` on (what it reads in serving),
- and over its own cache throughout (the reference).

The loss is the squared difference of the two outputs, per layer, optionally through the layer's output projection
(`space="residual"`: what is added to the residual stream) and divided by the reference's energy
(`normalize=True`: every layer weighs the same), averaged over layers. `loss="logits"` instead measures the
attention logits `q . (k_hat - k) / sqrt(d)` of those queries over the mapped keys (the query-weighted key error; the
values are then not trained).

Cost per step: one source forward on the prefix and one target forward on the sequence, both without gradients
(the reference; `cache_references=True` computes them once), the mapper's forward and backward, and per target layer
one attention of the suffix queries over the sequence with its backward. Each layer is mapped and back-propagated
on its own, so the memory of the backward is one layer's graph, not every layer's (the gradients are the same). Nothing is back-propagated through the
target's layers: unlike the KL objective, no activation of the target is kept and no backward runs through it.
What it does not see is how errors compound from one layer into the queries of the next.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .._compat import output_cache
from ..configuration_mapper import check_choice
from ..finetune import CalibrationSplit, Objective, finetune_settings, register_objective, run_finetune
from ..fit_options import ATTENTION_LOSSES, ATTENTION_SPACES, FitOptions


@dataclass
class AttentionFinetuneResult:
    """What [`attention_finetune`] did: its settings, the held-out attention error before and after (overall and per
    target layer), and the validation curve."""

    settings: dict[str, Any]
    initial_val_error: float
    best_val_error: float
    initial_layer_errors: list[float]
    best_layer_errors: list[float]
    best_step: int
    steps_run: int
    seconds: float
    sequences_train: int
    sequences_val: int
    sequence_length: int
    history: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class AttentionReads:
    """What the target reads in each layer on some sequences: its queries `(batch, heads, T, d)` as its attention
    receives them, its own keys and values `(batch, kv_heads, T, d)`, the attention scale and the layer's attention
    module (for its output projection)."""

    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    scalings: list[float]
    modules: list[torch.nn.Module]

    def take(self, index: torch.Tensor) -> AttentionReads:
        pick = [[t[index] for t in group] for group in (self.queries, self.keys, self.values)]
        return AttentionReads(*pick, self.scalings, self.modules)


@dataclass
class AttentionOptions:
    """The settings of [`attention_finetune`] (`FitOptions.attn_*` and `FitOptions.seed`; see `attention_finetune`
    for each)."""

    steps: int = FitOptions.attn_steps
    lr: float = FitOptions.attn_lr
    batch_size: int = FitOptions.attn_batch_size
    eval_every: int = FitOptions.attn_eval_every
    patience: int | None = FitOptions.attn_patience
    val_sequences: int = FitOptions.attn_val_sequences
    min_prefix: int = FitOptions.attn_min_prefix
    loss: str = FitOptions.attn_loss
    space: str = FitOptions.attn_space
    normalize: bool = FitOptions.attn_normalize
    cache_references: bool = FitOptions.attn_cache_references
    seed: int = FitOptions.seed

    def loss_settings(self) -> dict[str, Any]:
        """What [`attention_errors`] takes (validated)."""
        check_choice("loss", self.loss, ATTENTION_LOSSES)
        check_choice("space", self.space, ATTENTION_SPACES)
        return {"loss": self.loss, "space": self.space, "normalize": bool(self.normalize)}

    def settings(self) -> dict[str, Any]:
        """What the fine-tune records (validated; raises `ValueError` naming the first bad value)."""
        names = ("steps", "lr", "batch_size", "eval_every", "patience", "val_sequences", "min_prefix", "seed")
        recorded = finetune_settings(*(getattr(self, name) for name in names), self.cache_references)
        return recorded | self.loss_settings()


@contextmanager
def _recording_attention(model, records: dict[int, tuple[torch.Tensor, float, torch.nn.Module]]):
    """While active, every attention call of `model` records `(query, scaling, module)` in `records[layer_idx]` and
    runs as before (the implementation the model's config names, or its modeling file's eager attention)."""
    name = model.config._attn_implementation or "eager"
    local = getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", {})
    had_local, previous = name in local, ALL_ATTENTION_FUNCTIONS.get(name)

    def recording(module, query, key, value, attention_mask, *args, **kwargs):
        original = previous or sys.modules[type(module).__module__].eager_attention_forward
        records[module.layer_idx] = (query.detach(), kwargs.get("scaling", getattr(module, "scaling", None)), module)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[name] = recording
    try:
        yield
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS[name] = previous
        else:
            del ALL_ATTENTION_FUNCTIONS[name]


@torch.no_grad()
def target_reads(target_model, input_ids: torch.Tensor) -> AttentionReads:
    """One forward of the target's body on unpadded `input_ids` (positions `0..T-1`): per layer its queries, keys,
    values (float32), the attention scale and module."""
    device = next(target_model.parameters()).device
    records: dict[int, tuple[torch.Tensor, float, torch.nn.Module]] = {}
    with _recording_attention(target_model, records):
        cache = output_cache(target_model.base_model(input_ids=input_ids.to(device), use_cache=True))
    layers = range(len(cache.layers))
    missing = [layer for layer in layers if layer not in records or records[layer][1] is None]
    if missing:
        raise ValueError(
            f"The attention objective could not read the queries of target layers {missing}: their attention does "
            "not run through transformers' attention interface with a `scaling`."
        )
    return AttentionReads(
        [records[layer][0].float() for layer in layers],
        [cache.layers[layer].keys.float() for layer in layers],
        [cache.layers[layer].values.float() for layer in layers],
        [float(records[layer][1]) for layer in layers],
        [records[layer][2] for layer in layers],
    )


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, offset: int):
    """Causal attention of queries at positions `offset..` over keys and values at positions `0..` (GQA groups)."""
    tq, tk = query.shape[2], keys.shape[2]
    mask = torch.arange(tk, device=query.device)[None, :] <= offset + torch.arange(tq, device=query.device)[:, None]
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)


def _project(module: torch.nn.Module, output: torch.Tensor) -> torch.Tensor:
    batch, heads, length, dim = output.shape
    flat = output.transpose(1, 2).reshape(batch, length, heads * dim)
    return module.o_proj(flat.to(module.o_proj.weight.dtype)).float()


def attention_errors(
    mapper,
    source_kv: list[tuple[torch.Tensor, torch.Tensor]],
    reads: AttentionReads,
    split: int,
    *,
    loss: str = FitOptions.attn_loss,
    space: str = FitOptions.attn_space,
    normalize: bool = FitOptions.attn_normalize,
    backward: float | None = None,
) -> list[torch.Tensor]:
    r"""
    Per target layer, the error the target's queries at positions `>= split` see when the mapper's map of the
    source cache replaces the target's own at positions `< split` (see the module docstring); differentiable in the
    mapper's parameters when gradients are enabled.

    Args:
        mapper ([`MapperModel`]): the mapper (its `forward`).
        source_kv (list of `(keys, values)`): the source's cache of the sequences, `(batch, kv_heads, >= split, d)`
            (only positions `< split` are read).
        reads ([`AttentionReads`]): the target's reads of the same sequences ([`target_reads`]).
        split (`int`): the first position the target reads itself, `1 <= split < T`.
        loss (`str`): `"output"` (attention output) or `"logits"` (attention logits over the mapped keys).
        space (`str`): with `loss="output"`, `"residual"` (through the output projection) or `"heads"`.
        normalize (`bool`): divide each layer's squared error by the reference's squared norm (else: mean over
            elements).
        backward (`float`, *optional*): back-propagate `backward` times each layer's error as soon as it is computed
            (the layer is mapped on its own), so that one layer's graph is alive at a time instead of every layer's;
            the gradients accumulate to those of `backward * sum(errors)`, and the errors come back detached.

    Returns:
        One scalar tensor per target layer.
    """
    check_choice("loss", loss, ATTENTION_LOSSES)
    check_choice("space", space, ATTENTION_SPACES)
    length = reads.keys[0].shape[2]
    if not 1 <= split < length:
        raise ValueError(f"split={split} must cut the sequences of length {length} into two non-empty parts.")
    keys = [k[:, :, :split] for k, _ in source_kv]
    values = [v[:, :, :split] for _, v in source_kv]
    batch = keys[0].shape[0]
    position_ids = torch.arange(split, device=keys[0].device).expand(batch, split)
    num_layers = len(reads.keys)
    if backward is None:
        mapped = iter(mapper(keys, values, position_ids, dtype=torch.float32))
    else:  # one layer's mapping and graph at a time
        mapped = (mapper(keys, values, position_ids, dtype=torch.float32, layers=[i])[0] for i in range(num_layers))
    errors = []
    for layer, (mapped_keys, mapped_values) in enumerate(mapped):
        query, own_keys, own_values = (t.to(mapped_keys.device) for t in (reads.queries[layer][:, :, split:],
                                                                          reads.keys[layer], reads.values[layer]))  # fmt: skip
        scaling = reads.scalings[layer]
        if loss == "logits":
            groups = query.shape[1] // own_keys.shape[1]
            grouped = query.reshape(batch, own_keys.shape[1], groups * query.shape[2], query.shape[3])
            reference = scaling * grouped @ own_keys[:, :, :split].transpose(-1, -2)
            ours = scaling * grouped @ mapped_keys.transpose(-1, -2)
        else:
            with torch.no_grad():
                reference = _attend(query, own_keys, own_values, scaling, split)
            ours = _attend(
                query,
                torch.cat([mapped_keys, own_keys[:, :, split:]], dim=2),
                torch.cat([mapped_values, own_values[:, :, split:]], dim=2),
                scaling,
                split,
            )
            if space == "residual":
                with torch.no_grad():
                    reference = _project(reads.modules[layer], reference)
                ours = _project(reads.modules[layer], ours)
        error = (ours - reference).square()
        error = error.sum() / reference.square().sum().clamp_min(1e-30) if normalize else error.mean()
        if backward is not None and error.requires_grad:
            (backward * error).backward()
            error = error.detach()
        errors.append(error)
    return errors


class _Reads:
    """The target's reads and the source's cache of every row, computed once (`cache=True`) or on demand."""

    def __init__(self, source_model, target_model, rows: torch.Tensor, cache: bool, batch_size: int):
        self.source_model, self.target_model, self.rows, self.cached = source_model, target_model, rows, None
        if cache:
            chunks = [self._compute(chunk) for chunk in rows.split(batch_size)]
            reads = [chunk[1] for chunk in chunks]
            self.cached = (
                [(torch.cat([c[0][i][0] for c in chunks]), torch.cat([c[0][i][1] for c in chunks]))
                 for i in range(len(chunks[0][0]))],
                AttentionReads(
                    *[[torch.cat([getattr(r, name)[i] for r in reads]) for i in range(len(reads[0].keys))]
                      for name in ("queries", "keys", "values")],
                    reads[0].scalings, reads[0].modules,
                ),
            )  # fmt: skip

    @torch.no_grad()
    def _compute(self, rows: torch.Tensor):
        source_cache = output_cache(self.source_model.base_model(input_ids=rows, use_cache=True))
        source_kv = [(layer.keys.float(), layer.values.float()) for layer in source_cache.layers]
        return source_kv, target_reads(self.target_model, rows)

    def take(self, index: torch.Tensor):
        if self.cached is None:
            return self._compute(self.rows[index])
        source_kv, reads = self.cached
        return [(k[index], v[index]) for k, v in source_kv], reads.take(index)


@torch.no_grad()
def held_out_attention_error(
    mapper, reads: _Reads, count: int, splits, batch_size: int, **loss_settings
) -> tuple[float, list[float]]:
    """`(mean, per layer)` of [`attention_errors`] over the first `count` rows of `reads`, each cut at every point
    of `splits` (weighted by the suffix tokens of each cut)."""
    totals, weight = None, 0
    length = reads.rows.shape[1]
    for index in torch.arange(count).split(batch_size):
        source_kv, target = reads.take(index)
        for split in splits:
            layer_errors = [e.item() for e in attention_errors(mapper, source_kv, target, split, **loss_settings)]
            tokens = len(index) * (length - split)
            totals = [0.0] * len(layer_errors) if totals is None else totals
            totals = [t + tokens * e for t, e in zip(totals, layer_errors)]
            weight += tokens
    per_layer = [t / weight for t in totals]
    return sum(per_layer) / len(per_layer), per_layer


def attention_finetune(
    mapper,
    source_model,
    target_model,
    calibration: Iterable,
    *,
    steps: int = FitOptions.attn_steps,
    lr: float = FitOptions.attn_lr,
    batch_size: int = FitOptions.attn_batch_size,
    eval_every: int = FitOptions.attn_eval_every,
    patience: int | None = FitOptions.attn_patience,
    val_sequences: int = FitOptions.attn_val_sequences,
    min_prefix: int = FitOptions.attn_min_prefix,
    loss: str = FitOptions.attn_loss,
    space: str = FitOptions.attn_space,
    normalize: bool = FitOptions.attn_normalize,
    seed: int = FitOptions.seed,
    cache_references: bool = FitOptions.attn_cache_references,
    progress: bool = True,
) -> AttentionFinetuneResult:
    r"""
    Fine-tune `mapper` in place by the per-layer attention objective (see the module docstring), streaming: each
    step reads `batch_size` calibration sequences cut at a random point.

    Adam on every mapper parameter that requires gradients (the target's key-norm weights are buffers and stay);
    the models are frozen for the duration and restored afterwards, and no gradient reaches them. Every
    `eval_every` steps the error on `val_sequences` held-out sequences (cut at a quarter, half and three quarters) is
    measured; the best state (the fitted one included) is kept and restored, and training stops after `patience`
    evaluations without a new best among the trained states (`hf_kvmap.early_stopping`).

    Args:
        mapper ([`MapperModel`]): a fitted mapper of any kind (float32 is advised: Adam updates are small).
        source_model, target_model (`PreTrainedModel`): the pair the mapper maps between.
        calibration (iterable): `(batch, T)` token-id batches of one length `T > 2 * min_prefix`, unpadded.
        steps, lr, batch_size, eval_every, patience, val_sequences, min_prefix, seed: as for
            `hf_kvmap.objectives.kl_finetune`.
        loss (`str`): `"output"`: the attention outputs; `"logits"`: the attention logits of the target's queries over
            the mapped keys (the values are not trained).
        space (`str`): `"residual"`: outputs through the layer's output projection; `"heads"`: the heads' outputs.
        normalize (`bool`): each layer's error relative to the energy of its reference output (or logits).
        cache_references (`bool`): read the target and prefill the source once for every sequence and keep them
            (`N * T * layers * (heads + 2 kv_heads) * d` floats for the target) instead of each step.
        progress (`bool`): tqdm progress bar.

    Returns:
        [`AttentionFinetuneResult`]; it is also recorded in `mapper.config.calibration["attention_finetune"]`.
    """
    options = AttentionOptions(
        steps, lr, batch_size, eval_every, patience, val_sequences, min_prefix, loss, space, normalize,
        cache_references, seed,
    )  # fmt: skip
    return run_finetune(
        AttentionObjective, mapper, source_model, target_model, calibration, options.settings(), progress
    )


@register_objective
class AttentionObjective(Objective):
    """`"attention"`: the per-layer objective of [`attention_finetune`] (see the module docstring)."""

    name = "attention"
    function = staticmethod(attention_finetune)
    options_class = AttentionOptions
    fit_options_prefix = "attn_"
    label = "attention"
    desc = "attention fine-tune"
    metric = "val_error"
    train_metric = "train_error"
    measure = "error"

    def __init__(self, mapper, source_model, target_model, data: CalibrationSplit, settings: dict[str, Any]):
        super().__init__(mapper, source_model, target_model, data, settings)
        cache, batch_size = settings["cache_references"], settings["batch_size"]
        self.loss_settings = {name: settings[name] for name in ("loss", "space", "normalize")}
        self.train_reads = _Reads(source_model, target_model, data.train_rows, cache, batch_size)
        self.val_reads = _Reads(source_model, target_model, data.val_rows, cache, batch_size)
        self.initial_layers: list[float] = []
        self.best_layers: list[float] = []

    def _held_out(self) -> tuple[float, list[float]]:
        data = self.data
        return held_out_attention_error(
            self.mapper, self.val_reads, len(data.val_rows), data.splits, self.settings["batch_size"],
            **self.loss_settings,
        )  # fmt: skip

    def evaluate(self) -> float:
        value, per_layer = self._held_out()
        if not self.initial_layers:
            self.initial_layers.extend(per_layer)
        return value

    def step_loss(self, step: int) -> torch.Tensor:  # the mean over layers, back-propagated one layer at a time
        index, split = self.data.draw(self.settings["batch_size"])
        source_kv, reads = self.train_reads.take(index)
        errors = attention_errors(
            self.mapper, source_kv, reads, split, backward=1 / len(reads.keys), **self.loss_settings
        )
        return torch.stack(errors).mean()

    def finish(self) -> None:
        _, self.best_layers = self._held_out()

    def result(self, run, seconds: float) -> AttentionFinetuneResult:
        return AttentionFinetuneResult(
            settings=self.settings,
            initial_val_error=run.initial,
            best_val_error=run.best,
            initial_layer_errors=self.initial_layers,
            best_layer_errors=self.best_layers,
            best_step=run.best_unit,
            steps_run=run.units_run,
            seconds=seconds,
            sequences_train=len(self.data.train_rows),
            sequences_val=len(self.data.val_rows),
            sequence_length=self.data.length,
            history=run.history,
        )


__all__ = [
    "AttentionFinetuneResult",
    "AttentionObjective",
    "AttentionOptions",
    "AttentionReads",
    "attention_errors",
    "attention_finetune",
    "held_out_attention_error",
    "target_reads",
]
