"""What a wheel of this repository weighs: builds it (`pip wheel --no-deps`), and records the wheel's size, the size
of what it installs, and the part the shipped tiny-family mappers and models take.

    python -m benchmarks.variants.package_size --json benchmarks/results/package_size.json
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from hf_kvmap.reporting import environment_info, write_json

ROOT = Path(__file__).resolve().parents[2]
MB = 1e6
BUILD_LEFTOVERS = (".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache", ".venv*")


def measure(repo: Path) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        # built from a copy, so the build leaves nothing (build/, *.egg-info) in the repository
        copy, out = Path(scratch) / "src", Path(scratch) / "wheels"
        shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(*BUILD_LEFTOVERS))
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-q",
                "-w",
                str(out),
                str(copy),
            ],
            check=True,
        )
        wheels = sorted(out.glob("hf_kvmap-*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"package_size: expected one hf_kvmap wheel, pip wrote {[w.name for w in wheels]}.")
        wheel = wheels[0]
        with zipfile.ZipFile(wheel) as archive:
            files = {info.filename: info.file_size for info in archive.infolist() if not info.is_dir()}
        mappers: dict[str, int] = {}
        for name, size in files.items():
            parts = name.split("/")
            if parts[:3] == ["hf_kvmap", "zoo", "mappers"] and len(parts) > 4:
                mappers[parts[3]] = mappers.get(parts[3], 0) + size
        return {
            "wheel": wheel.name,
            "wheel_bytes": wheel.stat().st_size,
            "installed_bytes": sum(files.values()),
            "mapper_bytes": dict(sorted(mappers.items())),
            "family_bytes": sum(s for n, s in files.items() if n.startswith("hf_kvmap/zoo/family/")),
            "files": len(files),
        }


def markdown(result: dict) -> str:
    sizes = result["sizes"]
    mappers = sizes["mapper_bytes"]
    listed = ", ".join(f"{name} {size / MB:.2f} MB" for name, size in mappers.items())
    return (
        f"**Package weight.** A wheel carries the library, the tiny family (tokenizer and four members: the demo, the "
        f"examples and the quality tests run on them offline, {sizes['family_bytes'] / MB:.1f} MB) and the "
        f"{len(mappers)} shipped mappers ({sum(mappers.values()) / MB:.1f} MB together: {listed}): "
        f"{sizes['wheel_bytes'] / MB:.1f} MB as a wheel, {sizes['installed_bytes'] / MB:.1f} MB installed (measured by "
        f"`benchmarks/variants/package_size.py` with `pip wheel --no-deps`, `{result['run']['json']}`). Cards of all the mappers "
        "stay in `model_cards/`. `pyproject.toml` (`package-data`) lists what a wheel takes; real-family mappers and "
        "converted real models never enter the repository or the wheel."
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=ROOT)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/package_size.json"))
    args = parser.parse_args(argv)
    result = {
        "run": {"script": "benchmarks/variants/package_size.py", "json": args.json.as_posix()},
        "sizes": measure(args.repo),
        "environment": environment_info(),
    }
    write_json(args.json, result)
    text = markdown(result)
    print(text)
    return result


if __name__ == "__main__":
    main()
