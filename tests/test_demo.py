"""The main job: `hf-kvmap demo` on the shipped tiny family, the README it documents, and a quality floor."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import torch

from hf_kvmap import MappedCache, MapperModel, zoo
from hf_kvmap.cli import main as cli_main
from hf_kvmap.evaluation import Handoff, evaluate_items
from hf_kvmap.reporting import demo_markdown
from hf_kvmap.zoo import corpus

ROOT = Path(__file__).resolve().parents[1]


def test_short_demo_writes_every_task(tmp_path):
    out, plot = tmp_path / "demo.json", tmp_path / "demo.png"
    args = ["demo", "--items", "6", "--lengths", "32,64", "--repeats", "1", "--json", str(out), "--plot", str(plot)]
    assert cli_main(args) == 0
    results = json.loads(out.read_text())
    assert set(results["tasks"]) == {"recall", "arithmetic", "choice", "chat"}
    for row in results["tasks"].values():
        for key in ("source", "target", "mapped", "chance"):
            assert math.isfinite(row[key])
        assert "retention" in row and "floor_normalized_retention" in row
    assert math.isfinite(results["perplexity"]["text"]["mapped"])
    assert [row["tokens"] for row in results["latency"]] == [32, 64]
    assert all(row["mapper_ms"] > 0 and row["prefill_ms"] > 0 for row in results["latency"])
    assert plot.stat().st_size > 10_000


def test_readme_results_are_generated_from_the_committed_json():
    readme = (ROOT / "README.md").read_text()
    results = json.loads((ROOT / "benchmarks" / "results" / "demo.json").read_text())
    section = re.search(r"<!-- demo-results:start -->\n(.*?)<!-- demo-results:end -->", readme, re.DOTALL).group(1)
    assert section.strip() == demo_markdown(results, "benchmarks/results/demo.json").strip()


def test_readme_usage_snippet_runs():
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"## Usage\n\n```python\n(.*?)```", readme, re.DOTALL).group(1)
    namespace: dict = {}
    exec(compile(snippet, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    assert isinstance(namespace["cache"], MappedCache)
    assert namespace["out"].shape[1] == namespace["ids"].shape[1] + 4


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


def test_readme_performance_is_generated_from_the_committed_json():
    from hf_kvmap.reporting import performance_markdown

    readme = (ROOT / "README.md").read_text()
    results = json.loads((ROOT / "benchmarks" / "results" / "apply.json").read_text())
    section = re.search(r"<!-- performance:start -->\n(.*?)<!-- performance:end -->", readme, re.DOTALL).group(1)
    assert section.strip() == performance_markdown(results, "benchmarks/results/apply.json").strip()


def test_shipped_mappers_are_the_chosen_variants():
    """Each shipped mapper is the variant `benchmarks/mapper_variants.py` chose for its direction: its evaluation is
    the one kept for that variant, and the README's variant table is generated from the committed JSON."""
    results = json.loads((ROOT / "benchmarks" / "results" / "mapper_variants.json").read_text())
    assert sorted(results["choice"]) == sorted(p.name for p in zoo.MAPPERS_DIR.iterdir() if p.is_dir())
    for direction, choice in results["choice"].items():
        kept = ROOT / "benchmarks" / "results" / "variants" / choice["variant"] / f"{direction}.json"
        shipped = zoo.MAPPERS_DIR / direction / "evaluation.json"
        assert json.loads(kept.read_text()) == json.loads(shipped.read_text()), direction
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"<!-- mapper-variants:start -->\n(.*?)<!-- mapper-variants:end -->", readme, re.DOTALL)
    spec = importlib.util.spec_from_file_location("mapper_variants", ROOT / "benchmarks" / "mapper_variants.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    table = script.markdown(results["directions"], results["choice"])
    assert section.group(1).strip() == f"Generated from `benchmarks/results/mapper_variants.json`.\n\n{table}".strip()
