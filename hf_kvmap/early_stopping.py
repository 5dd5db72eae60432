"""The one early-stopping training loop: the MLP mapper's epochs (`hf_kvmap.kinds.mlp`) and the fine-tunes of
`hf_kvmap.objectives` (end-to-end KL, per-layer attention output) all run [`train_with_early_stopping`].

Its rule, once: the state kept is the best on the held-out measure *including the starting state* (a fine-tune
never returns worse than the fit it started from), while patience counts evaluations without a new best among the
*trained* ones only (so a first step that knocks the module off its start does not end training before it
recovers).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StoppingResult:
    """What [`train_with_early_stopping`] did.

    Attributes:
        initial (`float`): the held-out measure of the starting state (`nan` without `evaluate`).
        best (`float`): the held-out measure of the state kept (`nan` without `evaluate`).
        best_unit (`int`): the unit (step or epoch) of the state kept; 0 is the starting state.
        units_run (`int`): units actually run (early stopping may end before `units`).
        history (`list[dict]`): one record per evaluation point: `{unit: i, **training fields, metric: value,
            "seconds": ...}` (seconds with `clock`).
        seconds (`float`): wall-clock time of the loop.
    """

    initial: float
    best: float
    best_unit: int
    units_run: int
    history: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def train_with_early_stopping(
    module: torch.nn.Module,
    train_unit: Callable[[int], dict[str, float]],
    evaluate: Callable[[], float] | None,
    *,
    units: int,
    eval_every: int = 1,
    patience: int | None = None,
    unit: str = "step",
    metric: str = "val",
    bar=None,
    clock: bool = True,
) -> StoppingResult:
    r"""
    Run `train_unit(1) .. train_unit(units)` on `module`, evaluate every `eval_every` units (and after the last),
    keep the best state and restore it at the end.

    Args:
        module (`torch.nn.Module`): what is trained; its `state_dict` is what is kept and restored.
        train_unit (`Callable[[int], dict]`): runs one unit (an optimizer step, an epoch) and returns the training
            fields of its record (e.g. `{"train_kl": ...}`).
        evaluate (`Callable[[], float]`, *optional*): the held-out measure, lower is better. `None`: no
            validation; every unit runs and the last state is kept.
        units (`int`): the most units.
        eval_every (`int`): units between evaluations.
        patience (`int`, *optional*): stop after this many evaluations without a new best among the trained states
            (`None`: never stop early).
        unit (`str`): the name of the unit in the history records (`"step"`, `"epoch"`).
        metric (`str`): the name of the held-out measure in the history records (`"val_kl"`, `"val_mse"`).
        bar (`tqdm`, *optional*): advanced by one per unit (and by the units skipped on an early stop), its postfix
            showing the measure.
        clock (`bool`): record the seconds since the start in each history record (`False`: records that are equal
            between equal runs).

    Returns:
        [`StoppingResult`].
    """
    started = time.perf_counter()
    nan = float("nan")
    initial = best = evaluate() if evaluate is not None else nan
    best_state = _copy_state(module) if evaluate is not None else None
    best_trained = math.inf
    best_unit, stale, units_run = 0, 0, 0
    history: list[dict[str, Any]] = []
    for index in range(1, units + 1):
        record = {unit: index, **train_unit(index)}
        units_run = index
        if bar is not None:
            bar.update(1)
        if index % eval_every and index != units:
            continue
        if evaluate is not None:
            value = evaluate()
            record[metric] = value
            if value < best:
                best, best_unit, best_state = value, index, _copy_state(module)
            if value < best_trained:
                best_trained, stale = value, 0
            else:
                stale += 1
            if bar is not None:
                bar.set_postfix({metric: f"{value:.4g}", "best": f"{best:.4g}"}, refresh=False)
        if clock:
            record["seconds"] = time.perf_counter() - started
        history.append(record)
        if evaluate is not None and patience is not None and stale >= patience:
            break
    if bar is not None and units_run < units:
        bar.update(units - units_run)
    if best_state is not None:
        with torch.no_grad():
            module.load_state_dict(best_state)
    else:
        best_unit = units_run
    return StoppingResult(initial, best, best_unit, units_run, history, time.perf_counter() - started)


def _copy_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


__all__ = ["StoppingResult", "train_with_early_stopping"]
