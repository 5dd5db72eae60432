"""The fine-tuning objectives of a fitted mapper, one file each with its own options dataclass, behind one
registration (`hf_kvmap.finetune.register_objective`), all run by the one loop `hf_kvmap.finetune.run_finetune`:

- `kl` ([`kl_finetune`]): the frozen target reading the mapped cache reproduces its own next-token distributions.
- `attention` ([`attention_finetune`]): in every target layer, the target's own queries read the same attention
  output from the mapped cache as from its own.

A new objective is one file here with an `Objective` subclass decorated with `register_objective`, imported below.
"""

from __future__ import annotations

import dataclasses

import torch

from ..finetune import OBJECTIVE_REGISTRY, calibration_rows
from ..modeling_mapper import MapperModel
from .attention import (
    AttentionFinetuneResult,
    AttentionObjective,
    AttentionOptions,
    AttentionReads,
    attention_errors,
    attention_finetune,
    held_out_attention_error,
    target_reads,
)
from .kl import KLFinetuneResult, KLObjective, KLOptions, held_out_kl, kl_finetune, mapped_kl

#: The fine-tune of each objective stage (`FitOptions.objective_stages`), as `(function, settings of FitOptions)`: a
#: view of `OBJECTIVE_REGISTRY`.
FINETUNES = {name: (cls.function, cls.settings_from) for name, cls in sorted(OBJECTIVE_REGISTRY.items())}


def finetune_fitted(fitted, source_model=None, target_model=None, calibration=None, progress: bool = True):
    """A `FittedMapper` fitted with a fine-tuning objective (`"kl"`, `"attention"`, `"attention+kl"`) packaged as a
    `MapperModel` in float32, fine-tuned by each stage's function of `FINETUNES` in turn with its options on
    `calibration`, then cast to the dtype it was fitted for."""
    options = fitted.options
    if source_model is None or target_model is None or calibration is None:
        raise ValueError(
            f"objective={options.objective!r} fine-tunes with both models: pass source_model, target_model and "
            "calibration."
        )
    calibration = list(calibration)
    model = MapperModel.from_fitted(dataclasses.replace(fitted, dtype=torch.float32, options=None))
    for stage in options.objective_stages:
        finetune, settings = FINETUNES[stage]
        finetune(model, source_model, target_model, calibration, progress=progress, **settings(options))
    return model.to(fitted.dtype).eval()


__all__ = [
    "FINETUNES",
    "OBJECTIVE_REGISTRY",
    "AttentionFinetuneResult",
    "AttentionObjective",
    "AttentionOptions",
    "AttentionReads",
    "KLFinetuneResult",
    "KLObjective",
    "KLOptions",
    "attention_errors",
    "attention_finetune",
    "calibration_rows",
    "finetune_fitted",
    "held_out_attention_error",
    "held_out_kl",
    "kl_finetune",
    "mapped_kl",
    "target_reads",
]
