"""The end-to-end objective: fine-tune a fitted mapper so that the frozen target, reading the mapped cache,
reproduces its own next-token distributions.

Closed-form and MSE-trained maps minimise the error of the keys and values themselves. That is the wrong measure
where the target's attention is sharp (an induction layer): a small key error in the subspace its queries read moves
the lookup, while large errors elsewhere cost nothing. Here the measure is what the target does with the cache. A
calibration sequence is cut at a random point `p`; the source prefills tokens `< p`, the mapper maps that cache, and
the frozen target reads tokens `>= p` on top of it. The loss is `KL(target with its own cache || target with the
mapped cache)` over the next-token distributions of those tokens, and its gradient flows through the target into the
mapper only. Held-out sequences, cut at fixed points, decide early stopping; the best state is kept.

Cost per step: a source forward on the prefix, a target forward on the whole sequence (the reference; both without
gradients), and a target forward and backward on the suffix. The backward runs through every target layer above the
first one that reads the cache, so at Qwen3 32B scale a step costs about three 32B forwards per suffix token plus
the activations of the suffix (the mapped prefix itself enters as a leaf of the graph, one layer of K/V per layer).
A per-layer attention-output loss would need only the target's cached queries and one attention per layer; the KL
objective is the one that sees the whole read path (every layer and how their errors compound).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from .._compat import cache_kwargs, output_cache
from ..finetune import (
    CalibrationSplit,
    Objective,
    calibration_rows,
    finetune_settings,
    register_objective,
    run_finetune,
)
from ..fit_options import FitOptions


@dataclass
class KLFinetuneResult:
    """What [`kl_finetune`] did: its settings, the held-out KL before and after, and the validation curve."""

    settings: dict[str, Any]
    initial_val_kl: float
    best_val_kl: float
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
class KLOptions:
    """The settings of [`kl_finetune`] (`FitOptions.kl_*` and `FitOptions.seed`; see `kl_finetune` for each)."""

    steps: int = FitOptions.kl_steps
    lr: float = FitOptions.kl_lr
    batch_size: int = FitOptions.kl_batch_size
    eval_every: int = FitOptions.kl_eval_every
    patience: int | None = FitOptions.kl_patience
    val_sequences: int = FitOptions.kl_val_sequences
    min_prefix: int = FitOptions.kl_min_prefix
    cache_references: bool = FitOptions.kl_cache_references
    seed: int = FitOptions.seed

    def settings(self) -> dict[str, Any]:
        """What the fine-tune records (validated; raises `ValueError` naming the first bad value)."""
        names = ("steps", "lr", "batch_size", "eval_every", "patience", "val_sequences", "min_prefix", "seed")
        recorded = finetune_settings(*(getattr(self, name) for name in names), self.cache_references)
        return recorded | {
            "loss": "KL(target own cache || target mapped cache), next-token distributions after the cut"
        }


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def mapped_kl(
    mapper,
    source_model,
    target_model,
    input_ids: torch.Tensor,
    split: int,
    reference: torch.Tensor | None = None,
    source_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    r"""
    Mean per-token `KL(p_own || p_mapped)` of the target's next-token distributions on `input_ids[:, split:]`, where
    `p_own` reads the target's own cache of `input_ids[:, :split]` and `p_mapped` reads the mapper's map of the
    source's. Differentiable in the mapper's parameters when gradients are enabled (the models are never updated).

    Args:
        mapper ([`MapperModel`]): the mapper (its `forward`).
        source_model, target_model (`PreTrainedModel`): the pair.
        input_ids (`torch.Tensor`): `(batch, T)` unpadded token ids.
        split (`int`): the first token the target reads itself, `1 <= split < T`.
        reference (`torch.Tensor`, *optional*): the target's own next-token log-probabilities `(batch, T, vocab)` of
            `input_ids`, if already computed.
        source_kv (list of `(keys, values)`, *optional*): the source's cache of `input_ids`, if already computed
            (a causal model's cache of a prefix is the prefix of its cache).
    """
    batch, length = input_ids.shape
    if not 1 <= split < length:
        raise ValueError(f"split={split} must cut the sequences of length {length} into two non-empty parts.")
    device = next(target_model.parameters()).device
    input_ids = input_ids.to(device)
    with torch.no_grad():
        if reference is None:
            reference = _log_probs(target_model(input_ids=input_ids).logits[:, split:])
        else:
            reference = reference[:, split:].to(device)
        if source_kv is None:
            source_cache = output_cache(source_model(input_ids=input_ids[:, :split], use_cache=True))
            source_kv = [(layer.keys, layer.values) for layer in source_cache.layers]
    keys = [k[:, :, :split] for k, _ in source_kv]
    values = [v[:, :, :split] for _, v in source_kv]
    position_ids = torch.arange(split, device=keys[0].device).expand(batch, split)
    mapped = mapper(keys, values, position_ids, dtype=torch.float32)
    cache = DynamicCache(ddp_cache_data=mapped)
    logits = target_model(input_ids=input_ids[:, split:], **cache_kwargs(cache)).logits
    log_q = _log_probs(logits)
    return (reference.exp() * (reference - log_q)).sum(-1).mean()


class _References:
    """The target's own log-probabilities and the source's cache of every row, computed once (`cache=True`) or on
    demand."""

    def __init__(self, source_model, target_model, rows: torch.Tensor, cache: bool, batch_size: int):
        self.rows, self.data = rows, None
        if cache:
            self.data = []
            with torch.no_grad():
                for chunk in rows.split(batch_size):
                    device = next(target_model.parameters()).device
                    reference = _log_probs(target_model(input_ids=chunk.to(device)).logits).cpu()
                    source_cache = output_cache(source_model(input_ids=chunk, use_cache=True))
                    kv = [(layer.keys.cpu(), layer.values.cpu()) for layer in source_cache.layers]
                    self.data.append((reference, kv))
            self.reference = torch.cat([reference for reference, _ in self.data])
            self.kv = [
                (torch.cat([kv[i][0] for _, kv in self.data]), torch.cat([kv[i][1] for _, kv in self.data]))
                for i in range(len(self.data[0][1]))
            ]
            self.data = True

    def take(self, index: torch.Tensor) -> dict:
        if self.data is None:
            return {}
        return {"reference": self.reference[index], "source_kv": [(k[index], v[index]) for k, v in self.kv]}


@torch.no_grad()
def held_out_kl(
    mapper, source_model, target_model, rows: torch.Tensor, splits, batch_size: int, references=None
) -> float:
    """Mean [`mapped_kl`] over `rows`, each cut at every point of `splits` (token-weighted per split)."""
    total, count = 0.0, 0
    for split in splits:
        for index in torch.arange(len(rows)).split(batch_size):
            chunk = rows[index]
            extra = references.take(index) if references is not None else {}
            tokens = chunk.shape[0] * (chunk.shape[1] - split)
            total += mapped_kl(mapper, source_model, target_model, chunk, split, **extra).item() * tokens
            count += tokens
    return total / count


def kl_finetune(
    mapper,
    source_model,
    target_model,
    calibration: Iterable,
    *,
    steps: int = FitOptions.kl_steps,
    lr: float = FitOptions.kl_lr,
    batch_size: int = FitOptions.kl_batch_size,
    eval_every: int = FitOptions.kl_eval_every,
    patience: int | None = FitOptions.kl_patience,
    val_sequences: int = FitOptions.kl_val_sequences,
    min_prefix: int = FitOptions.kl_min_prefix,
    seed: int = FitOptions.seed,
    cache_references: bool = FitOptions.kl_cache_references,
    progress: bool = True,
) -> KLFinetuneResult:
    r"""
    Fine-tune `mapper` in place by the end-to-end objective (see the module docstring), streaming: each step maps a
    fresh source prefill of `batch_size` sequences cut at a random point, so nothing but the sequences is held.

    Adam on every mapper parameter that requires gradients (the target's key-norm weights are buffers and stay);
    the models are frozen for the duration and restored afterwards. Every `eval_every` steps the KL on
    `val_sequences` held-out sequences (cut at a quarter, half and three quarters) is measured; the best state is
    kept and restored, and training stops after `patience` evaluations without improvement.

    Args:
        mapper ([`MapperModel`]): a fitted mapper (float32 is advised: Adam updates are small).
        source_model, target_model (`PreTrainedModel`): the pair the mapper maps between.
        calibration (iterable): `(batch, T)` token-id batches of one length `T > 2 * min_prefix`, unpadded (see
            [`calibration_rows`]); they should hold the kind of context the target must read back (e.g. facts
            asked about later).
        steps (`int`): the most optimizer steps.
        lr (`float`): Adam's learning rate.
        batch_size (`int`): sequences per step.
        eval_every (`int`): steps between held-out evaluations.
        patience (`int`, *optional*): evaluations without a new best (among the trained states) before stopping
            (`None`: never stop early).
        val_sequences (`int`): sequences held out (a seeded choice).
        min_prefix (`int`): the shortest mapped prefix and the shortest suffix; the cut is uniform in between.
        seed (`int`): seeds the held-out choice, the batches and the cuts.
        cache_references (`bool`): compute the target's own log-probabilities and the source's cache of every
            sequence once and keep them (`N * T * (vocab + source K/V)` floats) instead of recomputing them each step:
            about a third less compute per step where they fit in memory.
        progress (`bool`): tqdm progress bar.

    Returns:
        [`KLFinetuneResult`]; it is also recorded in `mapper.config.calibration["kl_finetune"]`.
    """
    options = KLOptions(steps, lr, batch_size, eval_every, patience, val_sequences, min_prefix, cache_references, seed)
    return run_finetune(KLObjective, mapper, source_model, target_model, calibration, options.settings(), progress)


@register_objective
class KLObjective(Objective):
    """`"kl"`: the end-to-end objective of [`kl_finetune`] (see the module docstring)."""

    name = "kl"
    function = staticmethod(kl_finetune)
    options_class = KLOptions
    fit_options_prefix = "kl_"
    label = "KL"
    desc = "KL fine-tune"
    metric = "val_kl"
    train_metric = "train_kl"
    measure = "KL"

    def __init__(self, mapper, source_model, target_model, data: CalibrationSplit, settings: dict[str, Any]):
        super().__init__(mapper, source_model, target_model, data, settings)
        cache, batch_size = settings["cache_references"], settings["batch_size"]
        self.train_refs = _References(source_model, target_model, data.train_rows, cache, batch_size)
        self.val_refs = _References(source_model, target_model, data.val_rows, cache, batch_size)

    def step_loss(self, step: int) -> torch.Tensor:
        index, split = self.data.draw(self.settings["batch_size"])
        rows = self.data.train_rows[index]
        return mapped_kl(self.mapper, self.source_model, self.target_model, rows, split, **self.train_refs.take(index))

    def evaluate(self) -> float:
        data, batch_size = self.data, self.settings["batch_size"]
        return held_out_kl(
            self.mapper, self.source_model, self.target_model, data.val_rows, data.splits, batch_size, self.val_refs
        )

    def result(self, run, seconds: float) -> KLFinetuneResult:
        return KLFinetuneResult(
            settings=self.settings,
            initial_val_kl=run.initial,
            best_val_kl=run.best,
            best_step=run.best_unit,
            steps_run=run.units_run,
            seconds=seconds,
            sequences_train=len(self.data.train_rows),
            sequences_val=len(self.data.val_rows),
            sequence_length=self.data.length,
            history=run.history,
        )


__all__ = [
    "KLFinetuneResult",
    "KLObjective",
    "KLOptions",
    "calibration_rows",
    "held_out_kl",
    "kl_finetune",
    "mapped_kl",
]
