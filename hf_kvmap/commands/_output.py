"""What every command prints and writes at the end of a run."""

from __future__ import annotations


def finish(json_path, results: dict) -> int:
    """Write `results` (with `environment_info`) to `json_path` when given, say so, and return the exit code 0."""
    from ..reporting import environment_info, write_json

    results.setdefault("environment", environment_info())
    if json_path:
        try:
            write_json(json_path, results)
        except OSError as err:  # the path is checked when the command starts (`_args.output_file`); this is the rest
            raise SystemExit(f"hf-kvmap: could not write --json {json_path}: {err}") from None
        print(f"wrote {json_path}")
    return 0
