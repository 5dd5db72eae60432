"""Diagnostics: perfect for an identity mapper, and they point at a damaged layer."""

from __future__ import annotations

import pytest
import torch

from hf_kvmap import (
    MapperModel,
)
from hf_kvmap.evaluation import HandoffEvaluation, TaskSpec
from hf_kvmap.zoo import corpus


@pytest.fixture(scope="module")
def handoff(identity_handoff):
    return identity_handoff


def test_diagnostics_of_identity_mapper_are_perfect(handoff):
    from hf_kvmap.diagnostics import diagnose

    ids = torch.randint(3, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    result = diagnose(handoff.source, handoff.target, handoff.mapper, [ids], query_tokens=8)
    assert len(result["layers"]) == 2 and len(result["layers"][0]["attention_cosine"]) == 4
    assert result["summary"]["mean_key_r2"] == pytest.approx(1.0, abs=1e-6)
    assert result["summary"]["mean_value_r2"] == pytest.approx(1.0, abs=1e-9)
    assert result["summary"]["min_layer_attention_cosine"] == pytest.approx(1.0, abs=1e-6)


def test_diagnostics_see_a_damaged_layer(handoff):
    from hf_kvmap.diagnostics import diagnose

    damaged = MapperModel.identity(handoff.target.config)
    with torch.no_grad():
        damaged.layers[1].value_proj.weight.mul_(-1.0)  # values of layer 1 flipped
    ids = torch.randint(3, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    result = diagnose(handoff.source, handoff.target, damaged, [ids], query_tokens=8)
    assert min(result["layers"][0]["attention_cosine"]) == pytest.approx(1.0, abs=1e-6)
    # the held-back and query tokens keep their own (true) values, so the cosine is strongly negative, not -1
    assert max(result["layers"][1]["attention_cosine"]) < -0.5
    assert max(result["layers"][1]["value_r2"]) < -1.0


def test_layer_swap_points_at_the_damaged_layer(handoff):
    from hf_kvmap.diagnostics import layer_swap

    task = TaskSpec("text", "perplexity", corpus.make_eval_set("text", 3, seed=2, n_chars=96))
    exact = layer_swap(handoff, task)  # identity mapper: every swap equals the target's own cache
    assert exact["layers"][0] == pytest.approx(exact["target"], rel=1e-5)
    assert exact["keys_only"] == pytest.approx(exact["target"], rel=1e-5)
    damaged = MapperModel.identity(handoff.target.config)
    with torch.no_grad():
        damaged.layers[1].value_proj.weight.mul_(-1.0)
    probe = HandoffEvaluation(handoff.source, handoff.target, damaged, handoff.tokenizer)
    result = layer_swap(probe, task)
    assert result["layers"][0] == pytest.approx(result["target"], rel=1e-5)
    assert result["keys_only"] == pytest.approx(result["target"], rel=1e-5)
    assert result["layers"][1] != pytest.approx(result["target"], rel=1e-3)
    assert result["values_only"] == pytest.approx(result["layers"][1], rel=1e-5)
    # the converse: every layer mapped but the damaged one, which is the target's own, gives the target's score
    converse = layer_swap(probe, task, layers=[], own_layers=[0, 1])
    assert converse["layers"] == {}
    assert converse["all_but"][1] == pytest.approx(converse["target"], rel=1e-5)
    assert converse["all_but"][0] == pytest.approx(converse["mapped"], rel=1e-5)
    with pytest.raises(ValueError, match="own_layers"):
        layer_swap(probe, task, layers=[], own_layers=[9])
    # the target's own first n layers, the rest mapped: n=0 is the full map, n=2 (past the damage) the target's own
    first = layer_swap(probe, task, layers=[], own_first=[0, 1, 2])
    assert first["own_first"][0] == pytest.approx(first["mapped"], rel=1e-5)
    assert first["own_first"][1] == pytest.approx(first["mapped"], rel=1e-5)
    assert first["own_first"][2] == pytest.approx(first["target"], rel=1e-5)
    with pytest.raises(ValueError, match="own_first"):
        layer_swap(probe, task, layers=[], own_first=[99])
    # the target's own first n tokens in every layer, the rest mapped: n=0 is the full map, n past every prompt
    # the target's own cache; in between, neither
    tokens = layer_swap(probe, task, layers=[], own_tokens=[0, 4, 10_000])
    assert tokens["own_tokens"][0] == pytest.approx(tokens["mapped"], rel=1e-5)
    assert tokens["own_tokens"][10_000] == pytest.approx(tokens["target"], rel=1e-5)
    assert tokens["own_tokens"][4] != pytest.approx(tokens["mapped"], rel=1e-6)
    assert tokens["own_tokens"][4] != pytest.approx(tokens["target"], rel=1e-6)


def test_layer_swap_takes_its_caches_from_the_handoff_it_is_given(handoff):
    """A HandoffEvaluation subclass that serves caches its own way (e.g. prefills kept on disk) serves every swap."""
    from dataclasses import dataclass

    from hf_kvmap.diagnostics import layer_swap

    @dataclass
    class Counting(HandoffEvaluation):
        calls: int = 0

        def context_cache(self, mode, ids, mask=None):
            self.calls += 1
            return super().context_cache(mode, ids, mask)

    task = TaskSpec("text", "perplexity", corpus.make_eval_set("text", 2, seed=3, n_chars=64))
    counting = Counting(handoff.source, handoff.target, handoff.mapper, handoff.tokenizer)
    result = layer_swap(counting, task, layers=[1])
    # target + mapped by itself + one swap layer + keys_only + values_only; each swap reads target and mapped caches
    assert counting.calls == len(task.items) * (1 + 1 + 3 * 2)
    assert result["layers"][1] == pytest.approx(result["target"], rel=1e-5)


def test_own_tokens_are_the_first_real_tokens_of_each_left_padded_row(handoff):
    """With left padding, the target's own cache replaces the mapped one at each row's first `n` real tokens."""
    from hf_kvmap.diagnostics import _SwapHandoff

    damaged = MapperModel.identity(handoff.target.config)
    with torch.no_grad():
        damaged.layers[0].key_proj.weight.mul_(-1.0)
        damaged.layers[1].value_proj.weight.mul_(-1.0)
    base = HandoffEvaluation(handoff.source, handoff.target, damaged, handoff.tokenizer)
    layers = tuple(range(damaged.config.target_geometry.num_layers))
    probe = _SwapHandoff(base.source, base.target, damaged, base.tokenizer, base.hold_back, base=base, layers=layers,
                         own_tokens=3)  # fmt: skip
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # row 1: five pads, then its first real token at index 5
    _, swapped = probe.context_cache("mapped", ids, mask)
    _, true = base.context_cache("target", ids, mask)
    _, mapped = base.context_cache("mapped", ids, mask)
    for got, own, other in zip(swapped.layers, true.layers, mapped.layers):
        for part in ("keys", "values"):
            got_part, own_part, other_part = (getattr(c, part) for c in (got, own, other))
            torch.testing.assert_close(got_part[0, :, :3], own_part[0, :, :3])
            torch.testing.assert_close(got_part[0, :, 3:], other_part[0, :, 3:].to(own_part))
            torch.testing.assert_close(got_part[1, :, 5:8], own_part[1, :, 5:8])
            torch.testing.assert_close(got_part[1, :, 8:], other_part[1, :, 8:].to(own_part))
    assert not torch.allclose(true.layers[0].keys[0, :, 3:], mapped.layers[0].keys[0, :, 3:].to(true.layers[0].keys))
