"""The shipped mappers' cards are exactly what the library renders from their configs and evaluations."""

from __future__ import annotations

import json
from pathlib import Path

from hf_kvmap import (
    MapperModel,
    zoo,
)


def test_shipped_model_cards_have_not_drifted():
    """model_cards/ holds the generated cards of the shipped mappers; regenerating them must give the same text."""

    from hf_kvmap.card import render_card

    cards = Path(__file__).resolve().parents[2] / "model_cards"
    folders = sorted(p for p in zoo.MAPPERS_DIR.iterdir() if p.is_dir())
    assert folders, "no shipped mappers"
    assert sorted(p.stem for p in cards.glob("*.md") if p.name != "README.md") == [p.name for p in folders]
    for folder in folders:
        mapper = MapperModel.from_pretrained(folder)
        evaluation = json.loads((folder / "evaluation.json").read_text())
        rendered = str(render_card(mapper, evaluation, model_name=folder.name))
        assert (folder / "README.md").read_text().strip() == rendered.strip(), folder.name
        assert (cards / f"{folder.name}.md").read_text().strip() == rendered.strip(), folder.name
