"""Re-save mapper folders through the library, keeping their weights: the config is rewritten in the current format
(its content hash covering the mapping fields as well as the weights) and the card is re-rendered.

    python examples/resave_mappers.py hf_kvmap/zoo/mappers/* --cards model_cards

A folder is re-saved only when its weights match the hash it records (the full content hash, or the weights-only
hash older versions wrote); the weights are written back in the dtype they were stored in.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

from hf_kvmap import MapperModel
from hf_kvmap.artifacts import EVALUATION_FILE, stored_content_hash


def resave(folder: Path, cards: Path | None) -> None:
    loaded = MapperModel.from_pretrained(folder, verify=False, dtype="auto")
    recorded = loaded.config.content_hash
    if recorded not in (stored_content_hash(folder, loaded.config), stored_content_hash(folder)):
        raise SystemExit(f"{folder}: the weights do not match the hash the config records; not re-saving it.")
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("*.safetensors")}
    results = folder / EVALUATION_FILE  # measured on these weights: kept (they record no hash of their own)
    evaluation = json.loads(results.read_text()) if results.exists() else None
    loaded.save_pretrained(folder, evaluation=evaluation)
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("*.safetensors")}
    if before != after:
        raise SystemExit(f"{folder}: re-saving changed the weight files {sorted(before)} -> {sorted(after)}.")
    if cards is not None:
        shutil.copyfile(folder / "README.md", cards / f"{folder.name}.md")
    print(f"{folder}: content hash {recorded} -> {loaded.config.content_hash}; weights unchanged")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--cards", type=Path, default=None, help="also copy each card to CARDS/<folder name>.md")
    args = parser.parse_args()
    for folder in args.folders:
        resave(folder, args.cards)


if __name__ == "__main__":
    main()
