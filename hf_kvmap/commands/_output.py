"""What every command prints and writes at the end of a run."""

from __future__ import annotations


def finish(json_path, results: dict) -> int:
    """Write `results` (with `environment_info`) to `json_path` when given, say so, and return the exit code 0."""
    from ..reporting import environment_info, write_json

    results.setdefault("environment", environment_info())
    if json_path:
        write_json(json_path, results)
        print(f"wrote {json_path}")
    return 0
