"""Resumable calibration of real models: statistics of one or more directions, summed chunk by chunk into checkpoints
that a kill cannot tear.

A calibration folder holds `checkpoint/` (`progress.json` and one `statistics-<source>-to-<target>/` folder per
direction). Each checkpoint is written whole to `checkpoint.tmp` and swapped in by renames, so a job killed at any
moment leaves either the previous or the new checkpoint complete. `progress.json` records the setting (anything that
changes what the statistics hold: the corpus, the sequence length, the chunk size, the stride, the seed, the dtype)
and the sha256 of every chunk summed in; a run with the same setting skips those chunks, and a run with another
setting is refused.

```python
run = calibrate(out, chunks, setting, models, [("small", "large")], stride=2, tokenizer_fingerprint=fingerprint)
stats = load_statistics(out, "small", "large")
```
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from ..reporting import write_json
from .corpus import sequences_sha256

logger = logging.get_logger(__name__)


class BodyReplay:
    """A causal LM seen through its body only (no LM head: the statistics need the cache, not the logits), run once
    per batch and replayed for a second direction, so each calibration batch costs one forward per model.

    Args:
        model (`PreTrainedModel`): a causal LM with `get_decoder()`.
    """

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.training = False
        self._key = None
        self._out = None
        self.forward_seconds = 0.0

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def parameters(self):
        return self.model.parameters()

    def __call__(self, input_ids, **kwargs):
        key = (input_ids.shape, hash(input_ids.cpu().numpy().tobytes()))
        if key != self._key:
            start = time.perf_counter()
            self._out = self.model.get_decoder()(input_ids, **kwargs)
            self.forward_seconds += time.perf_counter() - start
            self._key = key
        return self._out


def checkpoint_dir(out: str | os.PathLike) -> Path | None:
    """The last complete checkpoint under a calibration folder (`None` before the first one).

    Args:
        out (`str` or `os.PathLike`): the calibration folder.
    """
    out = Path(out)
    for name in ("checkpoint", "checkpoint.old"):
        if (out / name / "progress.json").is_file():
            return out / name
    if (out / "progress.json").is_file():  # the first layout: statistics and progress directly in `out`
        return out
    return None


def swap_in(out: Path, tmp: Path) -> None:
    """Make the complete checkpoint `tmp` the current one of `out` (the previous one is kept until it is)."""
    current, old = out / "checkpoint", out / "checkpoint.old"
    if old.exists():
        shutil.rmtree(old)
    if current.exists():
        os.replace(current, old)
    os.replace(tmp, current)
    if old.exists():
        shutil.rmtree(old)
    for legacy in [out / "progress.json", *out.glob("statistics-*")]:  # the first layout, now superseded
        if legacy.is_dir():
            shutil.rmtree(legacy)
        elif legacy.exists():
            legacy.unlink()


def statistics_name(source: str, target: str, labels: Mapping[str, str] | None = None) -> str:
    """The folder name of one direction's statistics in a checkpoint (`labels` shorten the model names)."""
    labels = labels or {}
    return f"statistics-{labels.get(source, source)}-to-{labels.get(target, target)}"


def read_progress(out: str | os.PathLike) -> dict | None:
    """The `progress.json` of a calibration folder's last checkpoint (`None` before the first one)."""
    checkpoint = checkpoint_dir(out)
    return json.loads((checkpoint / "progress.json").read_text()) if checkpoint else None


def check_setting(out: str | os.PathLike, setting: dict) -> None:
    """Refuse a calibration folder whose checkpoint was made with another setting.

    Raises:
        `ValueError`: naming both settings and the fix (another output folder).
    """
    progress = read_progress(out)
    if progress is not None and progress["setting"] != setting:
        raise ValueError(
            f"{out} holds statistics of another setting ({progress['setting']}, asked {setting}); use another "
            "output folder, or the same setting to resume."
        )


def load_statistics(out: str | os.PathLike, source: str, target: str, labels: Mapping[str, str] | None = None):
    """One direction's `CalibrationStatistics` from a calibration folder's last checkpoint."""
    from ..statistics import CalibrationStatistics

    checkpoint = checkpoint_dir(out)
    if checkpoint is None:
        raise ValueError(f"No calibration checkpoint under {out}; calibrate first.")
    return CalibrationStatistics.load(checkpoint / statistics_name(source, target, labels))


@dataclass
class CalibrationRun:
    """What a call of [`calibrate`] did.

    Args:
        progress (`dict`): the last checkpoint's `progress.json` (`setting`, `done`, `positions`, `forward_seconds`).
        chunks (`int`): chunks in the whole calibration.
        done (`int`): chunks summed into the last checkpoint.
        stopped (`bool`): `max_minutes` ran out before every chunk was done (run again to resume).
    """

    progress: dict
    chunks: int
    done: int
    stopped: bool = False

    @property
    def complete(self) -> bool:
        return self.done == self.chunks


