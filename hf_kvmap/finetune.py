"""What every fine-tune of a fitted mapper shares (`hf_kvmap.objectives.kl`: end-to-end KL;
`hf_kvmap.objectives.attention`: per-layer attention output): the calibration as fixed-length rows, the seeded
held-out split and cut points, the frozen models, the optimizer loop with held-out early stopping
(`hf_kvmap.early_stopping`) and progress, and the one fine-tune loop [`run_finetune`] every objective runs. An
objective is one [`Objective`] subclass in its own file, registered with [`register_objective`].

Every objective cuts a calibration sequence at a point `p`: the source prefills tokens `< p`, the mapper maps that
cache, and the target reads tokens `>= p` on top of it, as in serving. Training cuts at a uniform random point
between `min_prefix` and `T - min_prefix`; held-out sequences are cut at a quarter, half and three quarters.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from .configuration_mapper import check_int, check_number
from .early_stopping import StoppingResult, train_with_early_stopping
from .features import unpack_batch
from .registry import registrar

logger = logging.get_logger(__name__)


def calibration_rows(calibration: Iterable, objective: str = "KL") -> torch.Tensor:
    """All calibration sequences as one `(N, T)` LongTensor; refuses padded or unequal-length sequences (the
    fine-tunes cut every sequence at shared points)."""
    rows = []
    for batch in calibration:
        input_ids, attention_mask = unpack_batch(batch)
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(
                f"The {objective} objective takes unpadded sequences of one length; this calibration batch is padded. "
                "Cut the calibration text into fixed-length sequences (e.g. `hf_kvmap.zoo.calibration_batches`)."
            )
        rows.append(input_ids)
    lengths = sorted({int(r.shape[1]) for r in rows})
    if len(lengths) != 1:
        raise ValueError(
            f"The {objective} objective takes sequences of one length; the calibration has lengths {lengths}."
        )
    return torch.cat(rows)


@dataclass
class CalibrationSplit:
    """The calibration of one fine-tune: training and held-out rows, the held-out cut points, the seeded generator
    that draws the batches and training cuts."""

    train_rows: torch.Tensor
    val_rows: torch.Tensor
    splits: list[int]
    min_prefix: int
    generator: torch.Generator

    @property
    def length(self) -> int:
        return int(self.train_rows.shape[1])

    def draw(self, batch_size: int) -> tuple[torch.Tensor, int]:
        """`(row indices, cut)` of one training step."""
        index = torch.randint(len(self.train_rows), (batch_size,), generator=self.generator)
        cut = int(torch.randint(self.min_prefix, self.length - self.min_prefix + 1, (), generator=self.generator))
        return index, cut


def finetune_settings(
    steps: int,
    lr: float,
    batch_size: int,
    eval_every: int,
    patience: int | None,
    val_sequences: int,
    min_prefix: int,
    seed: int,
    cache_references: bool,
) -> dict[str, Any]:
    """The settings every fine-tune records (and its optimizer); raises `ValueError` naming the first bad one."""
    check_int("steps", steps, 0)
    check_number("lr", lr, 0, strict=True)
    check_int("batch_size", batch_size, 1)
    check_int("eval_every", eval_every, 1)
    check_int("patience", patience, 0, allow_none=True)
    check_int("val_sequences", val_sequences, 1)
    check_int("min_prefix", min_prefix, 1)
    names = ("steps", "lr", "batch_size", "eval_every", "patience", "val_sequences", "min_prefix", "seed")
    values = (steps, lr, batch_size, eval_every, patience, val_sequences, min_prefix, seed)
    return dict(zip(names, values)) | {"cache_references": bool(cache_references), "optimizer": "adam"}


def split_calibration(calibration: Iterable, settings: dict[str, Any], objective: str) -> CalibrationSplit:
    """The rows of `calibration` ([`calibration_rows`]) split into training and `settings["val_sequences"]` held-out
    rows (a choice seeded by `settings["seed"]`), with the held-out cut points; refuses too few or too short
    sequences."""
    val_sequences, min_prefix, seed = settings["val_sequences"], settings["min_prefix"], settings["seed"]
    rows = calibration_rows(calibration, objective)
    count, length = rows.shape
    if count <= val_sequences:
        raise ValueError(
            f"The {objective} objective holds out val_sequences={val_sequences} sequences but the calibration has "
            f"{count}; pass more sequences or a smaller val_sequences."
        )
    if length <= 2 * min_prefix:
        raise ValueError(f"Sequences of {length} tokens are too short for min_prefix={min_prefix} on both sides.")
    generator = torch.Generator().manual_seed(int(seed))
    order = torch.randperm(count, generator=generator)
    splits = sorted({max(min_prefix, min(length - min_prefix, round(length * f))) for f in (0.25, 0.5, 0.75)})
    return CalibrationSplit(rows[order[val_sequences:]], rows[order[:val_sequences]], splits, min_prefix, generator)


@contextmanager
def frozen(*models):
    """No gradient into `models`' parameters for the duration; their `requires_grad` flags are restored after."""
    flags = [(p, p.requires_grad) for model in models for p in model.parameters()]
    for param, _ in flags:
        param.requires_grad_(False)
    try:
        yield
    finally:
        for param, flag in flags:
            param.requires_grad_(flag)


