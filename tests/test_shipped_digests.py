"""Shipped mappers give byte-identical mapped caches: digests recorded from the code that produced the artifacts.

Regenerate `tests/data/mapped_cache_digests.json` only on purpose (`python tests/test_shipped_digests.py`), when a
change is meant to alter the mapping; a refactoring must leave every digest unchanged.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from hf_kvmap import MappedCache, MapperModel, zoo
from hf_kvmap.zoo import corpus

DIGESTS = Path(__file__).resolve().parent / "data" / "mapped_cache_digests.json"
PAIRS = sorted(p.name for p in zoo.MAPPERS_DIR.iterdir() if p.is_dir())


def _prompts() -> list[str]:
    items = corpus.make_eval_set("recall", 2, seed=7) + corpus.make_eval_set("chat", 1, seed=7)
    return [item.context for item in items]


def _digest(cache: MappedCache) -> str:
    digest = hashlib.sha256()
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            tensor = tensor.detach().contiguous()
            digest.update(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def mapped_cache_digests(pair: str) -> dict[str, str]:
    """sha256 of every mapped layer, for one prompt at a time and for the left-padded batch of all prompts."""
    source_name, target_name = pair.split("-to-")
    tokenizer = zoo.load_tokenizer(padding_side="left")
    source = zoo.load_model(source_name)
    mapper = MapperModel.from_pretrained(zoo.mapper_path(source_name, target_name))
    out = {}
    prompts = _prompts()
    for index, prompt in enumerate(prompts):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        cache = source(input_ids=ids, use_cache=True).past_key_values
        out[f"prompt{index}"] = _digest(MappedCache.from_source(cache, mapper))
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    mask = batch["attention_mask"]
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    cache = source(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions, use_cache=True)
    out["left_padded_batch"] = _digest(
        MappedCache.from_source(cache.past_key_values, mapper, attention_mask=mask, dtype=torch.float32)
    )
    return out


@pytest.mark.parametrize("pair", PAIRS)
def test_shipped_mapper_gives_the_recorded_mapped_cache(pair, one_thread):
    recorded = json.loads(DIGESTS.read_text())
    assert mapped_cache_digests(pair) == recorded[pair]


if __name__ == "__main__":
    torch.set_num_threads(1)
    DIGESTS.write_text(json.dumps({pair: mapped_cache_digests(pair) for pair in PAIRS}, indent=2) + "\n")
