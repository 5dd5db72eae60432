"""Every registered probe (parametrized over the registry): finite per-row risks, both caches left as found, and an
exact mapping scored as exact where the probe can tell."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_kvmap import MapperModel, Probe, register_probe
from hf_kvmap._compat import output_cache
from hf_kvmap.repair import greedy_draft
from hf_kvmap.rope import positions_from_attention_mask
from hf_kvmap.serving.pipeline import prepare_context
from hf_kvmap.serving.probes import PROBES, fit_linear_probe, probe_from_dict

# settings for probes that take more than a size
EXAMPLES = {
    "linear": {
        "name": "linear",
        "components": [{"name": "prefix_audit", "tokens": 3}, {"name": "draft_agreement", "tokens": 3}],
        "weights": [1.0, 2.0],
        "bias": -0.5,
    }
}


def _snapshot(cache):
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def _assert_same(cache, snapshot):
    assert len(cache.layers) == len(snapshot)
    for layer, (keys, values) in zip(cache.layers, snapshot):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


@pytest.fixture(scope="module")
def models(tiny, one_thread):
    config = tiny.config()
    return tiny.model(config, seed=0), tiny.model(config, seed=1), config


@pytest.mark.parametrize("name", sorted(PROBES))
def test_probe_leaves_caches_as_found(name, models, tiny):
    source, target, config = models
    probe = probe_from_dict(EXAMPLES.get(name, {"name": name, "tokens": 3}))
    ids, mask = tiny.left_padded_batch(lengths=(12, 16))
    context = prepare_context(source, target, MapperModel.identity(config), ids, mask, hold_back=probe.hold_back)
    target_before, source_before = _snapshot(context.cache), _snapshot(context.source_cache)
    risks = probe.score(context)
    assert risks.shape == (2,) and torch.isfinite(risks).all()
    _assert_same(context.cache, target_before)
    _assert_same(context.source_cache, source_before)
    assert context.cache.get_seq_length() == ids.shape[1] - 1
    assert probe_from_dict(probe.settings()).settings() == probe.settings()
    assert probe.target_tokens(1024) <= probe.tokens


@pytest.mark.parametrize("name", sorted(name for name, cls in PROBES.items() if cls.exact_scores_zero))
def test_exact_mapping_scores_zero(name, models):
    """The source is the target and the mapper the identity: the draft is the target's own answer and the audited
    keys/values are its own, so the risk is zero (up to the rounding of the RoPE strip/apply round trip)."""
    _, target, config = models
    ids = torch.randint(3, 128, (3, 20), generator=torch.Generator().manual_seed(2))
    probe = probe_from_dict({"name": name, "tokens": 4})
    context = prepare_context(target, target, MapperModel.identity(config), ids)
    torch.testing.assert_close(probe.score(context), torch.zeros(3), rtol=0, atol=1e-5)


def test_lookahead_margin_reads_the_targets_greedy_steps_on_the_mapped_cache(models, tiny):
    """The risk is one minus the smallest top-1 minus top-2 probability margin of the target's first greedy steps on
    the mapped cache, as `generate` scores them."""
    source, target, config = models
    ids, mask = tiny.left_padded_batch(lengths=(12, 16))
    context = prepare_context(source, target, MapperModel.identity(config), ids, mask)
    risks = probe_from_dict({"name": "lookahead_margin", "tokens": 3}).score(context)
    top = tiny.greedy_probabilities(target, ids, mask, copy.deepcopy(context.cache), new=3).topk(2, dim=-1).values
    torch.testing.assert_close(risks, 1.0 - (top[..., 0] - top[..., 1]).amin(-1), rtol=0, atol=1e-5)


def test_the_draft_probes_share_one_source_draft(models, tiny):
    """`draft_agreement` and `confident_draft` on one context decode the source's draft once; the second reads it."""
    source, target, config = models
    ids, mask = tiny.left_padded_batch(lengths=(12, 16))
    context = prepare_context(source, target, MapperModel.identity(config), ids, mask)
    calls = []
    handle = source.register_forward_hook(lambda *args: calls.append(1))
    try:
        agreement = probe_from_dict({"name": "draft_agreement", "tokens": 3}).score(context)
        first = len(calls)
        confident = probe_from_dict({"name": "confident_draft", "tokens": 3}).score(context)
    finally:
        handle.remove()
    assert first == 3 and len(calls) == first
    fresh = prepare_context(source, target, MapperModel.identity(config), ids, mask)
    assert torch.equal(probe_from_dict({"name": "confident_draft", "tokens": 3}).score(fresh), confident)
    assert (confident <= agreement + 1e-6).all()