@torch.no_grad()
def calibrate(
    out: str | os.PathLike,
    chunks: Sequence[Sequence[Sequence[int]]],
    setting: dict,
    models: Mapping | Callable[[], Mapping],
    directions: Sequence[tuple[str, str]],
    *,
    stride: int,
    tokenizer_fingerprint: str,
    model_ids: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    max_minutes: float | None = None,
    snapshots: Sequence[int] = (),
    after_checkpoint: Callable[[dict, Path | None], None] | None = None,
    progress: bool = True,
) -> CalibrationRun:
    """Sum the statistics of `directions` over `chunks`, one checkpoint a chunk, resuming from `out`'s checkpoint.

    Args:
        out (`str` or `os.PathLike`): the calibration folder (made when missing).
        chunks (`Sequence`): chunks of token-id sequences; chunk `i` must be the same on every run of a setting.
        setting (`dict`): what the statistics depend on besides the chunks; a checkpoint of another is refused.
        models (`Mapping` or `Callable`): `{key: causal LM}`, or a function returning it, called only when a chunk
            is left to do (so a finished calibration loads no model).
        directions (`Sequence[tuple[str, str]]`): `(source key, target key)` pairs of `models`.
        stride (`int`): keep every `stride`-th position.
        tokenizer_fingerprint (`str`): the shared tokenizer's fingerprint, recorded with the statistics.
        model_ids (`Mapping`, *optional*): the model id recorded for each key (defaults to the key).
        labels (`Mapping`, *optional*): short names of the keys in folder names and `forward_seconds`.
        max_minutes (`float`, *optional*): start no chunk after this long (`0`: none); the checkpoint stays resumable.
        snapshots (`Sequence[int]`, *optional*): chunk counts at which a copy of the checkpoint is kept whole
            (`snapshot-<positions>/`).
        after_checkpoint (`Callable`, *optional*): called as `after_checkpoint(progress, snapshot)` after every
            checkpoint (`snapshot`: the folder kept at that count, else `None`).
        progress (`bool`, *optional*, defaults to `True`): show a progress bar of the chunks.

    Returns:
        [`CalibrationRun`].

    Raises:
        `ValueError`: `out` holds another setting, or a recorded chunk is not the chunk given now.
    """
    from ..statistics import CalibrationStatistics

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    labels, model_ids = labels or {}, model_ids or {}
    check_setting(out, setting)
    checkpoint = checkpoint_dir(out)
    state = json.loads((checkpoint / "progress.json").read_text()) if checkpoint else {"setting": setting, "done": {}}
    for index in list(state["done"]):
        got = sequences_sha256(chunks[int(index)]) if int(index) < len(chunks) else None
        if got != state["done"][index]["sha256"]:
            raise ValueError(
                f"Chunk {index} recorded in {checkpoint} is not the chunk this corpus now gives; use another output "
                "folder."
            )
    todo = [i for i in range(len(chunks)) if str(i) not in state["done"]]
    logger.info(f"calibration: {len(chunks)} chunks; {len(todo)} to do")
    if max_minutes == 0 or not todo:
        return CalibrationRun(state, len(chunks), len(state["done"]), stopped=bool(todo))
    models = models() if callable(models) else models
    keys = sorted({key for direction in directions for key in direction})
    replay = {key: BodyReplay(models[key]) for key in keys}
    stats = {}
    for source, target in directions:
        if checkpoint:
            stats[(source, target)] = CalibrationStatistics.load(checkpoint / statistics_name(source, target, labels))
        else:
            stats[(source, target)] = CalibrationStatistics(
                replay[source].config,
                replay[target].config,
                stride=stride,
                source_model_id=model_ids.get(source, source),
                target_model_id=model_ids.get(target, target),
                tokenizer_fingerprint=tokenizer_fingerprint,
            )
    started, stopped = time.perf_counter(), False
    bar = tqdm(
        total=len(chunks), initial=len(chunks) - len(todo), unit="chunk", desc="calibrating", disable=not progress
    )
    for index in todo:
        if max_minutes and time.perf_counter() - started > 60 * max_minutes:
            stopped = True
            break
        batch = [torch.tensor([seq]) for seq in chunks[index]]
        chunk_start = time.perf_counter()
        for direction in directions:
            stats[direction].accumulate(replay[direction[0]], replay[direction[1]], batch, progress=False)
        state["done"][str(index)] = {
            "sha256": sequences_sha256(chunks[index]),
            "seconds": time.perf_counter() - chunk_start,
        }
        state["forward_seconds"] = {
            labels.get(key, key): state.get("forward_seconds", {}).get(labels.get(key, key), 0.0) + r.forward_seconds
            for key, r in replay.items()
        }
        for r in replay.values():
            r.forward_seconds = 0.0
        state["positions"] = stats[tuple(directions[0])].count()
        tmp = out / "checkpoint.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        for (source, target), stat in stats.items():
            stat.save(tmp / statistics_name(source, target, labels))
        write_json(tmp / "progress.json", state)
        swap_in(out, tmp)
        snapshot = None
        if len(state["done"]) in snapshots:  # kept whole, for fits along the calibration-scale curve
            snapshot = out / f"snapshot-{state['positions']}"
            if not snapshot.exists():
                shutil.copytree(out / "checkpoint", snapshot.with_name(snapshot.name + ".tmp"))
                os.replace(snapshot.with_name(snapshot.name + ".tmp"), snapshot)
        bar.update(1)
        bar.set_postfix(positions=state["positions"])
        if after_checkpoint is not None:
            after_checkpoint(state, snapshot)
    bar.close()
    return CalibrationRun(state, len(chunks), len(state["done"]), stopped=stopped)


__all__ = [
    "BodyReplay",
    "CalibrationRun",
    "calibrate",
    "check_setting",
    "checkpoint_dir",
    "load_statistics",
    "read_progress",
    "statistics_name",
    "swap_in",
]
