"""The README and the docs pages: their snippets run, every generated section is what the committed JSON renders
(`python -m benchmarks.docs`), and the committed comparisons are what the choice rule gives."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from benchmarks import docs
from hf_kvmap import MappedCache
from hf_kvmap._compat import cache_argument

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", sorted(docs.SECTIONS))
def test_page_is_what_the_committed_json_renders(page):
    """Every marked section of `page` is exactly what `python -m benchmarks.docs` renders from the committed JSON,
    and the page holds exactly the sections the command renders."""
    assert sorted(docs.markers((ROOT / page).read_text())) == sorted(docs.SECTIONS[page])
    assert docs.render(page) == (ROOT / page).read_text(), f"{page} drifted: run python -m benchmarks.docs"


def test_docs_check_passes_and_every_page_is_linked():
    """`python -m benchmarks.docs --check` exits 0 on the committed tree, and the README and docs/index.md link every
    page it writes."""
    assert docs.main(["--check"]) == 0
    readme, index = (ROOT / "README.md").read_text(), (ROOT / "docs" / "index.md").read_text()
    for page in docs.SECTIONS:
        if page.startswith("docs/"):
            assert f"]({page})" in readme, page
            assert f"]({page.removeprefix('docs/')})" in index, page


def test_every_erratum_names_real_results_and_warns_where_they_render():
    """`benchmarks/results/errata.json`: each known defect names results files that exist and the test that pins its
    fix, and every generated section rendered from such a file opens with its warning."""
    entries = docs._json("errata.json")["errata"]
    assert entries
    for entry in entries:
        assert entry["results"] and all((docs.RESULTS / name).is_file() for name in entry["results"])
        test_file, test_name = entry["check"].split("::")
        assert f"def {test_name}(" in (ROOT / test_file).read_text()
        for name in entry["results"]:
            assert docs.with_errata(name, "TABLE").startswith(f"> **Erratum ({entry['found']}")
            assert docs.with_errata(name, "TABLE").endswith("\n\nTABLE")
    assert docs.with_errata("handoff.json", "TABLE") == "TABLE"


def test_readme_is_a_front_door():
    """At most about 300 lines, and the first screenful holds usage, serving and the results summary."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    first = "\n".join(lines[:60])
    assert "handoff(source, target, mapper, ids" in first and "target.generate(ids, cache=cache" in first
    assert "**Where it stands.**" in first and "<!-- headline-tiny:start -->" in first
    # the first screen: the install (the main job's command) and the opening of a runnable snippet
    screen = lines[:30]
    assert any(line.startswith("pip install") and "hf-kvmap demo" in line for line in screen)
    assert "```python" in screen and screen.index("```python") > screen.index("```bash")
    # where it stands: tables, not a paragraph of numbers (every number of the README is in a generated section)
    stands = "\n".join(lines[lines.index(next(x for x in lines if x.startswith("**Where it stands.**"))) :][:6])
    assert not re.search(r"\d", stands.split("<!--")[0]), stands


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


def _snippet(after: str) -> str:
    """The first python block of the README after the line `after`."""
    readme = (ROOT / "README.md").read_text()
    return re.search(rf"{re.escape(after)}\n.*?```python\n(.*?)```", readme, re.DOTALL).group(1)


def test_readme_guarded_snippet_runs():
    namespace = _run_snippet(_snippet("# hf-kvmap"))
    assert namespace["out"].shape[1] == namespace["ids"].shape[1] + 4
    assert namespace["report"].accepted in (True, False) and namespace["report"].threshold is not None


def test_readme_usage_snippet_runs():
    namespace = _run_snippet(_snippet("### Mapping a cache"))
    assert isinstance(namespace["cache"], MappedCache)
    assert namespace["out"].shape[1] == namespace["ids"].shape[1] + 4


def test_readme_repair_snippet_runs():
    namespace = _run_snippet(_snippet("### Between mapped and prefill: repair and the guard ladder"))
    record = namespace["report"].repair
    assert record["strategy"] == {"name": "draft_attention", "draft_tokens": 8, "last_tokens": 0, "stop_at_eos": True}
    assert record["exact"] is False
    assert record["recomputed"] == [int(0.2 * n) for n in record["candidates"]]


def test_readme_left_padded_batch_recipe_runs():
    """The recipe as written runs (its exactness is `tests/test_cache.py`'s left-padding tests)."""
    import torch

    recipe = _snippet("masks other than 0/1 are refused.")
    namespace = _run_snippet(_snippet("### Mapping a cache") + recipe)
    batch, cache, out = namespace["batch"], namespace["cache"], namespace["out"]
    width = batch.input_ids.shape[1]
    assert isinstance(cache, MappedCache) and cache.mapping_info["mapped_tokens"] == width - 1
    assert out.shape == (2, width + 4) and torch.equal(out[:, :width], batch.input_ids)


def test_readme_fitting_snippet_runs(tmp_path, monkeypatch):
    from hf_kvmap import MapperModel

    monkeypatch.chdir(tmp_path)
    _run_snippet(_snippet("### Fitting, evaluating, publishing"))
    assert MapperModel.from_pretrained(tmp_path / "outputs" / "my-mapper").config.content_hash


def _comparison(path: str):
    """`(benchmarks.variants.mapper_variants, the committed comparison at path)`."""
    from benchmarks.variants import mapper_variants

    return mapper_variants, json.loads((ROOT / path).read_text())


