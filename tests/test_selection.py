"""Source-layer selection: the top-k rule, the probe scores, their JSON and heat map."""

from __future__ import annotations

import json

import pytest
import torch

from hf_kvmap import (
    LayerSelection,
)
from hf_kvmap.plotting import plot_selection
from hf_kvmap.selection import select_top_k


def test_select_top_k_rules():
    scores = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.7, 0.2]])
    assert select_top_k(scores, 1) == [[1], [0]]  # ties go to the lower layer
    assert select_top_k(scores, 2) == [[1, 2], [0, 1]]  # ascending
    assert select_top_k(scores, None) == select_top_k(scores, 7) == [[0, 1, 2]] * 2
    with pytest.raises(ValueError, match="top_k"):
        select_top_k(scores, 0)


def test_selection_json_and_heatmap(random_pair_stats, tmp_path):
    selection = LayerSelection.from_statistics(random_pair_stats, 2)
    selection.save_selection_json(tmp_path / "selection.json")
    data = json.loads((tmp_path / "selection.json").read_text())
    assert data["source_layers"] == selection.source_layers and data["probe"] == "per_head"
    assert len(data["scores"]) == 3 and len(data["scores"][0]) == 4 and set(data["r2"]) == {"key", "value"}
    pytest.importorskip("matplotlib")
    assert plot_selection(selection, tmp_path / "selection.png")
    assert (tmp_path / "selection.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
