"""The rows of a fine-tune at length, computed once and kept on disk: each row is a long sequence cut into a context
prefix (the target will read it through the mapped cache) and a tail of `tail` tokens; the source's cache of the
prefix and the target's own next-token distributions on the tail are what a step needs, and both cost a full prefill
to compute (the 1.5B's at 4K: about 20 s on two cores), so they are computed once per row here and never again.

The teacher is kept as its top `top_k` log-probabilities per tail position plus the log of the mass left over
([`teacher_topk`]), not as the full vocabulary (151,936 entries a position for Qwen2.5). The KL it gives,
[`topk_kl`], is the KL between the two distributions coarsened to those `top_k` tokens and one "rest" bucket: never
more than the full KL, equal to it where `top_k` covers the vocabulary, and short of it by exactly
`rest_mass * KL(teacher's rest || student's rest)` (the chain rule of the KL; `tests/test_long_kl.py` checks both).
bfloat16 logits of the tail, the other way to keep it, cost `tail * vocab * 2` bytes a row (39 MB at a tail of 128)
and round every logit above 16 by up to 1/16, which moves every term of the KL; the top-k entries are exact float32
and the rest mass is recorded per position, so how much of the teacher the estimate leaves out is known. Measured on
Qwen2.5-Coder 0.5B -> 1.5B (the 5k ridge, two conversations of 1,024 tokens, a tail of 128, bfloat16): the top 64
tokens gave 0.77-0.93 of the full KL, the top 1,024 0.95-0.99 and the top 4,096 0.98-0.99 (`scale long-finetune`'s
default; 6 MB a row against the 4K source cache's 50 MB).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file
from tqdm.auto import tqdm

from .._compat import output_cache
from ..atomic import write_file_atomically, write_text_atomically
from ..validation import check_int

STORE_FILE = "rows.json"


def teacher_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""
    The teacher's next-token distributions as their `top_k` most likely tokens and the mass of the rest.

    Args:
        logits (`torch.Tensor`): `(..., vocab)` next-token logits.
        top_k (`int`): tokens kept per position, `1 <= top_k <= vocab`.

    Returns:
        `(indices, logprobs, rest)`: `(..., top_k)` int64 token ids, `(..., top_k)` float32 log-probabilities, and
        `(...)` float32 log of the probability of every other token (`-inf` where `top_k` is the vocabulary).
    """
    vocab = logits.shape[-1]
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k={top_k} must be between 1 and the vocabulary's {vocab}.")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, indices = logprobs.topk(top_k, dim=-1)
    rest = torch.logsumexp(logprobs.scatter(-1, indices, float("-inf")), dim=-1)
    return indices, values, rest


def topk_kl(
    indices: torch.Tensor, logprobs: torch.Tensor, rest: torch.Tensor, student_logits: torch.Tensor
) -> torch.Tensor:
    r"""
    `KL(teacher || student)` per position over the teacher's top-k tokens and one bucket for the rest (see the
    module): `sum_k p_k (log p_k - log q_k) + p_rest (log p_rest - log q_rest)`. Differentiable in `student_logits`.

    Args:
        indices, logprobs, rest (`torch.Tensor`): the teacher as [`teacher_topk`] returns it.
        student_logits (`torch.Tensor`): `(..., vocab)` the student's logits at the same positions.

    Returns:
        `torch.Tensor`: `(...)` float32, the KL of each position in nats.
    """
    if student_logits.shape[:-1] != indices.shape[:-1]:
        raise ValueError(
            f"The student's logits cover positions {tuple(student_logits.shape[:-1])}, the teacher's "
            f"{tuple(indices.shape[:-1])}; pass the logits of the same tail."
        )
    log_q = torch.log_softmax(student_logits.float(), dim=-1)
    log_q_top = log_q.gather(-1, indices)
    log_q_rest = torch.logsumexp(log_q.scatter(-1, indices, float("-inf")), dim=-1)
    top = (logprobs.exp() * (logprobs - log_q_top)).sum(-1)
    p_rest = rest.exp()
    tail = torch.where(p_rest > 0, p_rest * (rest - log_q_rest), torch.zeros_like(p_rest))
    return top + tail