def test_the_source_draft_reads_the_positions_its_cache_was_built_at(models, tiny):
    """A left-padded source cache from a plain forward (every row at 0 .. T-1) is drafted at those positions; one the
    handoff prefills, at the mask's."""
    source, target, config = models
    ids, mask = tiny.left_padded_batch(lengths=(12, 16))
    plain = output_cache(source(input_ids=ids, attention_mask=mask, use_cache=True))
    given = prepare_context(source, target, MapperModel.identity(config), ids, mask, plain)
    arange = positions_from_attention_mask(None, *ids.shape, ids.device)
    assert torch.equal(given.source_position_ids, arange)
    assert torch.equal(given.draft("source").tokens(3), greedy_draft(source, plain, ids, mask, arange, 3))
    prefilled = prepare_context(source, target, MapperModel.identity(config), ids, mask)
    positions = positions_from_attention_mask(mask, *ids.shape, ids.device)
    assert torch.equal(prefilled.source_position_ids, positions)
    expected = greedy_draft(source, prefilled.source_cache, ids, mask, positions, 3)
    assert torch.equal(prefilled.draft("source").tokens(3), expected)


def test_prefix_audit_sees_a_zeroed_mapping(models):
    source, target, config = models
    mapper = MapperModel.identity(config)
    with torch.no_grad():
        for parameter in mapper.parameters():
            parameter.zero_()
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    context = prepare_context(target, target, mapper, ids)
    assert probe_from_dict("prefix_audit").score(context).item() == pytest.approx(1.0)


def test_registry_takes_a_new_probe_in_one_line(models):
    source, target, config = models

    class Constant(Probe):
        name = "test_constant"

        def score(self, context):
            return torch.full((context.batch,), 0.5)

    try:
        register_probe(Constant)
        assert PROBES["test_constant"] is Constant
        context = prepare_context(source, target, MapperModel.identity(config), torch.randint(3, 128, (2, 9)))
        assert probe_from_dict("test_constant").score(context).tolist() == [0.5, 0.5]
        with pytest.raises(ValueError, match="already registered"):
            register_probe(type("Other", (Probe,), {"name": "test_constant"}))
    finally:
        PROBES.pop("test_constant", None)
    with pytest.raises(ValueError, match="non-empty `name`"):
        register_probe(type("Nameless", (Probe,), {}))
    with pytest.raises(ValueError, match="Unknown probe 'nope'"):
        probe_from_dict("nope")
    with pytest.raises(ValueError, match="positive integer"):
        probe_from_dict({"name": "tail_nll", "tokens": 0})


def test_linear_probe_fit_orders_items_like_the_labels(models):
    source, target, config = models
    generator = torch.Generator().manual_seed(0)
    labels = [bool(i % 2) for i in range(200)]
    informative = [float(label) + 0.3 * torch.randn(1, generator=generator).item() for label in labels]
    noise = [torch.randn(1, generator=generator).item() for _ in labels]
    components = [{"name": "prefix_audit", "tokens": 4}, {"name": "draft_agreement", "tokens": 2}]
    probe = fit_linear_probe(components, [[a, b] for a, b in zip(informative, noise)], labels)
    assert probe.weights[0] > 5 * abs(probe.weights[1]) > 0
    assert probe_from_dict(probe.settings()).settings() == probe.settings()
    with pytest.raises(ValueError, match="hold back one token"):
        probe_from_dict({"name": "linear", "components": [{"name": "tail_nll", "tokens": 4}], "weights": [1.0]})
    with pytest.raises(ValueError, match="one weight per component"):
        probe_from_dict({"name": "linear", "components": components, "weights": [1.0]})