def optimize(
    mapper,
    step_loss: Callable[[int], torch.Tensor],
    evaluate: Callable[[], float],
    settings: dict[str, Any],
    *,
    desc: str,
    metric: str,
    train_metric: str,
    lr_option: str,
    progress: bool,
) -> StoppingResult:
    """Adam (`settings["lr"]`) on every mapper parameter that requires gradients, one `step_loss(step)` per step
    (back-propagated here, or, returned without a graph, by `step_loss` itself as it went)
    for at most `settings["steps"]`, held-out early stopping on `evaluate` every `settings["eval_every"]` steps with
    `settings["patience"]`, keeping the best state ([`train_with_early_stopping`]). The history starts with the
    starting state (step 0)."""
    steps, lr, eval_every, patience = (settings[name] for name in ("steps", "lr", "eval_every", "patience"))
    params = [p for p in mapper.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)

    def train_step(step: int) -> dict[str, float]:
        optimizer.zero_grad(set_to_none=True)
        loss = step_loss(step)
        if not math.isfinite(loss.item()):
            raise ValueError(f"The {desc} loss became {loss.item()} at step {step}; lower {lr_option}.")
        if loss.requires_grad:  # else `step_loss` has back-propagated as it went (e.g. one layer at a time)
            loss.backward()
        optimizer.step()
        return {train_metric: loss.item()}

    bar = tqdm(total=steps, desc=desc, unit="step", disable=not progress)
    try:
        result = train_with_early_stopping(
            mapper,
            train_step,
            evaluate,
            units=steps,
            eval_every=eval_every,
            patience=patience,
            unit="step",
            metric=metric,
            bar=bar,
        )
    finally:
        bar.close()
    result.history.insert(0, {"step": 0, metric: result.initial, "seconds": 0.0})
    return result


# ------------------------------------------------------------------------------------------------ objectives
class Objective:
    r"""
    One fine-tuning objective of a fitted mapper, run by [`run_finetune`] on a [`CalibrationSplit`] with the models
    frozen. A subclass, in its own file under `hf_kvmap/objectives/`, names itself and its options and computes a
    training step's loss and the held-out measure; [`register_objective`] makes it a stage of `FitOptions.objective`.

    Class attributes:
        name (`str`): the stage name (`FitOptions.objective`, and `"<name>_finetune"` in the mapper's calibration
            record).
        function (`Callable`): its public fine-tune function, `(mapper, source_model, target_model, calibration,
            *, progress, **options) -> result`, which runs [`run_finetune`].
        options_class (`type`): its options dataclass; its fields are the `FitOptions` fields
            `fit_options_prefix + field` (and the shared `seed`).
        fit_options_prefix (`str`): e.g. `"kl_"`.
        label (`str`): how errors name it (`"The KL objective takes ..."`).
        desc, metric, train_metric, measure (`str`): the progress bar, the held-out and training metric names of the
            history, and what the log line calls the held-out measure.
    """

    name: ClassVar[str]
    function: ClassVar[Callable]
    options_class: ClassVar[type]
    fit_options_prefix: ClassVar[str]
    label: ClassVar[str]
    desc: ClassVar[str]
    metric: ClassVar[str]
    train_metric: ClassVar[str]
    measure: ClassVar[str]

    def __init__(self, mapper, source_model, target_model, data: CalibrationSplit, settings: dict[str, Any]):
        self.mapper, self.source_model, self.target_model = mapper, source_model, target_model
        self.data, self.settings = data, settings

    def step_loss(self, step: int) -> torch.Tensor:
        """The loss of one training step (see [`optimize`])."""
        raise NotImplementedError

    def evaluate(self) -> float:
        """The held-out measure of the mapper's current state."""
        raise NotImplementedError

    def finish(self) -> None:
        """Anything measured on the best state once training is over (models still frozen)."""

    def result(self, run: StoppingResult, seconds: float):
        """The objective's result record (a dataclass with `to_dict`)."""
        raise NotImplementedError

    @classmethod
    def settings_from(cls, options) -> dict[str, Any]:
        """The keyword settings of this objective's fine-tune function taken from a `FitOptions`."""
        return {
            field.name: getattr(options, field.name if field.name == "seed" else cls.fit_options_prefix + field.name)
            for field in dataclasses.fields(cls.options_class)
        }


#: Every fine-tuning objective by stage name; filled by [`register_objective`] as `hf_kvmap.objectives` loads.
OBJECTIVE_REGISTRY: dict[str, type[Objective]] = {}


#: Class decorator: make `cls` the objective of stage `cls.name` (refusing a second one of the same name).
register_objective = registrar(OBJECTIVE_REGISTRY, "an objective")


def run_finetune(
    objective: type[Objective],
    mapper,
    source_model,
    target_model,
    calibration: Iterable,
    settings: dict[str, Any],
    progress: bool = True,
):
    """The one fine-tune loop: split the calibration ([`split_calibration`]), freeze both models, build the
    `objective` on the split, [`optimize`] the mapper by its step loss with held-out early stopping on its measure,
    then record its result in `mapper.config.calibration["<name>_finetune"]` and return it."""
    data = split_calibration(calibration, settings, objective.label)
    started = time.perf_counter()
    with frozen(source_model, target_model):
        run_state = objective(mapper, source_model, target_model, data, settings)
        run = optimize(
            mapper,
            run_state.step_loss,
            run_state.evaluate,
            settings,
            desc=objective.desc,
            metric=objective.metric,
            train_metric=objective.train_metric,
            lr_option=f"{objective.fit_options_prefix}lr",
            progress=progress,
        )
        run_state.finish()
    result = run_state.result(run, time.perf_counter() - started)
    logger.info(
        f"{objective.desc[0].upper()}{objective.desc[1:]}: held-out {objective.measure} {run.initial:.4g} -> "
        f"{run.best:.4g} (best step {run.best_unit} of {run.units_run})."
    )
    mapper.config.calibration = {**mapper.config.calibration, f"{objective.name}_finetune": result.to_dict()}
    return result


__all__ = [
    "OBJECTIVE_REGISTRY",
    "CalibrationSplit",
    "Objective",
    "calibration_rows",
    "finetune_settings",
    "frozen",
    "optimize",
    "register_objective",
    "run_finetune",
    "split_calibration",
]
