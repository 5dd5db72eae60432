"""The read-back KL fine-tune at length (issue 54, "a map that carries the context"): a fitted mapper trained so that
the frozen target, reading the last turn of a long conversation through the mapped cache of everything before it,
predicts what it predicts from its own cache.

- [`RowStore`] (`rows`): the rows, each a long prefix and a tail, with the source's cache of the prefix and the
  target's top-k distributions on the tail computed once and kept on disk ([`teacher_topk`], [`topk_kl`]).
- [`long_kl_finetune`] (`train`): Adam on the mapper through the frozen target, one row a step, held-out early
  stopping, checkpoints and a time budget; the result recorded in `config.calibration["long_kl_finetune"]`.

Not an entry of `hf_kvmap.finetune.OBJECTIVE_REGISTRY`: see `train`'s docstring for why.
"""

from __future__ import annotations

from .rows import RowStore, prepare_row, tail_start, teacher_topk, topk_kl
from .train import LongKLOptions, LongKLResult, held_out_kl, long_kl_finetune, row_kl, split_rows, step_rows

__all__ = [
    "LongKLOptions",
    "LongKLResult",
    "RowStore",
    "held_out_kl",
    "long_kl_finetune",
    "prepare_row",
    "row_kl",
    "split_rows",
    "step_rows",
    "tail_start",
    "teacher_topk",
    "topk_kl",
]
