"""Every test under tests/docs/ is a consistency check of committed docs, cards and results (marker `docs`): it fails
when the docs drift from the results JSON, not when the library changes. Run them alone with `pytest -m docs`."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.docs)
