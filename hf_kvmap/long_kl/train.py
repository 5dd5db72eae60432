"""The read-back KL fine-tune at length: the frozen target reads each row's tail through the mapped cache of its long
prefix, and the mapper is trained so that the target's next-token distributions there match its own
(`KL(own || mapped)` over the teacher's top-k, [`topk_kl`]), one row (or `batch_rows`) per Adam step.

Everything a step would otherwise recompute, the source's prefill of the prefix and the target's exact prefill of
the whole row, is read from a [`RowStore`]; a step costs the mapper on the prefix, the target on the tail (with its
backward into the mapped cache, the target's weights frozen) and the mapper's backward. Held-out rows decide early
stopping by the rule of `hf_kvmap.early_stopping` (the best state including the starting one is kept; patience counts
evaluations without a new best among the trained states). The run checkpoints at every evaluation and when
`max_minutes` is up (the mapper, Adam's state, the best state and the counters, in one folder swapped in atomically),
and a later call with the same checkpoint resumes to the same weights an uninterrupted run reaches.

Why not `hf_kvmap.finetune.run_finetune`: its objectives take an in-memory calibration of equal-length rows cut at
random points and recompute or keep every reference in memory, and its loop (`train_with_early_stopping`) has no
checkpoint or time budget; at 4K a row's references cost a full prefill of both models and 50-100 MB, so here they
live on disk and the loop resumes. It shares `finetune.frozen` and the early-stopping rule.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.utils import logging

from .._compat import cache_kwargs
from ..atomic import write_folder_atomically
from ..finetune import frozen
from ..validation import check_int, check_number
from .rows import RowStore, topk_kl

logger = logging.get_logger(__name__)

STATE_FILE, RECORD_FILE = "state.safetensors", "state.json"
LOSS = "KL(target own cache || target mapped cache of the prefix), next-token distributions of the tail, teacher top-k"


@dataclass
class LongKLOptions:
    """The settings of [`long_kl_finetune`] (see it for each); `settings()` validates them."""

    steps: int = 60
    lr: float = 1e-4
    batch_rows: int = 1
    eval_every: int = 10
    patience: int | None = 3
    val_rows: int = 2
    seed: int = 0

    def settings(self) -> dict[str, Any]:
        """What the fine-tune records; raises `ValueError` naming the first bad value."""
        check_int("steps", self.steps, 0)
        check_number("lr", self.lr, 0, strict=True)
        check_int("batch_rows", self.batch_rows, 1)
        check_int("eval_every", self.eval_every, 1)
        check_int("patience", self.patience, 0, allow_none=True)
        check_int("val_rows", self.val_rows, 1)
        check_int("seed", self.seed, 0)
        return asdict(self) | {"optimizer": "adam", "loss": LOSS}


@dataclass
class LongKLResult:
    """What [`long_kl_finetune`] did: its settings and rows, the held-out KL before and after, the best step, whether
    it finished (`False`: stopped by `max_minutes` at a checkpoint), and the history (every step's training KL and
    seconds, the held-out KL and its seconds at each evaluation, the seconds since the start)."""

    settings: dict[str, Any]
    rows: dict[str, Any]
    base_content_hash: str | None
    initial_val_kl: float
    best_val_kl: float
    best_step: int
    steps_run: int
    finished: bool
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def row_kl(mapper, target_model, row: dict) -> torch.Tensor:
    r"""
    Mean per-token [`topk_kl`] of one row's tail: the mapper maps the row's source cache of the prefix (positions
    `0 .. prefix-1`, in the target's dtype), the target reads the tail on top of it. Differentiable in the mapper's
    parameters (the target is never updated; freeze it, [`hf_kvmap.finetune.frozen`], so no gradient lands there).

    Args:
        mapper ([`MapperModel`]): the mapper.
        target_model (`PreTrainedModel`): the target.
        row (`dict`): a row of [`RowStore.row`].
    """
    prefix, ids = row["prefix"], row["input_ids"]
    device = next(mapper.parameters()).device
    keys = [k.to(device) for k, _ in row["source_kv"]]
    values = [v.to(device) for _, v in row["source_kv"]]
    position_ids = torch.arange(prefix, device=device)[None]
    mapped = mapper(keys, values, position_ids, dtype=next(target_model.parameters()).dtype)
    target_device = next(target_model.parameters()).device
    cache = DynamicCache(ddp_cache_data=mapped)
    logits = target_model(input_ids=ids[None, prefix:].to(target_device), **cache_kwargs(cache)).logits[0]
    indices, logprobs, rest = (t.to(logits.device) for t in row["teacher"])
    return topk_kl(indices, logprobs, rest, logits).mean()


@torch.no_grad()
def held_out_kl(mapper, target_model, store: RowStore, rows) -> float:
    """Mean [`row_kl`] over `rows` of `store` (every tail has the store's `tail` tokens, so this is per token)."""
    return sum(row_kl(mapper, target_model, store.row(int(i))).item() for i in rows) / len(rows)


def split_rows(count: int, val_rows: int, seed: int) -> tuple[list[int], list[int]]:
    """`(train, held out)` row indices: a seeded choice of `val_rows` of `count` rows held out."""
    if count <= val_rows:
        raise ValueError(f"The store has {count} rows and val_rows={val_rows} are held out; prepare more rows.")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[val_rows:]), sorted(order[:val_rows])


def step_rows(train: list[int], step: int, batch_rows: int, seed: int) -> list[int]:
    """The rows of training step `step` (1-based): the training rows in a fresh seeded order every pass, `batch_rows`
    at a time; a function of its arguments alone, so a resumed run draws what the uninterrupted one drew."""
    rows = []
    for position in range((step - 1) * batch_rows, step * batch_rows):
        epoch, offset = divmod(position, len(train))
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed * 100_003 + epoch + 1))
        rows.append(train[int(order[offset])])
    return rows


