"""The README: its usage snippet runs, its tables are what the committed JSON renders."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from hf_kvmap import MappedCache
from hf_kvmap._compat import cache_argument
from hf_kvmap.reporting import demo_markdown

ROOT = Path(__file__).resolve().parents[2]


def _run_snippet(code: str) -> dict:
    """Run README code as a user would on the installed transformers, a FutureWarning (a deprecated name) failing it.

    The snippets use the current transformers' `cache=` / `.cache`; on 5.23 (which takes `past_key_values` only)
    such a snippet is skipped, said so."""
    if cache_argument() == "past_key_values" and re.search(r"\bcache=|\.cache\b", code):
        pytest.skip("the README's snippets use `cache=` (transformers>=5.24); this transformers takes past_key_values")
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    return namespace


def test_readme_results_are_generated_from_the_committed_json():
    readme = (ROOT / "README.md").read_text()
    results = json.loads((ROOT / "benchmarks" / "results" / "demo.json").read_text())
    section = re.search(r"<!-- demo-results:start -->\n(.*?)<!-- demo-results:end -->", readme, re.DOTALL).group(1)
    assert section.strip() == demo_markdown(results, "benchmarks/results/demo.json").strip()


def test_readme_usage_snippet_runs():
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"## Usage\n\n```python\n(.*?)```", readme, re.DOTALL).group(1)
    namespace = _run_snippet(snippet)
    assert isinstance(namespace["cache"], MappedCache)
    assert namespace["out"].shape[1] == namespace["ids"].shape[1] + 4


def test_readme_performance_is_generated_from_the_committed_json():
    from hf_kvmap.reporting import performance_markdown

    readme = (ROOT / "README.md").read_text()
    results = json.loads((ROOT / "benchmarks" / "results" / "apply.json").read_text())
    section = re.search(r"<!-- performance:start -->\n(.*?)<!-- performance:end -->", readme, re.DOTALL).group(1)
    assert section.strip() == performance_markdown(results, "benchmarks/results/apply.json").strip()


def test_readme_left_padded_batch_recipe_runs():
    """The recipe as written runs (its exactness is `tests/test_cache.py`'s left-padding tests)."""
    import torch

    readme = (ROOT / "README.md").read_text()
    usage = re.search(r"## Usage\n\n```python\n(.*?)```", readme, re.DOTALL).group(1)
    recipe = re.search(r"masks other than 0/1 are refused\.\n\n```python\n(.*?)```", readme, re.DOTALL).group(1)
    namespace = _run_snippet(usage + recipe)
    batch, cache, out = namespace["batch"], namespace["cache"], namespace["out"]
    width = batch.input_ids.shape[1]
    assert isinstance(cache, MappedCache) and cache.mapping_info["mapped_tokens"] == width - 1
    assert out.shape == (2, width + 4) and torch.equal(out[:, :width], batch.input_ids)


def test_readme_variant_parameters_are_generated_from_the_committed_json():
    import importlib.util

    path = ROOT / "benchmarks" / "variant_parameters.py"
    spec = importlib.util.spec_from_file_location("variant_parameters", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    readme = (ROOT / "README.md").read_text()
    results = json.loads((ROOT / "benchmarks" / "results" / "variant_parameters.json").read_text())
    section = re.search(r"<!-- variant-parameters:start -->\n(.*?)<!-- variant-parameters:end -->", readme, re.DOTALL)
    source = "Generated from `benchmarks/results/variant_parameters.json` by `benchmarks/variant_parameters.py`."
    assert section.group(1).strip() == f"{source}\n\n{script.markdown(results)}".strip()


def test_readme_held_out_scores_are_generated_from_the_committed_json():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mapper_variants", ROOT / "benchmarks" / "mapper_variants.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"<!-- mapper-held-out:start -->\n(.*?)<!-- mapper-held-out:end -->", readme, re.DOTALL)
    paths = sorted((ROOT / "benchmarks" / "results" / "held_out").glob("*.json"))
    names = ", ".join(f"`{path.relative_to(ROOT).as_posix()}`" for path in paths)
    expected = f"Generated from {names} (`hf-kvmap eval`).\n\n{script.held_out_markdown(paths)}"
    assert section.group(1).strip() == expected.strip()


def _variants_section(name: str, path: str):
    """`(mapper_variants module, the committed JSON at path, README section name's body, the table it renders)`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mapper_variants", ROOT / "benchmarks" / "mapper_variants.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    readme = (ROOT / "README.md").read_text()
    section = re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", readme, re.DOTALL).group(1)
    results = json.loads((ROOT / path).read_text())
    return script, results, section, script.markdown(results["directions"], results["choice"])


def test_readme_objectives_comparison_is_generated_from_the_committed_json():
    path = "benchmarks/results/mapper_variants_objectives.json"
    script, results, section, table = _variants_section("mapper-variants-objectives", path)
    assert section.strip() == f"Generated from `{path}`.\n\n{table}".strip()
    assert {d: c["variant"] for d, c in results["choice"].items()} == {
        "tiny-l-to-tiny-s": "mlp",
        "tiny-m-to-tiny-l": "ridge-l3w3-kn-kl",
        "tiny-s-to-tiny-l": "ridge-l3w3-kn-kl",
        "tiny-x-to-tiny-l": "ridge-l3w3-kn-kl",
    }
    _assert_the_rule_chose(script, results)


def _assert_the_rule_chose(script, results: dict) -> None:
    """The recorded choice per direction is what the rule gives on the comparison's rows."""
    assert {d: script.choose(rows)["variant"] for d, rows in results["directions"].items()} == {
        d: c["variant"] for d, c in results["choice"].items()
    }


def _assert_keeps_every_row_of(results: dict, *earlier: str) -> None:
    """Every variant of each comparison `results` extends is in it, as it was measured there."""
    for name in earlier:
        rows_then = json.loads((ROOT / "benchmarks" / "results" / name).read_text())["directions"]
        for direction, rows in rows_then.items():
            for variant, row in rows.items():
                assert results["directions"][direction][variant] == row, (name, direction, variant)


def test_attention_objective_comparison_keeps_every_earlier_row():
    path = "benchmarks/results/mapper_variants_attention.json"
    script = _variants_section("mapper-variants-objectives", path)[0]
    results = json.loads((ROOT / path).read_text())
    _assert_the_rule_chose(script, results)
    assert {d: c["variant"] for d, c in results["choice"].items()} == {
        "tiny-l-to-tiny-s": "mlp",
        "tiny-m-to-tiny-l": "ridge-l3w3-kn-attn-kl",
        "tiny-s-to-tiny-l": "ridge-l3w3-kn-attn-kl",
        "tiny-x-to-tiny-l": "ridge-l3w3-kn-attn-kl",
    }
    _assert_keeps_every_row_of(results, "mapper_variants_objectives.json")


def test_readme_shipped_comparison_is_generated_from_the_committed_json():
    """The last comparison (the tiny-s rows, then the longer tiny-m and tiny-x fits, each added by `--reuse`) is the README's
    shipped table, keeps every row of the ones it extends as measured there, and its choice is the rule's; the
    held-out section lists exactly one file per direction, of the variant chosen there."""
    path = "benchmarks/results/mapper_variants_longer.json"
    script, results, section, table = _variants_section("mapper-variants-shipped", path)
    assert section.strip() == f"Generated from `{path}`.\n\n{table}".strip()
    _assert_the_rule_chose(script, results)
    assert {d: c["variant"] for d, c in results["choice"].items()} == {
        "tiny-l-to-tiny-s": "ridge-l1w3-kn-attn-kl",
        "tiny-m-to-tiny-l": "ridge-l3w3-kn-attn4000-kl",
        "tiny-s-to-tiny-l": "ridge-l3w3-kn-attn-kl",
        "tiny-x-to-tiny-l": "ridge-l3w3-kn-attn4000-kl",
    }
    _assert_keeps_every_row_of(results, "mapper_variants_attention.json", "mapper_variants_shipped.json")
    held = _section("mapper-held-out-shipped")
    names = re.findall(r"`(benchmarks/results/[^`]+\.json)`", held.split("\n", 1)[0])
    paths = [ROOT / name for name in names]
    assert sorted(path.stem for path in paths) == sorted(f"{c['variant']}_{d}" for d, c in results["choice"].items())
    listed = ", ".join(f"`{name}`" for name in names)
    assert held.strip() == f"Generated from {listed} (`hf-kvmap eval`).\n\n{script.held_out_markdown(paths)}"


def _script(name: str):
    import importlib.util
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return script


def _section(name: str) -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", readme, re.DOTALL).group(1)


def test_readme_package_weight_is_generated_from_the_committed_json():
    result = json.loads((ROOT / "benchmarks" / "results" / "package_size.json").read_text())
    assert _section("package-weight").strip() == _script("package_size").markdown(result).strip()
    shipped = sorted(p.name for p in (ROOT / "hf_kvmap" / "zoo" / "mappers").iterdir() if p.is_dir())
    assert sorted(result["sizes"]["mapper_bytes"]) == shipped


def test_readme_retention_curve_is_generated_from_the_committed_comparison():
    """The curve's JSON is what the script builds from the comparison and held-out files it names, and the README
    section is its table."""
    script = _script("retention_curve")
    path = "benchmarks/results/retention_curve.json"
    result = json.loads((ROOT / path).read_text())
    comparison = json.loads((ROOT / result["run"]["comparison"]).read_text())
    held_out = {}
    for name in result["run"]["held_out"]:
        variant, _, direction = Path(name).stem.partition("_")
        held_out[(variant, direction)] = json.loads((ROOT / name).read_text())
    from transformers import Qwen3Config

    from hf_kvmap.configuration_mapper import summarize_model_config

    qwen = tuple(summarize_model_config(Qwen3Config(**script.QWEN3[n])) for n in ("14B", "32B"))
    assert json.loads(json.dumps(script.build(comparison, held_out, qwen))) == result["directions"]
    expected = f"Generated from `{path}` by `benchmarks/retention_curve.py`.\n\n{script.markdown(result)}"
    assert _section("retention-curve").strip() == expected.strip()


def test_ci_runs_the_readme_test_command():
    """`.ci/run` runs the README's test command, command by command and in order (then its own further steps)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"Run the tests[^\n]*\n\n```bash\n(.*?)\n```", readme, re.DOTALL).group(1)
    commands = [command.strip() for command in block.split("&&")]
    assert commands[0].startswith("pip install") and all(c.startswith("python -m pytest") for c in commands[1:])
    lines = [line.split(" || ")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    positions = [lines.index(command) for command in commands]
    assert positions == sorted(positions)
