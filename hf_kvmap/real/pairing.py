"""A real pair's map in one call (`hf-kvmap pair`): obtain both models, calibrate on the pinned corpus (resumable),
fit the paper's ridge for the source -> target direction, save the mapper and the serving choice beside it.

The output folder holds:

    manifest.json       the corpus this run calibrates on (this machine's files, built on the first run, or a copy of
                        the one given), pinned by its sha256 in the setting
    setting.json        what the statistics depend on (the models, the corpus, the sequence length, the chunk, the
                        stride, the seed, the dtype); a run of another setting is refused, a run asking for more
                        sequences extends the calibration (sequence `i` is the same whatever the count)
    calibration/        resumable checkpoints (`hf_kvmap.real.calibrating`)
    mapper/             the fitted `MapperModel` (`save_pretrained`: weights, config, model card)
    serving.json        the serving choice: the models, the rung to serve (`hf_kvmap.serving.rungs`), the dtype

```python
result = make_pair("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "pair-out")
mapper = MapperModel.from_pretrained(result.mapper_folder)
```
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging

from ..atomic import unwritable
from ..reporting import write_json
from . import corpus
from .calibrating import CalibrationRun, calibrate, check_setting, load_statistics, read_progress
from .obtain import converted_path, is_converted, obtain
from .registry import REGISTRY, registered_id

logger = logging.get_logger(__name__)

#: the paper's ridge: the top 8 source layers per target layer by the single-source probe, absolute lambda 0.01
TOP_K, RIDGE_LAMBDA = 8, 0.01
#: the rung served by default: a repair of the mapped cache at 10 % of the positions chosen by the target's draft
#: branches, a rung of the sealed protocol `benchmarks/protocols/switch-chat-doc.json`, whose map is this recipe
DEFAULT_RUNG = "repaired:draft_branches@0.1"
#: the default calibration: 10 sequences of 1,024 tokens at stride 2 (5,120 positions), the protocol's map
DEFAULT_SEQUENCES, DEFAULT_SEQ_LEN, DEFAULT_CHUNK, DEFAULT_STRIDE = 10, 1024, 2, 2
SERVING_FILE, MANIFEST_FILE, SETTING_FILE = "serving.json", "manifest.json", "setting.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_names(source: str, target: str) -> None:
    """Refuse unregistered or equal model names with a `ValueError` listing the registered ones."""
    for side, name in (("source", source), ("target", target)):
        if name not in REGISTRY:
            raise ValueError(
                f"Unknown {side} model {name!r}; the registered models are {', '.join(sorted(REGISTRY))} "
                "(`hf-kvmap obtain --list`)."
            )
    if source == target:
        raise ValueError(f"source and target are both {source!r}; name two models of one family.")


def check_output(out: str | os.PathLike) -> None:
    """Refuse an output folder this process cannot write, or one that is a file, before any work starts."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; name a folder for the pair (new, or one this command wrote).")
    problem = unwritable(out, inside=True)
    if problem:
        raise ValueError(problem)


def load_model(name: str, cache_dir: str | os.PathLike | None, dtype: str = "float32"):
    """An obtained model as a causal LM in `dtype` (float32 by default: on CPUs without bfloat16 arithmetic a float32
    forward is several times faster), going by its registered id (`registry.registered_id`, the id its calibration
    records in a mapper's config) rather than by the cache folder it was read from, so the gate checks a pair's mapper
    against it as against a Hub model."""
    model = load_converted(name, cache_dir, dtype)
    model.config.name_or_path = registered_id(name)
    return model


def load_converted(name: str, cache_dir: str | os.PathLike | None, dtype: str = "float32"):
    """The converted folder of an obtained model, loaded as a causal LM in `dtype` (it goes by the folder's path)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(converted_path(name, cache_dir), dtype=DTYPES[dtype]).eval()


def load_tokenizer(name: str, cache_dir: str | os.PathLike | None):
    """An obtained model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted_path(name, cache_dir))


