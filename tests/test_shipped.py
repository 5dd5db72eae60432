"""The mappers the package ships: their mapped caches equal the recorded reference values (to float-kernel noise),
their models, the variant chosen for each direction, and quality floors (slow).

Regenerate `tests/data/mapped_cache_summaries.json` only on purpose (`python tests/test_shipped.py`), when a change is
meant to alter the mapping; a refactoring must leave every mapped cache within `TOLERANCE` of the recorded one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_kvmap import (
    MappedCache,
    MapperModel,
    zoo,
)
from hf_kvmap._compat import output_cache
from hf_kvmap.evaluation import HandoffEvaluation, evaluate_items
from hf_kvmap.zoo import corpus

ROOT = Path(__file__).resolve().parents[1]


SUMMARIES = Path(__file__).resolve().parent / "data" / "mapped_cache_summaries.json"
PAIRS = sorted(p.name for p in zoo.MAPPERS_DIR.iterdir() if p.is_dir())
#: prompt lengths (tokens): short enough for the per-position reference values to stay small, longer than any window
LENGTHS = (12, 9, 5)
#: relative to a position's norm (or the layer's mean norm where larger): a correct float32 kernel of another CPU
#: moves a mapped vector by about 1e-5 of its norm (measured: AVX-512, AVX2 and ATEN_CPU_CAPABILITY=default), a
#: change of the mapping by far more
TOLERANCE = 1e-4


def _prompts(tokenizer) -> list[list[int]]:
    items = corpus.make_eval_set("recall", 2, seed=7) + corpus.make_eval_set("chat", 1, seed=7)
    return [tokenizer(item.context)["input_ids"][:length] for item, length in zip(items, LENGTHS)]


def _direction(size: int) -> torch.Tensor:
    """A fixed unit vector of `size` from integer arithmetic (identical on every machine, unlike a float RNG)."""
    index = torch.arange(size, dtype=torch.int64)
    state = (index * 2654435761 + 12345) % 2**31
    for _ in range(3):
        state = (state * 1103515245 + 12345) % 2**31
    direction = state.double() / 2**31 - 0.5
    return direction / direction.norm()


def _summary(tensor: torch.Tensor) -> dict:
    """Per batch row and position: the norm of the position's vector (every head) and its component along a fixed
    direction, in float64."""
    batch, heads, length, dim = tensor.shape
    vectors = tensor.detach().double().permute(0, 2, 1, 3).reshape(batch, length, heads * dim)
    return {"norm": vectors.norm(dim=-1), "projection": vectors @ _direction(heads * dim)}


@torch.no_grad()
def mapped_caches(pair: str) -> dict[str, MappedCache]:
    """The pair's mapped caches of one prompt at a time and of the left-padded batch of all prompts."""
    source_name, target_name = pair.split("-to-")
    tokenizer = zoo.load_tokenizer(padding_side="left")
    source = zoo.load_model(source_name)
    mapper = MapperModel.from_pretrained(zoo.mapper_path(source_name, target_name))
    out = {}
    prompts = _prompts(tokenizer)
    for index, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        out[f"prompt{index}"] = MappedCache.from_source(output_cache(source(input_ids=ids, use_cache=True)), mapper)
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    mask = batch["attention_mask"]
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    cache = source(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions, use_cache=True)
    out["left_padded_batch"] = MappedCache.from_source(
        output_cache(cache), mapper, attention_mask=mask, source_position_ids=positions, dtype=torch.float32
    )
    return out


def mapped_cache_summaries(pair: str) -> dict:
    """What `SUMMARIES` records per pair: every mapped layer's shape, dtype and per-position summaries (7 digits)."""

    def rounded(values: torch.Tensor) -> list:
        return [[float(f"{value:.7g}") for value in row] for row in values.tolist()]

    out = {}
    for name, cache in mapped_caches(pair).items():
        out[name] = [
            {
                kind: {
                    "shape": list(tensor.shape),
                    "dtype": str(tensor.dtype).removeprefix("torch."),
                    **{field: rounded(values) for field, values in _summary(tensor).items()},
                }
                for kind, tensor in (("keys", layer.keys), ("values", layer.values))
            }
            for layer in cache.layers
        ]
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("pair", PAIRS)
def test_shipped_mapper_gives_the_recorded_mapped_cache(pair, one_thread):
    """Shapes and dtypes exactly; every mapped vector's norm and direction within `TOLERANCE` of the recorded ones."""
    recorded = json.loads(SUMMARIES.read_text())["pairs"][pair]
    caches = mapped_caches(pair)
    assert sorted(caches) == sorted(recorded)
    for name, cache in caches.items():
        assert len(cache.layers) == len(recorded[name]), name
        for index, (layer, expected) in enumerate(zip(cache.layers, recorded[name])):
            for kind, tensor in (("keys", layer.keys), ("values", layer.values)):
                where = f"{pair} {name} layer {index} {kind}"
                reference = expected[kind]
                assert [list(tensor.shape), str(tensor.dtype).removeprefix("torch.")] == [
                    reference["shape"],
                    reference["dtype"],
                ], where
                norm = torch.tensor(reference["norm"], dtype=torch.float64)
                scale = torch.maximum(norm, norm.mean())
                for field, values in _summary(tensor).items():
                    torch.testing.assert_close(
                        values / scale,
                        torch.tensor(reference[field], dtype=torch.float64) / scale,
                        rtol=0,
                        atol=TOLERANCE,
                        msg=lambda message, where=where, field=field: f"{where} {field}: {message}",
                    )


