"""`evaluate` metric modules shipped with hf-kvmap, loadable offline.

import evaluate
from hf_kvmap.metrics import RETENTION_PATH, load_retention
metric = evaluate.load(RETENTION_PATH)      # or: load_retention()
"""

from __future__ import annotations

from pathlib import Path

RETENTION_PATH = str(Path(__file__).resolve().parent / "retention")


def load_retention():
    """The retention metric, instantiated directly (no `evaluate.load`, no network)."""
    from .retention.retention import Retention

    return Retention()
