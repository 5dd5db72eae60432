"""`hf-kvmap pair` from nothing to a served prompt, timed end to end (issue 56: "the pair command from nothing to a served
real-pair handoff in one command, within 25 minutes on these 2 cores").

Runs, each as its own process as a user would, with an empty model cache of its own (`--cache-dir` in `--work`, so
both models are downloaded and converted by the command itself; pip's own download cache may still hold the
packages) and a new output folder:

    1. hf-kvmap pair SOURCE TARGET --out WORK/pair --cache-dir WORK/cache [--threads N]
    2. python -c "from hf_kvmap.real.pairing import serve_prompt; print(serve_prompt('WORK/pair', PROMPT))"

and writes each stage's wall seconds, exit status and the 1-minute load average before and after it, beside the run's
environment, to `--json`:

    python -m benchmarks.speed.pair_timing --work /tmp/pair-timing --json benchmarks/results/pair.json

`--work` must be new or empty (a resumed calibration would time less than a run from nothing). README's minutes for
`pair` are rendered from the JSON (`python -m benchmarks.docs`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from hf_kvmap.reporting import environment_info, write_json

SOURCE, TARGET = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"
PROMPT = "def fibonacci(n):"
TARGET_MINUTES = 25.0


def stage(name: str, command: list[str], log: Path) -> dict:
    """Run `command` (its output appended to `log`), timed; the load average before and after."""
    before = os.getloadavg()[0]
    start = time.perf_counter()
    with log.open("a") as handle:
        handle.write(f"$ {' '.join(command)}\n")
        handle.flush()
        status = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=False).returncode
    return {
        "stage": name,
        "command": command,
        "seconds": round(time.perf_counter() - start, 1),
        "returncode": status,
        "load_before": round(before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }


def summarize(stages: list[dict], target_minutes: float = TARGET_MINUTES) -> dict:
    """The run's totals: minutes end to end, whether every stage succeeded, and whether it came within the target."""
    minutes = sum(s["seconds"] for s in stages) / 60
    ok = all(s["returncode"] == 0 for s in stages)
    return {
        "minutes": round(minutes, 1),
        "succeeded": ok,
        "target_minutes": target_minutes,
        "within_target": ok and minutes <= target_minutes,
        "max_load": max(max(s["load_before"], s["load_after"]) for s in stages),
    }


def markdown(result: dict, path: str = "benchmarks/results/pair.json") -> str:
    """README's sentence on what `pair` costs, from a run's JSON."""
    seconds = {s["stage"]: s["seconds"] for s in result["stages"]}
    summary, environment = result["summary"], result["run"]["environment"]
    if not summary["succeeded"]:
        failed = next(s["stage"] for s in result["stages"] if s["returncode"] != 0)
        return f"Timed from nothing (`{path}`): the run failed at its {failed} stage; no minutes to report."
    within = "within" if summary["within_target"] else "over"
    threads = result["run"]["threads"] or environment["threads"]
    return (
        f"Timed from nothing (`{path}`, `python -m benchmarks.speed.pair_timing`): {summary['minutes']:.1f} minutes "
        f"from an empty model cache to a served prompt on {threads} CPU threads ({environment['cpu']}), "
        f"{seconds['pair'] / 60:.1f} of them `pair` itself (both models downloaded and converted, the calibration, "
        f"the fit) and {seconds.get('serve', 0.0):.0f} s serving the prompt (both models loaded); {within} the "
        f"{summary['target_minutes']:.0f} minutes aimed at, with the machine's load average at most "
        f"{summary['max_load']:.1f} while it ran."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, type=Path, help="a new or empty folder")
    parser.add_argument("--json", required=True, type=Path)
    parser.add_argument("--source", default=SOURCE)
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the pair command")
    args = parser.parse_args(argv)
    if args.work.exists() and any(args.work.iterdir()):
        raise SystemExit(f"--work {args.work} is not empty: a run from nothing needs a new or empty folder.")
    args.work.mkdir(parents=True, exist_ok=True)
    log, out, cache = args.work / "log.txt", args.work / "pair", args.work / "cache"
    pair = ["hf-kvmap", "pair", args.source, args.target, "--out", str(out), "--cache-dir", str(cache)]
    pair += [] if args.threads is None else ["--threads", str(args.threads)]
    serve = [
        sys.executable,
        "-c",
        f"from hf_kvmap.real.pairing import serve_prompt; print(serve_prompt({str(out)!r}, {PROMPT!r})['text'])",
    ]
    stages = [stage("pair", pair, log)]
    if stages[-1]["returncode"] == 0:
        stages.append(stage("serve", serve, log))
    result = {
        "run": {
            "what": "hf-kvmap pair from an empty model cache to one served prompt, each stage its own process",
            "source": args.source,
            "target": args.target,
            "prompt": PROMPT,
            "threads": args.threads,
            "environment": environment_info(),
        },
        "stages": stages,
        "summary": summarize(stages),
    }
    write_json(args.json, result)
    print(
        f"{result['summary']['minutes']} minutes end to end; stages: "
        + ", ".join(f"{s['stage']} {s['seconds']} s (exit {s['returncode']})" for s in stages)
    )
    return 0 if result["summary"]["succeeded"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
