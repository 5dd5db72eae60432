"""The mappers the package ships: byte-identical mapped caches (digests recorded before any refactoring), their
models, the variant chosen for each direction, and quality floors (slow).

Regenerate `tests/data/mapped_cache_digests.json` only on purpose (`python tests/test_shipped.py`), when a change is
meant to alter the mapping; a refactoring must leave every digest unchanged.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from hf_kvmap import (
    MappedCache,
    MapperModel,
    zoo,
)
from hf_kvmap.evaluation import Handoff, evaluate_items
from hf_kvmap.zoo import corpus

ROOT = Path(__file__).resolve().parents[1]


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
        MappedCache.from_source(
            cache.past_key_values, mapper, attention_mask=mask, source_position_ids=positions, dtype=torch.float32
        )
    )
    return out


@pytest.mark.parametrize("pair", PAIRS)
def test_shipped_mapper_gives_the_recorded_mapped_cache(pair, one_thread):
    recorded = json.loads(DIGESTS.read_text())
    assert mapped_cache_digests(pair) == recorded[pair]


def test_shipped_mappers_match_their_models():
    tokenizer = zoo.load_tokenizer()
    for folder in sorted(zoo.MAPPERS_DIR.iterdir()):
        source_name, target_name = folder.name.split("-to-")
        mapper = MapperModel.from_pretrained(folder)  # verifies the content hash
        assert mapper.check_compatible(zoo.load_model(source_name), zoo.load_model(target_name), tokenizer) == []
        with torch.no_grad():
            ids = torch.tensor([tokenizer("ab=123\ncd=456\n?ab=")["input_ids"]])
            cache = MappedCache.from_source(zoo.load_model(source_name)(ids, use_cache=True).past_key_values, mapper)
        assert all(torch.isfinite(layer.keys).all() for layer in cache.layers)


def test_shipped_mappers_are_the_chosen_variants():
    """Each shipped mapper is the variant `benchmarks/mapper_variants.py` chose for its direction among every variant
    (`mapper_variants_longer.json`, the last comparison, holding every earlier one): its evaluation is the one kept for that variant, it is the very mapper scored on
    the held-out items (same content hash)."""
    results = json.loads((ROOT / "benchmarks" / "results" / "mapper_variants.json").read_text())
    # the comparison with every variant, the earlier ones reused as measured: its choice is what ships
    shipped_choice = json.loads((ROOT / "benchmarks" / "results" / "mapper_variants_longer.json").read_text())
    assert sorted(shipped_choice["choice"]) == sorted(p.name for p in zoo.MAPPERS_DIR.iterdir() if p.is_dir())
    for direction, choice in shipped_choice["choice"].items():
        kept = ROOT / "benchmarks" / "results" / "variants" / choice["variant"] / f"{direction}.json"
        shipped = zoo.MAPPERS_DIR / direction / "evaluation.json"
        assert json.loads(kept.read_text()) == json.loads(shipped.read_text()), direction
        (held_out,) = [
            path
            for folder in ("held_out_attention", "held_out_longer")
            for path in (ROOT / "benchmarks" / "results" / folder).glob(f"{choice['variant']}_{direction}.json")
        ]
        run = json.loads(held_out.read_text())["run"]
        config = json.loads((zoo.MAPPERS_DIR / direction / "config.json").read_text())
        assert run["mapper_content_hash"] == config["content_hash"], direction
        assert run["seed"] != json.loads(shipped.read_text())["run"]["seed"], direction  # items the choice never saw
    assert sorted(results["choice"]) == sorted(shipped_choice["choice"])  # its table: tests/docs (benchmarks.docs)


@pytest.mark.slow
def test_shipped_mapper_carries_the_context_to_the_target():
    """Quality floor: the large model reading the small model's mapped cache predicts the continuation of a text
    about as well as from its own prefill (perplexity protocol), and better than the small model itself."""
    tokenizer = zoo.load_tokenizer(padding_side="left")
    source, target = zoo.load_model("tiny-s"), zoo.load_model("tiny-l")
    mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-s", "tiny-l"))
    handoff = Handoff(source=source, target=target, mapper=mapper, tokenizer=tokenizer)
    items = corpus.make_eval_set("text", 12, seed=99, n_chars=384)
    ppl = {mode: evaluate_items(handoff, "perplexity", items, mode) for mode in ("source", "target", "mapped")}
    assert ppl["mapped"] <= 1.02 * ppl["target"], ppl
    assert ppl["mapped"] < ppl["source"] - 0.05, ppl


@pytest.mark.slow
def test_shipped_mapper_recalls_facts_the_source_cannot():
    """Quality floor on generation: after the handoff, the large model recalls a code from the small model's
    context far more often than the small model itself does (items the shipped evaluation did not use)."""
    tokenizer = zoo.load_tokenizer(padding_side="left")
    source, target = zoo.load_model("tiny-s"), zoo.load_model("tiny-l")
    mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-s", "tiny-l"))
    handoff = Handoff(source=source, target=target, mapper=mapper, tokenizer=tokenizer)
    items = corpus.make_eval_set("recall", 40, seed=99)
    recall = {mode: evaluate_items(handoff, "exact_match", items, mode, stop="\n") for mode in ("source", "mapped")}
    assert recall["mapped"] >= recall["source"] + 0.25, recall


if __name__ == "__main__":
    torch.set_num_threads(1)
    DIGESTS.write_text(json.dumps({pair: mapped_cache_digests(pair) for pair in PAIRS}, indent=2) + "\n")
