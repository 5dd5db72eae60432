"""The README: its usage snippet runs, its tables are what the committed JSON renders."""

from __future__ import annotations

import json
import re
from pathlib import Path

from hf_kvmap import MappedCache
from hf_kvmap.reporting import demo_markdown

ROOT = Path(__file__).resolve().parents[2]


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


def test_readme_performance_is_generated_from_the_committed_json():
    from hf_kvmap.reporting import performance_markdown

    readme = (ROOT / "README.md").read_text()
    results = json.loads((ROOT / "benchmarks" / "results" / "apply.json").read_text())
    section = re.search(r"<!-- performance:start -->\n(.*?)<!-- performance:end -->", readme, re.DOTALL).group(1)
    assert section.strip() == performance_markdown(results, "benchmarks/results/apply.json").strip()