def pinned_manifest(out: Path, manifest: str | os.PathLike | None = None) -> tuple[list, str]:
    """The corpus of this output folder: its `manifest.json`, made on the first run from `manifest` (copied) or from
    this machine's files (`corpus.discover`); returns the documents (checked against their pinned sha256) and the
    manifest's sha256."""
    pinned = out / MANIFEST_FILE
    if manifest is not None and pinned.is_file():
        given, held = (json.loads(Path(path).read_text())["sha256"] for path in (manifest, pinned))
        if given != held:
            raise ValueError(f"{out} calibrates on another corpus ({pinned}); use another output folder.")
    elif manifest is not None:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(manifest, pinned.with_name(MANIFEST_FILE + ".tmp"))
        os.replace(pinned.with_name(MANIFEST_FILE + ".tmp"), pinned)
    elif not pinned.is_file():
        corpus.build_manifest(pinned)
    return corpus.load_manifest(pinned), json.loads(pinned.read_text())["sha256"]


@dataclass
class PairResult:
    """What [`make_pair`] did.

    Args:
        out (`Path`): the output folder.
        calibration (`CalibrationRun`): the calibration's state.
        mapper_folder (`Path`, *optional*): the saved mapper; `None` while the calibration is unfinished.
        serving (`dict`, *optional*): what `serving.json` holds; `None` while the calibration is unfinished.
    """

    out: Path
    calibration: CalibrationRun
    mapper_folder: Path | None = None
    serving: dict | None = None

    @property
    def complete(self) -> bool:
        return self.mapper_folder is not None


