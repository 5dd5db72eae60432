"""Whether a refit gives the same mapper bytes on another CPU: one small ridge fit (`hf-kvmap fit`) repeated in fresh
processes under the CPU settings other machines would run with, and which step of the fit changes its bytes.

A mapper's content hash covers its weights, which come from the calibration statistics, which come from float forwards
of both models: a CPU with other vector instructions (or torch's other kernels for it) rounds differently, so a refit
on another machine is another mapper, and records measured with the first refuse the second. Each setting runs the same
fit in a fresh process:

- `native`: as the machine runs (its best kernels, MKL free to choose);
- `native, AVX2 only`: what an AVX2 machine runs (ATen's AVX2 kernels, MKL and oneDNN held to AVX2);
- `portable`: torch's portable kernels (`ATEN_CPU_CAPABILITY=default`) and MKL's reproducible path
  (`MKL_CBWR=COMPATIBLE`), and the same on one thread, held to AVX2, and both: one change at a time.

Each fit saves its statistics (`--stats`): their digest (`statistics.json`'s `sha256`) says whether the pass through
the models gave the same sums. The first setting's statistics are then solved again under every setting
(`--from-stats`): that mapper's hash says whether the solve alone is reproducible. Settings that give one statistics
digest and one mapper refit the same mapper across these CPU levels and thread counts (one machine emulating several;
other vendors are not tested here).

    python -m benchmarks.speed.portable_fit --source $MODELS/qwen2.5-coder-0.5b-instruct \
        --target $MODELS/qwen2.5-coder-1.5b-instruct --data README.md --out benchmarks/results/portable_fit.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hf_kvmap.reporting import environment_info, write_json

AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
PORTABLE = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
HELD_TO_AVX2 = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
#: name -> environment added to the fit's process
SETTINGS = {
    "native": {},
    "native, AVX2 only": AVX2_ONLY,
    "portable": PORTABLE,
    "portable, one thread": {**PORTABLE, **ONE_THREAD},
    "portable, AVX2 only": {**PORTABLE, **HELD_TO_AVX2},
    "portable, AVX2 only, one thread": {**PORTABLE, **HELD_TO_AVX2, **ONE_THREAD},
}


def _run(command: list[str], env: dict[str, str], what: str) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{what} under {env} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def _hash(folder: Path) -> str:
    return json.loads((folder / "config.json").read_text())["content_hash"]


def fit_hash(args, env: dict[str, str], out: Path) -> tuple[str, str, float]:
    """Run the fit in a fresh process with `env` added, saving its statistics beside the mapper (`out/stats`): the
    mapper's content hash, the statistics' digest and the fit's wall seconds."""
    command = [
        sys.executable, "-m", "hf_kvmap.cli", "fit", "--source", args.source, "--target", args.target,
        "--data", args.data, "--top-k", str(args.top_k), "--seq-len", str(args.seq_len),
        "--max-sequences", str(args.sequences), "--model-dtype", "float32", "--no-progress",
        "--stats", str(out / "stats"), "--out", str(out / "mapper"),
    ]  # fmt: skip
    seconds = _run(command, env, "the fit")
    statistics = json.loads((out / "stats" / "statistics.json").read_text())["sha256"]
    return _hash(out / "mapper"), statistics, seconds


def solve_hash(args, env: dict[str, str], stats: Path, out: Path) -> str:
    """The content hash of the mapper solved from the saved statistics `stats` under `env` (no model runs)."""
    command = [
        sys.executable, "-m", "hf_kvmap.cli", "fit", "--from-stats", str(stats), "--top-k", str(args.top_k),
        "--no-progress", "--out", str(out),
    ]  # fmt: skip
    _run(command, env, "the solve")
    return _hash(out)


def verdict(fits: dict[str, dict]) -> dict[str, dict[str, int]]:
    """Per group of settings (`native...`, `portable...`): how many distinct mappers, statistics and solves of the
    shared statistics its fits gave (1: reproducible across the group; a part a fit lacks is not counted)."""
    out = {}
    for group in ("native", "portable"):
        mine = [fit for name, fit in fits.items() if name.split(",")[0] == group]
        if mine:
            out[group] = {
                part: len({fit[key] for fit in mine if key in fit})
                for part, key in (("mappers", "hash"), ("statistics", "statistics"), ("solves", "solve"))
            }
    return out