def _params(mapper) -> list[tuple[str, torch.nn.Parameter]]:
    named = [(name, p) for name, p in mapper.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("The mapper has no parameter that requires gradients; call `mapper.requires_grad_(True)`.")
    return named


def _save_checkpoint(folder: Path, named, optimizer, best: dict, state: dict) -> None:
    tensors = {f"current.{name}": p.detach().contiguous() for name, p in named}
    tensors |= {f"best.{name}": t.contiguous() for name, t in best.items()}
    for index, slot in optimizer.state_dict()["state"].items():
        tensors |= {f"adam.{index}.{key}": torch.as_tensor(value).contiguous() for key, value in slot.items()}

    def write(staging: Path) -> None:
        save_file(
            {k: t.cpu().clone() for k, t in tensors.items()}, str(staging / STATE_FILE), metadata={"format": "pt"}
        )
        (staging / RECORD_FILE).write_text(json.dumps(state, indent=1))

    write_folder_atomically(folder, write)


def _load_checkpoint(folder: Path, named, optimizer, identity: dict) -> tuple[dict, dict]:
    state = json.loads((folder / RECORD_FILE).read_text())
    if state["identity"] != identity:
        changed = sorted(k for k in identity if state["identity"].get(k) != identity[k])
        raise ValueError(
            f"The checkpoint in {folder} is of another fine-tune (it differs in {changed}); pass the settings, rows "
            "and base map it was made with, or another checkpoint folder (or remove it to start over)."
        )
    tensors = load_file(str(folder / STATE_FILE))
    with torch.no_grad():
        for name, param in named:
            param.copy_(tensors[f"current.{name}"])
    best = {name[len("best.") :]: t for name, t in tensors.items() if name.startswith("best.")}
    saved = optimizer.state_dict()
    slots: dict[int, dict] = {}
    for name, tensor in tensors.items():
        if name.startswith("adam."):
            _, index, key = name.split(".", 2)
            slots.setdefault(int(index), {})[key] = tensor
    optimizer.load_state_dict({"state": slots, "param_groups": saved["param_groups"]})
    return best, state


def long_kl_finetune(
    mapper,
    target_model,
    store: RowStore,
    *,
    steps: int = LongKLOptions.steps,
    lr: float = LongKLOptions.lr,
    batch_rows: int = LongKLOptions.batch_rows,
    eval_every: int = LongKLOptions.eval_every,
    patience: int | None = LongKLOptions.patience,
    val_rows: int = LongKLOptions.val_rows,
    seed: int = LongKLOptions.seed,
    checkpoint: str | Path | None = None,
    max_minutes: float | None = None,
    progress: bool = True,
) -> LongKLResult:
    r"""
    Fine-tune `mapper` in place on the prepared rows of `store` (see the module): Adam on every mapper parameter that
    requires gradients, [`row_kl`] of `batch_rows` training rows a step, the held-out KL of `val_rows` rows at step 0,
    every `eval_every` steps and the last; the best state is kept and, once the run is over, loaded into `mapper` and
    recorded in `mapper.config.calibration["long_kl_finetune"]`.

    Args:
        mapper ([`MapperModel`]): a fitted mapper (float32 advised: Adam's updates are small).
        target_model (`PreTrainedModel`): the target the rows' teacher was computed with; frozen for the duration.
        store ([`RowStore`]): the prepared rows (every row computed).
        steps (`int`): the most optimizer steps.
        lr (`float`): Adam's learning rate.
        batch_rows (`int`): rows per step (gradients accumulated one row at a time).
        eval_every (`int`): steps between held-out evaluations (and checkpoints).
        patience (`int`, *optional*): evaluations without a new best among the trained states before stopping.
        val_rows (`int`): rows held out (a choice seeded by `seed`).
        seed (`int`): seeds the held-out choice and the order of the training rows.
        checkpoint (`str` or `os.PathLike`, *optional*): a folder to checkpoint into and resume from (a checkpoint of
            other settings, rows or base map is refused).
        max_minutes (`float`, *optional*): stop after the first step that ends past this many minutes of this call,
            checkpointed (needs `checkpoint`); the result then has `finished=False` and `mapper` holds the current
            state, not the best.
        progress (`bool`): tqdm progress bar with the training and held-out KL.

    Returns:
        [`LongKLResult`].
    """
    settings = LongKLOptions(steps, lr, batch_rows, eval_every, patience, val_rows, seed).settings()
    if max_minutes is not None and checkpoint is None:
        raise ValueError("max_minutes stops at a checkpoint: pass `checkpoint` (a folder) too.")
    missing = store.missing()
    if missing:
        raise ValueError(f"Rows {missing[:5]} of {store.folder} are not prepared; call `store.prepare(...)` first.")
    train, val = split_rows(len(store), val_rows, seed)
    named = _params(mapper)
    optimizer = torch.optim.Adam([p for _, p in named], lr=lr)
    base_hash = getattr(mapper.config, "content_hash", None)
    rows = {k: store.settings[k] for k in ("rows", "seq_len", "tail", "top_k", "boundary", "sequences_sha256")}
    rows |= {"models": store.settings["models"], "train": train, "val": val}
    identity = {"settings": settings, "rows": rows, "base_content_hash": base_hash}
    folder = Path(checkpoint) if checkpoint is not None else None
    started = time.perf_counter()

    def best_state() -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in named}

    with frozen(target_model):
        if folder is not None and (folder / RECORD_FILE).is_file():
            best, state = _load_checkpoint(folder, named, optimizer, identity)
        else:
            initial = held_out_kl(mapper, target_model, store, val)
            evaluated = time.perf_counter() - started
            best = best_state()
            state = {"identity": identity, "step": 0, "initial": initial, "best": initial, "best_step": 0}
            state |= {"best_trained": math.inf, "stale": 0, "done": False, "seconds": 0.0}
            state["history"] = [{"step": 0, "val_kl": initial, "eval_seconds": evaluated, "seconds": evaluated}]
        previous_seconds = state["seconds"]
        bar = tqdm(
            total=steps, initial=state["step"], desc="KL fine-tune at length", unit="step", disable=not progress
        )
        try:
            while not state["done"] and state["step"] < steps:
                step, began = state["step"] + 1, time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                total = 0.0
                for index in step_rows(train, step, batch_rows, seed):
                    loss = row_kl(mapper, target_model, store.row(index))
                    if not math.isfinite(loss.item()):
                        raise ValueError(f"The KL became {loss.item()} at step {step} (row {index}); lower lr.")
                    (loss / batch_rows).backward()
                    total += loss.item() / batch_rows
                optimizer.step()
                state["step"] = step
                record = {"step": step, "train_kl": total, "step_seconds": time.perf_counter() - began}
                bar.update(1)
                bar.set_postfix({"train_kl": f"{total:.4g}", "best": f"{state['best']:.4g}"}, refresh=False)
                evaluate = step % eval_every == 0 or step == steps
                if evaluate:
                    began = time.perf_counter()
                    value = record["val_kl"] = held_out_kl(mapper, target_model, store, val)
                    record["eval_seconds"] = time.perf_counter() - began
                    if value < state["best"]:
                        state["best"], state["best_step"], best = value, step, best_state()
                    if value < state["best_trained"]:
                        state["best_trained"], state["stale"] = value, 0
                    else:
                        state["stale"] += 1
                    state["done"] = patience is not None and state["stale"] >= patience
                    bar.set_postfix({"val_kl": f"{value:.4g}", "best": f"{state['best']:.4g}"}, refresh=False)
                state["seconds"] = record["seconds"] = previous_seconds + time.perf_counter() - started
                state["history"].append(record)
                out_of_time = max_minutes is not None and time.perf_counter() - started > 60 * max_minutes
                if folder is not None and (evaluate or out_of_time or state["step"] == steps):
                    _save_checkpoint(folder, named, optimizer, best, state)
                if out_of_time and not state["done"] and state["step"] < steps:
                    break
        finally:
            bar.close()
    finished = state["done"] or state["step"] >= steps
    if finished:
        with torch.no_grad():
            for name, param in named:
                param.copy_(best[name])
    result = LongKLResult(
        settings=settings,
        rows=rows,
        base_content_hash=base_hash,
        initial_val_kl=state["initial"],
        best_val_kl=state["best"],
        best_step=state["best_step"],
        steps_run=state["step"],
        finished=finished,
        seconds=state["seconds"],
        history=state["history"],
    )
    if finished:
        mapper.config.calibration = {**(mapper.config.calibration or {}), "long_kl_finetune": result.to_dict()}
        logger.info(
            f"KL fine-tune at length: held-out KL {result.initial_val_kl:.4g} -> {result.best_val_kl:.4g} "
            f"(best step {result.best_step} of {result.steps_run})."
        )
    return result


__all__ = [
    "LongKLOptions",
    "LongKLResult",
    "held_out_kl",
    "long_kl_finetune",
    "row_kl",
    "split_rows",
    "step_rows",
]
