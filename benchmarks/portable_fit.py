"""Whether a refit gives the same mapper bytes on another CPU: one small ridge fit (`hf-kvmap fit`) repeated in fresh
processes under the CPU settings other machines would run with, each fit's content hash recorded.

A mapper's content hash covers its weights, which come from the calibration statistics, which come from float forwards
of both models: a CPU with other vector instructions (or torch's other kernels for it) rounds differently, so a refit
on another machine is another mapper, and records measured with the first refuse the second. Each setting runs the same
fit in a fresh process:

- `native`: as the machine runs (its best kernels, MKL free to choose);
- `native, AVX2 only`: what an AVX2 machine runs (ATen's AVX2 kernels, MKL and oneDNN held to AVX2);
- `portable`: torch's portable kernels (`ATEN_CPU_CAPABILITY=default`) and MKL's reproducible path
  (`MKL_CBWR=COMPATIBLE`);
- `portable, AVX2 only, one thread`: the same held to AVX2 and one thread.

Where the two `portable` fits give one hash and the two `native` ones two, statistics gathered with the portable
settings refit the same mapper across these CPU levels (one machine emulating two; other vendors are not tested here).

    python -m benchmarks.portable_fit --source $MODELS/qwen2.5-coder-0.5b-instruct \
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
#: name -> environment added to the fit's process
SETTINGS = {
    "native": {},
    "native, AVX2 only": AVX2_ONLY,
    "portable": PORTABLE,
    "portable, AVX2 only, one thread": {
        **PORTABLE,
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "OMP_NUM_THREADS": "1",
    },
}


def fit_hash(args, env: dict[str, str], out: Path) -> tuple[str, float]:
    """Run the fit in a fresh process with `env` added; its mapper's content hash and wall seconds."""
    command = [
        sys.executable, "-m", "hf_kvmap.cli", "fit", "--source", args.source, "--target", args.target,
        "--data", args.data, "--top-k", str(args.top_k), "--seq-len", str(args.seq_len),
        "--max-sequences", str(args.sequences), "--model-dtype", "float32", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"the fit under {env} failed:\n{done.stderr[-2000:]}")
    return json.loads((out / "config.json").read_text())["content_hash"], seconds


def verdict(fits: dict[str, dict]) -> dict[str, bool]:
    """Whether each pair of settings gave one mapper."""
    return {
        "native_same": fits["native"]["hash"] == fits["native, AVX2 only"]["hash"],
        "portable_same": fits["portable"]["hash"] == fits["portable, AVX2 only, one thread"]["hash"],
    }


def markdown(results: dict) -> str:
    lines = [
        "Generated from `benchmarks/results/portable_fit.json` by `benchmarks/portable_fit.py` (one fit of "
        f"{results['run']['positions']}; every setting in a fresh process on one machine).",
        "",
        "| setting | environment | content hash | seconds |",
        "|---|---|---|---|",
    ]
    for name, fit in results["fits"].items():
        env = " ".join(f"`{k}={v}`" for k, v in fit["env"].items()) or "as the machine runs"
        lines.append(f"| {name} | {env} | `{fit['hash'].split(':')[-1][:12]}` | {fit['seconds']:.0f} |")
    same = results["verdict"]
    lines += [
        "",
        f"Native settings: {'one mapper' if same['native_same'] else 'two mappers'} across the two CPU levels; "
        f"portable settings: {'one mapper' if same['portable_same'] else 'two mappers'}.",
    ]
    return "\n".join(lines)


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
    parser.add_argument("--out", default="benchmarks/results/portable_fit.json")
    args = parser.parse_args(argv)
    data, fits = Path(args.data).name, {}
    with tempfile.TemporaryDirectory() as work:
        if not args.data.endswith((".txt", ".jsonl")):  # any text file (the README) read as calibration text
            text = Path(work) / "calibration.txt"
            text.write_text(Path(args.data).read_text())
            args.data = str(text)
        for index, (name, env) in enumerate(SETTINGS.items()):
            digest, seconds = fit_hash(args, env, Path(work) / str(index))
            fits[name] = {"env": env, "hash": digest, "seconds": seconds}
            print(f"{name}: {digest} ({seconds:.0f} s)", flush=True)
    results = {
        "run": {
            "what": "one ridge fit repeated under other CPU settings: whether a refit gives the same mapper bytes",
            "source": Path(args.source).name,
            "target": Path(args.target).name,
            "data": data,
            "positions": f"{args.sequences} sequences of {args.seq_len} tokens, top-k {args.top_k}",
            "command": "python -m benchmarks.portable_fit " + " ".join(sys.argv[1:] if argv is None else argv),
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