def tail_start(ids: Sequence[int], tail: int, boundary: int | None = None) -> int:
    """Where a row's tail starts: with `boundary` (a turn's first token, e.g. `<|im_start|>`), the last turn start
    that leaves `tail` tokens after it and at least half the sequence before it; without one, `len(ids) - tail`.

    Raises:
        `ValueError`: no turn starts there (pass a longer sequence or a shorter tail, or no boundary).
    """
    length = len(ids)
    if not 1 <= tail < length // 2:
        raise ValueError(f"tail={tail} must be at least 1 and shorter than half the sequence ({length} tokens).")
    if boundary is None:
        return length - tail
    for start in range(length - tail, length // 2 - 1, -1):
        if int(ids[start]) == boundary:
            return start
    raise ValueError(
        f"No turn starts (token {boundary}) between token {length // 2} and token {length - tail} of a sequence of "
        f"{length}; pass a shorter tail, longer turns' sequences, or no turn boundary (the tail is then the end)."
    )


@torch.no_grad()
def prepare_row(source_model, target_model, ids: Sequence[int], start: int, tail: int, top_k: int) -> dict:
    """The tensors of one row: `input_ids` (the prefix and the tail, `start + tail` ids), the source's cache of the
    prefix (`source.keys.{i}`, `source.values.{i}`, `(1, n_kv, start, head_dim)` in the source's dtype) and the
    target's own distributions on the tail (`teacher.indices`, `teacher.logprobs`, `teacher.rest`, see
    [`teacher_topk`]; one full prefill of the row, logits kept for the tail only)."""
    row = torch.tensor([list(ids[: start + tail])], dtype=torch.long)
    device = next(target_model.parameters()).device
    logits = target_model(input_ids=row.to(device), use_cache=False, logits_to_keep=tail).logits[0]
    indices, logprobs, rest = teacher_topk(logits, top_k)
    source_device = next(source_model.parameters()).device
    cache = output_cache(source_model(input_ids=row[:, :start].to(source_device), use_cache=True, logits_to_keep=1))
    tensors = {"input_ids": row[0], "teacher.indices": indices.cpu(), "teacher.logprobs": logprobs.cpu()}
    tensors["teacher.rest"] = rest.cpu()
    for index, layer in enumerate(cache.layers):
        tensors[f"source.keys.{index}"] = layer.keys.cpu().contiguous()
        tensors[f"source.values.{index}"] = layer.values.cpu().contiguous()
    return tensors


def _save(tensors: dict, metadata: dict, path: Path) -> None:
    save_file(tensors, str(path), metadata=metadata)


def _digest(sequences: Sequence[Sequence[int]]) -> str:
    digest = hashlib.sha256()
    for ids in sequences:
        digest.update(json.dumps([int(i) for i in ids]).encode())
    return digest.hexdigest()


class RowStore:
    r"""
    The rows of a fine-tune at length in one folder: `rows.json` (the settings they were made with) and one
    `row-NNNNN.safetensors` per row ([`prepare_row`]), each written atomically as soon as it is computed, so a killed
    preparation resumes at the first missing row.

    Args:
        folder (`str` or `os.PathLike`): where the rows live.
        settings (`dict`): what the rows depend on (models, dtypes, lengths, `tail`, `top_k`, the boundary, the
            sequences' hash); a folder made with other settings is refused.

    Example:

    ```python
    store = RowStore.create("work/rows", sequences, tail=128, top_k=64, models={"source": "a", "target": "b"})
    store.prepare(source_model, target_model)  # resumes at the first missing row; returns its seconds per row
    row = store.row(0)
    ```
    """

    def __init__(self, folder, settings: dict, sequences: list[list[int]]):
        self.folder, self.settings, self.sequences = Path(folder), settings, sequences

    @classmethod
    def create(
        cls,
        folder,
        sequences: Sequence[Sequence[int]],
        *,
        tail: int,
        top_k: int,
        boundary: int | None = None,
        models: dict | None = None,
    ) -> RowStore:
        """The store of `sequences` cut by [`tail_start`] (`tail`, `boundary`) with a `top_k` teacher; `models`
        names the models and dtypes (recorded). Opens the folder's rows if they were made with the same settings;
        raises `ValueError` naming both if not."""
        if not sequences:
            raise ValueError("No sequences to build rows from; pass at least two (one is held out).")
        check_int("top_k", top_k, 1)
        sequences = [[int(i) for i in ids] for ids in sequences]
        starts = [tail_start(ids, tail, boundary) for ids in sequences]
        settings = {
            "rows": len(sequences),
            "seq_len": max(len(ids) for ids in sequences),
            "tail": tail,
            "top_k": top_k,
            "boundary": boundary,
            "starts": starts,
            "sequences_sha256": _digest(sequences),
            "models": models or {},
        }
        folder = Path(folder)
        record = folder / STORE_FILE
        if record.is_file():
            previous = json.loads(record.read_text())
            if previous != settings:
                changed = sorted(k for k in settings.keys() | previous.keys() if previous.get(k) != settings.get(k))
                raise ValueError(
                    f"{folder} holds rows made with other settings (they differ in {changed}); pass another work "
                    "folder, or the settings it was made with, or remove it to start over."
                )
        else:
            folder.mkdir(parents=True, exist_ok=True)
            write_text_atomically(record, json.dumps(settings, indent=1))
        return cls(folder, settings, sequences)

    def __len__(self) -> int:
        return len(self.sequences)

    def path(self, index: int) -> Path:
        return self.folder / f"row-{index:05d}.safetensors"

    def missing(self) -> list[int]:
        """The rows not yet computed."""
        return [index for index in range(len(self)) if not self.path(index).is_file()]

    def prepare(self, source_model, target_model, progress: bool = True, max_minutes: float | None = None) -> dict:
        """Compute and write every missing row, stopping after the first row that ends past `max_minutes` (the rest
        are computed by the next call). Returns `{row index: seconds}` of the rows computed by this call."""
        missing, seconds = self.missing(), {}
        started = time.perf_counter()
        for index in tqdm(missing, desc="rows (source cache, teacher)", unit="row", disable=not progress):
            began = time.perf_counter()
            start, tail = self.settings["starts"][index], self.settings["tail"]
            tensors = prepare_row(
                source_model, target_model, self.sequences[index], start, tail, self.settings["top_k"]
            )
            rest_mass = float(tensors["teacher.rest"].exp().mean())
            metadata = {"format": "pt", "row": str(index), "prefix": str(start), "tail": str(tail)}
            metadata["rest_mass"] = repr(rest_mass)
            write_file_atomically(self.path(index), partial(_save, tensors, metadata))
            seconds[index] = time.perf_counter() - began
            if max_minutes is not None and time.perf_counter() - started > 60 * max_minutes:
                break
        return seconds

    def metadata(self, index: int) -> dict[str, str]:
        """What row `index`'s file records: its index, prefix and tail lengths, and the teacher's mean rest mass (the
        probability outside its top-k, averaged over the tail)."""
        with safe_open(str(self.path(index)), "pt") as handle:
            return handle.metadata() or {}

    def row(self, index: int) -> dict:
        """Row `index`: `{"input_ids", "prefix", "source_kv": [(keys, values), ...], "teacher": (indices, logprobs,
        rest)}`; raises `ValueError` if it was not prepared or was written for another row."""
        path = self.path(index)
        if not path.is_file():
            raise ValueError(f"Row {index} is not prepared in {self.folder}; call `prepare` first.")
        metadata = self.metadata(index)
        if metadata.get("row") != str(index) or int(metadata.get("prefix", -1)) != self.settings["starts"][index]:
            raise ValueError(f"{path} does not hold row {index} of this store (metadata {metadata}); remove it.")
        tensors = load_file(str(path))
        layers = sum(1 for name in tensors if name.startswith("source.keys."))
        return {
            "input_ids": tensors["input_ids"],
            "prefix": int(metadata["prefix"]),
            "source_kv": [(tensors[f"source.keys.{i}"], tensors[f"source.values.{i}"]) for i in range(layers)],
            "teacher": (tensors["teacher.indices"], tensors["teacher.logprobs"], tensors["teacher.rest"]),
        }


__all__ = ["RowStore", "prepare_row", "tail_start", "teacher_topk", "topk_kl"]