def test_the_recorded_summaries_tell_a_changed_mapping_apart(one_thread):
    """The check is not blind: scaling one map of a shipped mapper by 1e-3 moves its mapped cache past the
    tolerance (a correct kernel of another CPU moves it by about 1e-5)."""
    pair = PAIRS[0]
    recorded = json.loads(SUMMARIES.read_text())["pairs"][pair]["prompt0"]
    source_name, target_name = pair.split("-to-")
    tokenizer = zoo.load_tokenizer()
    mapper = MapperModel.from_pretrained(zoo.mapper_path(source_name, target_name))
    with torch.no_grad():
        mapper.layers[0].value_proj.weight.mul_(1 + 1e-3)
        ids = torch.tensor([_prompts(tokenizer)[0]])
        cache = MappedCache.from_source(output_cache(zoo.load_model(source_name)(ids, use_cache=True)), mapper)
    moved = _summary(cache.layers[0].values)["norm"]
    norm = torch.tensor(recorded[0]["values"]["norm"], dtype=torch.float64)
    assert ((moved - norm).abs() / torch.maximum(norm, norm.mean())).max() > 5 * TOLERANCE


def test_shipped_mappers_match_their_models():
    tokenizer = zoo.load_tokenizer()
    for folder in sorted(zoo.MAPPERS_DIR.iterdir()):
        source_name, target_name = folder.name.split("-to-")
        mapper = MapperModel.from_pretrained(folder)  # verifies the content hash
        assert mapper.check_compatible(zoo.load_model(source_name), zoo.load_model(target_name), tokenizer) == []
        with torch.no_grad():
            ids = torch.tensor([tokenizer("ab=123\ncd=456\n?ab=")["input_ids"]])
            cache = MappedCache.from_source(output_cache(zoo.load_model(source_name)(ids, use_cache=True)), mapper)
        assert all(torch.isfinite(layer.keys).all() for layer in cache.layers)


def test_shipped_mappers_are_the_chosen_variants():
    """Each shipped mapper is the variant `benchmarks/variants/mapper_variants.py` chose for its direction among every variant
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
    handoff = HandoffEvaluation(source=source, target=target, mapper=mapper, tokenizer=tokenizer)
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
    handoff = HandoffEvaluation(source=source, target=target, mapper=mapper, tokenizer=tokenizer)
    items = corpus.make_eval_set("recall", 40, seed=99)
    recall = {mode: evaluate_items(handoff, "exact_match", items, mode, stop="\n") for mode in ("source", "mapped")}
    assert recall["mapped"] >= recall["source"] + 0.25, recall


if __name__ == "__main__":
    torch.set_num_threads(1)
    about = (
        "Per shipped pair and mapped cache: every layer's keys/values shape, dtype and, per batch row and position, "
        "the norm of the position's vector and its component along a fixed direction (tests/test_shipped.py)."
    )
    pairs = {pair: mapped_cache_summaries(pair) for pair in PAIRS}
    # one line per mapped cache: small, and a diff shows which cache moved
    lines = [
        f"  {json.dumps(pair)}: {{\n"
        + ",\n".join(
            f"    {json.dumps(name)}: {json.dumps(layers, separators=(',', ':'))}" for name, layers in caches.items()
        )
        + "\n  }"
        for pair, caches in pairs.items()
    ]
    SUMMARIES.write_text(f'{{\n "about": {json.dumps(about)},\n "pairs": {{\n' + ",\n".join(lines) + "\n }\n}\n")
