"""Numbers, retention cells and JSON for results (cards and the demo's table render from them; docs are written by
`python -m benchmarks.docs`, never by the library)."""

from __future__ import annotations

import math
from pathlib import Path


def fmt_number(value, digits: int = 3, style: str = "f") -> str:
    """A number for a Markdown table (`digits` decimals, or significant digits with `style="g"`); missing or
    non-finite values read `n/a`."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}{style}}"


def retention_measurable(row: dict) -> bool:
    """Whether a results row's target beats chance over its items (`hf_kvmap.metrics`: exact binomial test);
    rows without an item count are not."""
    from .metrics.retention.retention import target_beats_chance

    return target_beats_chance(row.get("target"), row.get("n_items"), row.get("chance") or 0.0)[0]


def retention_cells(row: dict) -> tuple[str, str]:
    """`(raw, floor-normalized)` retention of a results row for a table: "not measurable" where the target does not
    beat chance (whatever numbers an older results file holds)."""
    if not retention_measurable(row):
        return "not measurable", "not measurable"
    return fmt_number(row.get("retention")), fmt_number(row.get("floor_normalized_retention"))


def floor_retention(score: float, target: float, chance: float = 0.0, n_items: int | None = None) -> float | None:
    """Floor-normalized retention, `(score - chance) / (target - chance)`: 1 is the target's score, 0 what guessing
    gets. `None` where it cannot be read: the target does not beat `chance` over `n_items` items (exact binomial
    test; without a count, where its score is not above chance)."""
    if n_items:
        measurable = retention_measurable({"target": target, "n_items": n_items, "chance": chance})
    else:
        measurable = target > chance
    return (score - chance) / (target - chance) if measurable else None


def gap_recovered(score: float, target: float, source: float) -> float | None:
    """The share of the source-to-target gap an arm's `score` recovers, `(score - source) / (target - source)`: 1 is
    the target's score, 0 the source's (what not switching serves), below 0 worse than not switching. `None` where the
    target does not beat the source: there is no gap to recover, and only retention can be read."""
    return (score - source) / (target - source) if target > source else None


def environment_info() -> dict:
    """Library versions and the device, for self-describing results JSON."""
    import platform

    import torch
    import transformers

    from ._version import __version__

    info = {
        "hf_kvmap": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        **machine_info(),
    }
    return info


def machine_info() -> dict:
    """Where seconds and float results were measured: torch's threads, the CPU (model name with its bf16
    instructions; float results differ between CPUs) and ATen's kernel level. Records measured one at a time keep
    it, so a study recomputed from them later can say which machines measured them."""
    import platform

    import torch

    return {
        "threads": torch.get_num_threads(),
        "cpu": _cpu_name() or platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


# CPU settings under which a forward, a sum and a solve give the same bytes on any x86 CPU (ATen's portable kernels,
# MKL's compatible code path; benchmarks/results/portable_fit.json measures it)
PORTABLE_KERNELS = "cpu DEFAULT, MKL_CBWR=COMPATIBLE"


def kernel_settings(device="cpu") -> str:
    """The float kernels that work on `device` runs with, as a label for provenance: on the CPU ATen's kernel level
    and MKL's reproducibility mode (`MKL_CBWR` as the environment holds it: MKL reads it when the process starts),
    e.g. `"cpu AVX512"` or `PORTABLE_KERNELS`; on an accelerator its type and name. Two runs with the same CPU label
    give the same bytes only where it is `PORTABLE_KERNELS` (natively the kernels follow the CPU's instructions)."""
    import os

    import torch

    device = torch.device(device)
    if device.type == "cpu":
        label = f"cpu {torch.backends.cpu.get_cpu_capability()}"
        return label + (f", MKL_CBWR={os.environ['MKL_CBWR']}" if os.environ.get("MKL_CBWR") else "")
    if device.type == "cuda" and torch.cuda.is_available():
        return f"cuda {torch.cuda.get_device_name(device)}"
    return device.type


def joined_settings(*labels: str | None) -> str | None:
    """The kernel-settings label of a sum of parts gathered under `labels`: the label they share, `"mixed"` where
    they differ, `None` (unknown) where any part's is unknown."""
    if any(label is None for label in labels):
        return None
    return labels[0] if len(set(labels)) == 1 else "mixed"


def _cpu_name() -> str | None:
    """The CPU's model name as Linux reports it, with its bf16 instructions where it has them (None elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    bf16 = [flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags]
    return names[0] + (f" ({', '.join(bf16)})" if bf16 else "") if names else None


def json_safe(value):
    """Non-finite floats (e.g. retention against a target at chance) become null, so files are strict JSON."""
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def jsonl_objects(path: str | Path, errors: list[str], expected: str = "an object"):
    """`(line number, object)` for every JSON object line of a JSONL file; what is wrong with any other non-blank
    line is appended to `errors` as `path:line: what is wrong` (so a caller reports them all at once)."""
    import json

    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                errors.append(
                    f"{path}:{number}: not UTF-8 text (byte {err.start}: {err.reason}); save the file as UTF-8."
                )
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                errors.append(f"{path}:{number}: not valid JSON ({err.msg}).")
                continue
            if not isinstance(row, dict):
                errors.append(f"{path}:{number}: a {type(row).__name__}, expected {expected}.")
                continue
            yield number, row


def resumable_jsonl(
    path: str | Path, expected: str = "an object", *, check=None, cut: bool = True
) -> tuple[list[tuple[int, dict]], str | None]:
    """The rows of a JSONL file that a run appends to as it measures, read to resume it.

    An incomplete last line after complete rows (the run was stopped while writing it: no newline, not an object) is
    cut off the file, so its item is measured again (`cut=False`: left out of the rows, the file unchanged); a complete
    last row without its newline gets one, so the next row starts a line of its own. Any other bad line is refused.

    Args:
        path (`str` or `Path`): the records file.
        expected (`str`, *optional*): what a line holds, for the messages (e.g. `"a measured item (a JSON object)"`).
        check (`Callable[[dict], str | None]`, *optional*): what is wrong with a row that is an object (`None`: nothing).
        cut (`bool`, *optional*, defaults to `True`): cut an incomplete last line off the file.

    Returns:
        `(rows, note)`: `(line number, row)` for every row, and a note to show when an incomplete last line was cut
        or left out (else `None`).

    Raises:
        `ValueError`: a bad line other than an incomplete last one; the message lists up to five as
        `path:line: what is wrong`.
    """
    errors: list[str] = []
    rows = []
    for number, row in jsonl_objects(path, errors, expected):
        problem = check(row) if check is not None else None
        if problem:
            errors.append(f"{path}:{number}: {problem}")
        else:
            rows.append((number, row))
    data = Path(path).read_bytes()
    end = data.rfind(b"\n") + 1
    note = None
    if data[end:].strip():  # the last line lacks its newline: a stopped run, or a file no run of this kind wrote
        lines = data.count(b"\n") + 1
        last = f"{path}:{lines}:"
        if rows and len(errors) == 1 and errors[0].startswith(last):
            errors = []
            if cut:
                with open(path, "r+b") as handle:
                    handle.truncate(end)
            note = f"note: {path} ends in an incomplete record (a stopped run); that item is measured again."
        elif not errors and cut:
            with open(path, "ab") as handle:
                handle.write(b"\n")
    if errors:
        raise ValueError("\n  ".join(errors[:5]) + ("\n  ..." if len(errors) > 5 else ""))
    return rows, note


def write_json(path: str | Path, data: dict) -> None:
    """`data` as strict JSON (non-finite floats as null), written atomically: a kill leaves the previous file or the
    complete new one."""
    import json

    from .atomic import write_text_atomically

    write_text_atomically(path, json.dumps(json_safe(data), indent=2, allow_nan=False) + "\n")