def test_objectives_comparison_chooses_by_the_rule():
    script, results = _comparison("benchmarks/results/mapper_variants_objectives.json")
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
    script, results = _comparison("benchmarks/results/mapper_variants_attention.json")
    _assert_the_rule_chose(script, results)
    assert {d: c["variant"] for d, c in results["choice"].items()} == {
        "tiny-l-to-tiny-s": "mlp",
        "tiny-m-to-tiny-l": "ridge-l3w3-kn-attn-kl",
        "tiny-s-to-tiny-l": "ridge-l3w3-kn-attn-kl",
        "tiny-x-to-tiny-l": "ridge-l3w3-kn-attn-kl",
    }
    _assert_keeps_every_row_of(results, "mapper_variants_objectives.json")


def test_shipped_comparison_keeps_every_row_and_its_held_out_files_are_the_choice():
    """The last comparison (the tiny-s rows, then the longer tiny-m and tiny-x fits, each added by `--reuse`) keeps
    every row of the ones it extends as measured there, its choice is the rule's, and the held-out section of
    docs/results-tiny-family.md lists exactly one file per direction, of the variant chosen there."""
    script, results = _comparison("benchmarks/results/mapper_variants_longer.json")
    _assert_the_rule_chose(script, results)
    assert {d: c["variant"] for d, c in results["choice"].items()} == {
        "tiny-l-to-tiny-s": "ridge-l1w3-kn-attn-kl",
        "tiny-m-to-tiny-l": "ridge-l3w3-kn-attn4000-kl",
        "tiny-s-to-tiny-l": "ridge-l3w3-kn-attn-kl",
        "tiny-x-to-tiny-l": "ridge-l3w3-kn-attn4000-kl",
    }
    _assert_keeps_every_row_of(results, "mapper_variants_attention.json", "mapper_variants_shipped.json")
    paths = docs.held_out_shipped_paths()
    assert sorted(path.stem for path in paths) == sorted(f"{c['variant']}_{d}" for d, c in results["choice"].items())
    held = _section("docs/results-tiny-family.md", "mapper-held-out-shipped")
    assert re.findall(r"`(benchmarks/results/[^`]+\.json)`", held.split("\n", 1)[0]) == [
        path.relative_to(ROOT).as_posix() for path in paths
    ]


def _section(page: str, name: str) -> str:
    text = (ROOT / page).read_text()
    return re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", text, re.DOTALL).group(1)


def test_package_weight_lists_every_shipped_mapper():
    result = json.loads((ROOT / "benchmarks" / "results" / "package_size.json").read_text())
    shipped = sorted(p.name for p in (ROOT / "hf_kvmap" / "zoo" / "mappers").iterdir() if p.is_dir())
    assert sorted(result["sizes"]["mapper_bytes"]) == shipped
    assert "**Package weight.**" in _section("README.md", "package-weight")


def test_retention_curve_is_what_the_committed_comparison_builds():
    """The curve's JSON is what `benchmarks.variants.retention_curve` builds from the comparison and held-out files it names
    (its table in docs/results-tiny-family.md is checked with every other section)."""
    from transformers import Qwen3Config

    from benchmarks.variants import retention_curve as script
    from hf_kvmap.configuration_mapper import summarize_model_config

    result = json.loads((ROOT / "benchmarks" / "results" / "retention_curve.json").read_text())
    comparison = json.loads((ROOT / result["run"]["comparison"]).read_text())
    held_out = {}
    for name in result["run"]["held_out"]:
        variant, _, direction = Path(name).stem.partition("_")
        held_out[(variant, direction)] = json.loads((ROOT / name).read_text())
    qwen = tuple(summarize_model_config(Qwen3Config(**script.QWEN3[n])) for n in ("14B", "32B"))
    assert json.loads(json.dumps(script.build(comparison, held_out, qwen))) == result["directions"]


def test_ci_runs_the_readme_test_command():
    """`.ci/run` runs the README's test command, command by command and in order (then its own further steps)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"Run the tests[^\n]*\n\n```bash\n(.*?)\n```", readme, re.DOTALL).group(1)
    commands = [command.strip() for command in block.split("&&")]
    assert commands[0].startswith("pip install") and all(c.startswith("python -m pytest") for c in commands[1:])
    lines = [line.split(" || ")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    positions = [lines.index(command) for command in commands]
    assert positions == sorted(positions)


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_every_relative_link_of_the_readme_and_docs_resolves():
    """Every relative markdown link of README.md, CONTRIBUTING.md and docs/*.md names a file that exists, and a
    `#anchor` one of its headings (pages move; links must move with them)."""
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code blocks hold no links
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.name}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target.read_text()):
                broken.append(f"{page.name}: {link} (no such heading)")
    assert not broken, broken


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_every_docs_page_opens_with_the_decision_and_stays_short(page):
    """A docs page says what its reader decides from it within its first 15 lines and holds at most 400 lines (the
    history of experiments goes to a dated `docs/notes/` page)."""
    lines = (ROOT / "docs" / page).read_text().splitlines()
    assert len(lines) <= 400, f"docs/{page} has {len(lines)} lines; move its history to docs/notes/"
    assert re.search(r"decide|what to do", "\n".join(lines[:15]), flags=re.IGNORECASE), page