def make_pair(
    source: str,
    target: str,
    out: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    sequences: int = DEFAULT_SEQUENCES,
    seq_len: int = DEFAULT_SEQ_LEN,
    chunk: int = DEFAULT_CHUNK,
    stride: int = DEFAULT_STRIDE,
    seed: int = 0,
    dtype: str = "float32",
    rung: str = DEFAULT_RUNG,
    manifest: str | os.PathLike | None = None,
    max_minutes: float | None = None,
    progress: bool = True,
) -> PairResult:
    """Obtain `source` and `target`, calibrate, fit the paper's ridge (k = 8, lambda 0.01) and save it in `out`.

    A run stopped by `max_minutes` (or killed) resumes from its last checkpoint when called again with the same
    arguments; a folder holding another setting is refused before any model is obtained or loaded.

    Args:
        source (`str`), target (`str`): registered real models (`hf_kvmap.real.REGISTRY`) sharing a tokenizer.
        out (`str` or `os.PathLike`): the output folder (see the module's docstring for what it holds).
        cache_dir (`str` or `os.PathLike`, *optional*): where the models are obtained (default
            `hf_kvmap.real.default_cache_dir()`).
        sequences (`int`, *optional*, defaults to 10): calibration sequences.
        seq_len (`int`, *optional*, defaults to 1024): tokens per sequence.
        chunk (`int`, *optional*, defaults to 2): sequences per checkpoint.
        stride (`int`, *optional*, defaults to 2): keep every `stride`-th position.
        seed (`int`, *optional*, defaults to 0): the corpus order.
        dtype (`str`, *optional*, defaults to `"float32"`): the models' dtype while calibrating.
        rung (`str`, *optional*, defaults to `"repaired:draft_branches@0.1"`): the rung `serving.json` names.
        manifest (`str` or `os.PathLike`, *optional*): a corpus manifest (`corpus.build_manifest`); default: one of
            this machine's files, made on the first run.
        max_minutes (`float`, *optional*): start no calibration chunk after this long (`0`: calibrate nothing).
        progress (`bool`, *optional*, defaults to `True`): progress bars.

    Returns:
        [`PairResult`].

    Raises:
        `ValueError`: an unknown model or rung, an unwritable output, an output of another setting or corpus.
    """
    from ..artifacts import tokenizer_fingerprint
    from ..fitting import mapper_from_statistics
    from ..serving.rungs import parse_rung
    from ..validation import check_choice, check_int

    check_names(source, target)
    check_output(out)
    parse_rung(rung)
    check_choice("dtype", dtype, tuple(DTYPES))
    for name, value in (("sequences", sequences), ("seq_len", seq_len), ("chunk", chunk), ("stride", stride)):
        check_int(name, value, 1)
    out = Path(out)
    calibration = out / "calibration"
    documents, manifest_sha = pinned_manifest(out, manifest)
    setting = {
        "source": source,
        "target": target,
        "manifest_sha256": manifest_sha,
        "seq_len": seq_len,
        "chunk": chunk,
        "stride": stride,
        "seed": seed,
        "dtype": dtype,
    }
    held = json.loads((out / SETTING_FILE).read_text()) if (out / SETTING_FILE).is_file() else None
    if held is not None and held != setting:
        raise ValueError(
            f"{out} holds a pair of another setting ({held}, asked {setting}); use another output folder, or the "
            "same arguments to resume."
        )
    check_setting(calibration, setting)  # before any model is obtained
    write_json(out / SETTING_FILE, setting)
    done = (read_progress(calibration) or {}).get("done", {})
    if len(done) < -(-sequences // chunk):
        for name in (source, target):
            if not is_converted(name, cache_dir):
                obtain(name, cache_dir=cache_dir, progress=progress)
    tokenizer = load_tokenizer(source, cache_dir)
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint != tokenizer_fingerprint(load_tokenizer(target, cache_dir)):
        raise ValueError(f"{source} and {target} do not share a tokenizer; a map needs two models of one family.")
    texts = corpus.calibration_sequences(tokenizer, documents, sequences, seq_len, seed=seed)
    chunks = [texts[i : i + chunk] for i in range(0, len(texts), chunk)]
    run = calibrate(
        calibration,
        chunks,
        setting,
        lambda: {name: load_model(name, cache_dir, dtype) for name in (source, target)},
        [(source, target)],
        stride=stride,
        tokenizer_fingerprint=fingerprint,
        model_ids={name: registered_id(name) for name in (source, target)},
        max_minutes=max_minutes,
        progress=progress,
    )
    if not run.complete:
        return PairResult(out, run)
    stats = load_statistics(calibration, source, target)
    mapper = mapper_from_statistics(stats, ridge_lambda=RIDGE_LAMBDA, top_k=TOP_K)
    mapper_folder = out / "mapper"
    mapper.save_pretrained(mapper_folder, overwrite=True)
    serving = {
        "source": source,
        "target": target,
        "rung": rung,
        "dtype": dtype,
        "cache_dir": None if cache_dir is None else str(cache_dir),
        "mapper": "mapper",
        "fit": {"kind": "ridge", "top_k": TOP_K, "ridge_lambda": RIDGE_LAMBDA, "positions": stats.count()},
    }
    write_json(out / SERVING_FILE, serving)
    return PairResult(out, run, mapper_folder, serving)


def next_command(out: str | os.PathLike) -> str:
    """The command that serves one prompt through the pair in `out` (its `serving.json` rung), for a user to run."""
    return (
        'python -c "from hf_kvmap.real.pairing import serve_prompt; '
        f"print(serve_prompt('{out}', 'def fibonacci(n):', max_new_tokens=32))\""
    )


@torch.no_grad()
def serve_prompt(out: str | os.PathLike, prompt: str, max_new_tokens: int = 32) -> dict:
    """Serve one prompt as a switch from the source to the target of the pair in `out`: the source prefills it, the
    rung of `serving.json` hands its cache to the target (`hf_kvmap.serving.rungs`), the target decodes greedily.

    Args:
        out (`str` or `os.PathLike`): a folder [`make_pair`] completed.
        prompt (`str`): the text to serve.
        max_new_tokens (`int`, *optional*, defaults to 32): tokens to decode.

    Returns:
        `dict`: `text` (the decoded continuation) and `report` (the handoff's report, with its `rung`).
    """
    from .._compat import cache_kwargs
    from ..modeling_mapper import MapperModel
    from ..serving.rungs import parse_rung

    out = Path(out)
    if not (out / SERVING_FILE).is_file():
        raise ValueError(f"{out} holds no {SERVING_FILE}; run `hf-kvmap pair SOURCE TARGET --out {out}` to the end.")
    serving = json.loads((out / SERVING_FILE).read_text())
    source = load_model(serving["source"], serving["cache_dir"], serving["dtype"])
    target = load_model(serving["target"], serving["cache_dir"], serving["dtype"])
    tokenizer = load_tokenizer(serving["target"], serving["cache_dir"])
    mapper = MapperModel.from_pretrained(out / serving["mapper"])
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    cache, report = parse_rung(serving["rung"]).serve(source, target, mapper, ids)
    kwargs = {} if cache is None else cache_kwargs(cache)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokens = target.generate(ids, **kwargs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    return {"text": tokenizer.decode(tokens[0, ids.shape[1] :], skip_special_tokens=True), "report": report}


__all__ = [
    "DEFAULT_RUNG",
    "PairResult",
    "check_names",
    "check_output",
    "make_pair",
    "next_command",
    "serve_prompt",
]