def _short(digest: str | None) -> str:
    return f"`{digest.split(':')[-1][:12]}`" if digest else "-"


def markdown(results: dict) -> str:
    lines = [
        "Generated from `benchmarks/results/portable_fit.json` by `benchmarks/speed/portable_fit.py` (one fit of "
        f"{results['run']['positions']}; every setting in a fresh process on one machine; *shared statistics "
        f"solved*: the statistics of `{results['run'].get('solved', 'the first setting')}` solved again under each "
        "setting).",
        "",
        "| setting | environment | statistics | mapper | shared statistics solved | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for name, fit in results["fits"].items():
        env = " ".join(f"`{k}={v}`" for k, v in fit["env"].items()) or "as the machine runs"
        lines.append(
            f"| {name} | {env} | {_short(fit.get('statistics'))} | {_short(fit['hash'])} | "
            f"{_short(fit.get('solve'))} | {fit['seconds']:.0f} |"
        )

    def counted(n: int, what: str) -> str:
        return f"one {what}" if n == 1 else f"{n} {what}s" if n else f"no {what} recorded"

    sentences = []
    for group, parts in verdict(results["fits"]).items():  # recomputed: older results stored another verdict
        text = f"{group.capitalize()} settings: {counted(parts['mappers'], 'mapper')}"
        if parts.get("statistics"):
            text += f" from {counted(parts['statistics'], 'statistics digest')}"
        if parts.get("solves"):
            text += f"; the shared statistics solved to {counted(parts['solves'], 'mapper')}"
        sentences.append(text + ".")
    return "\n".join(lines + ["", " ".join(sentences)])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument(
        "--data", required=True, help="calibration text (.jsonl with a 'text' field, or any text file)"
    )
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=2)
    parser.add_argument(
        "--settings", default=";".join(SETTINGS), help=f"';'-separated, of: {'; '.join(SETTINGS)} (default: all)"
    )
    parser.add_argument("--out", default="benchmarks/results/portable_fit.json")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.settings.split(";") if name.strip()]
    unknown = [name for name in chosen if name not in SETTINGS]
    if unknown or not chosen:
        raise SystemExit(f"--settings: unknown {unknown or args.settings!r}; known: {'; '.join(SETTINGS)}")
    data, fits = Path(args.data).name, {}
    with tempfile.TemporaryDirectory() as work:
        if not args.data.endswith((".txt", ".jsonl")):  # any text file (the README) read as calibration text
            text = Path(work) / "calibration.txt"
            text.write_text(Path(args.data).read_text())
            args.data = str(text)
        for index, name in enumerate(chosen):
            env = SETTINGS[name]
            digest, statistics, seconds = fit_hash(args, env, Path(work) / str(index))
            fits[name] = {"env": env, "hash": digest, "statistics": statistics, "seconds": seconds}
            print(f"{name}: mapper {digest}, statistics {statistics} ({seconds:.0f} s)", flush=True)
        shared = Path(work) / "0" / "stats"
        for index, name in enumerate(chosen):
            fits[name]["solve"] = solve_hash(args, SETTINGS[name], shared, Path(work) / f"solve-{index}")
            print(f"{name}: the shared statistics solve to {fits[name]['solve']}", flush=True)
    results = {
        "run": {
            "what": "one ridge fit repeated under other CPU settings: whether a refit gives the same mapper bytes, "
            "and whether the statistics or the solve changes them",
            "source": Path(args.source).name,
            "target": Path(args.target).name,
            "data": data,
            "positions": f"{args.sequences} sequences of {args.seq_len} tokens, top-k {args.top_k}",
            "solved": chosen[0],
            "command": "python -m benchmarks.speed.portable_fit " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": _dt.date.today().isoformat(),
        },
        "environment": environment_info(),
        "fits": fits,
        "verdict": verdict(fits),
    }
    write_json(args.out, results)
    print(markdown(results))


if __name__ == "__main__":
    main()
