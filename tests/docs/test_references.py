"""No file of the repository points at a file the repository lacks: markdown links (`test_readme.py`), and file names
written out in text, docstrings and comments, which no link checker follows."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the folders whose files are checked, and the top-level files
FOLDERS = ("hf_kvmap", "tests", "benchmarks", "docs", "examples", "model_cards", ".ci")
TOP_FILES = ("README.md", "CONTRIBUTING.md", "pyproject.toml", "constraints.txt")
#: results JSON records machines' paths; it is data, not text that refers a reader somewhere
SKIPPED = ("benchmarks/results",)
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".jinja", ".cfg", ".yaml", ".yml", ""}
#: a markdown file named in text: `docs/guard.md`, `benchmarks/README.md`, `CONTRIBUTING.md`, ...
MENTION = re.compile(r"(?<![\w./{}<>-])((?:[\w.-]+/)*[\w.-]*\w\.md)(?![\w.])")


def _text_files() -> list[Path]:
    files = [ROOT / name for name in TOP_FILES]
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            relative = path.relative_to(ROOT).as_posix()
            if path.is_file() and path.suffix in TEXT_SUFFIXES and not relative.startswith(SKIPPED):
                if "__pycache__" not in path.parts and path != Path(__file__).resolve():  # this file names some
                    files.append(path)
    return files


def dangling_mentions(path: Path, text: str) -> list[str]:
    """The markdown files `text` (the content of `path`) names that do not exist.

    A name with a folder is checked when the folder is one of the repository's own (`docs/x.md`, `benchmarks/...`),
    from the repository root or from `path`'s folder; a bare name in capitals (`README.md`, `CONTRIBUTING.md`) from the
    root or `path`'s folder. Other names (a temporary file of a test, `folder/README.md` of a user's mapper) are
    outputs, not references."""
    top = {entry.name for entry in ROOT.iterdir()}
    dangling = []
    for name in MENTION.findall(text):
        head, _, rest = name.partition("/")
        referring = (rest and head in top) or (not rest and Path(name).stem.isupper())
        if referring and not ((ROOT / name).exists() or (path.parent / name).exists()):
            dangling.append(name)
    return dangling


def test_no_file_names_a_file_the_repository_lacks():
    """Every markdown file named in the repository's text (docstrings, comments, docs, the CI script) exists."""
    files = _text_files()
    assert len(files) > 100  # the walk found the repository
    broken = [
        f"{path.relative_to(ROOT)}: {name}" for path in files for name in dangling_mentions(path, path.read_text())
    ]
    assert not broken, broken


def test_the_paper_is_cited_through_docs_method():
    """The method and its published numbers are restated in docs/method.md; nothing points at a notes file outside
    the repository instead."""
    assert (ROOT / "docs" / "method.md").is_file()
    assert [str(path.relative_to(ROOT)) for path in _text_files() if "PAPER.md" in path.read_text()] == []


def test_the_mention_check_tells_a_missing_file_apart():
    """Control: the check flags missing pages and notes, and passes existing ones and outputs."""
    here = ROOT / "docs" / "index.md"
    assert dangling_mentions(here, "see PAPER.md and docs/nowhere.md") == ["PAPER.md", "docs/nowhere.md"]
    assert dangling_mentions(here, "see docs/guard.md, README.md, guard.md, `folder/README.md`, tmp/table.md") == []
