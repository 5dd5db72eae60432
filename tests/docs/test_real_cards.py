"""The real family's committed cards are what its committed results JSON renders (from the committed configs); the
docs pages' sections are checked by `test_readme.py` with every other page."""

from __future__ import annotations

import json

from benchmarks.real import common, scale, scale_report
from hf_kvmap import MapperConfig
from hf_kvmap.card import render_card


def test_real_family_cards_have_not_drifted():
    """Each mapper of `benchmarks/results/real_family.json` has the card its results render."""
    report = json.loads(common.FAMILY_RESULTS.read_text())
    expected = {
        f"qwen2.5-coder-{direction}-{variant}": results
        for direction, entry in report["directions"].items()
        for variant, results in entry["variants"].items()
    }
    assert expected, "results without mappers"
    for name, results in expected.items():
        config = MapperConfig.from_pretrained(common.CONFIGS / name)
        rendered = render_card(common.weightless_mapper(config), common.card_results(report, results), model_name=name)
        assert (common.CARDS / f"{name}.md").read_text().strip() == str(rendered).strip(), name


def test_scale_cards_have_not_drifted():
    """The cards of the paper-scale fits are what the committed scale results render (from the committed configs),
    and every card in model_cards/real/ is one of the 16K fits' or of these."""
    report = json.loads(scale.SCALE_RESULTS.read_text())
    fits = scale_report.paper_scale_fits(report)
    for name, (_, row) in fits.items():
        config = MapperConfig.from_pretrained(common.CONFIGS / name)
        rendered = scale_report.render_scale_card(name, config, report, row)
        assert (common.CARDS / f"{name}.md").read_text().strip() == str(rendered).strip(), name
    sixteen = json.loads(common.FAMILY_RESULTS.read_text())["directions"]
    fits.update({f"qwen2.5-coder-{d}-{v}": None for d, entry in sixteen.items() for v in entry["variants"]})
    assert {card.stem for card in common.CARDS.glob("*.md")} == set(fits)
