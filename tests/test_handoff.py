"""The guarded handoff: fallback is token-identical to the target alone, `fail` raises, the gate refuses mismatched
models, the calibrated guard accepts an exact mapping and refuses broken ones, and the calibration arithmetic."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hf_kvmap import HandoffRefusedError, MappedCache, MapperConfig, MapperModel, calibrate_probe, handoff, zoo
from hf_kvmap._compat import cache_kwargs
from hf_kvmap.calibration.probe_thresholds import auc, calibrate_threshold, roc_curve
from hf_kvmap.zoo import corpus

SHIPPED = (("tiny-s", "tiny-l"), ("tiny-m", "tiny-l"), ("tiny-x", "tiny-l"), ("tiny-l", "tiny-s"))


def greedy(model, ids, cache=None, mask=None, new=6):
    return model.generate(
        ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=new, do_sample=False, pad_token_id=0
    )


@pytest.fixture(scope="module")
def models(tiny, one_thread):
    config = tiny.config()
    return tiny.model(config, seed=0), tiny.model(config, seed=1), config


@pytest.fixture(scope="module")
def family(one_thread):
    tokenizer = zoo.load_tokenizer()
    items = corpus.make_eval_set("recall", 6, seed=77) + corpus.make_eval_set("chat", 6, seed=77)
    prompts = [torch.tensor([tokenizer(item.context)["input_ids"]]) for item in items]
    models = {name: zoo.load_model(name) for name in ("tiny-s", "tiny-m", "tiny-x", "tiny-l")}
    return tokenizer, prompts, models


def test_fallback_is_token_identical_to_the_target(models, tiny):
    source, target, config = models
    ids, mask = tiny.left_padded_batch(lengths=(11, 15))
    mapper = MapperModel.identity(config)
    cache, report = handoff(
        source, target, mapper, ids, attention_mask=mask, probe="prefix_audit", threshold=-1.0, audit_tokens=0
    )
    assert not report.accepted and report.reason.startswith("probe refused")
    assert type(cache).__name__ == "DynamicCache" and cache.get_seq_length() == ids.shape[1] - 1
    assert torch.equal(greedy(target, ids, cache, mask), greedy(target, ids, mask=mask))
    assert set(report.timings) >= {"gate", "source_prefill", "map", "probe", "fallback_prefill", "total"}
    assert report.threshold == -1.0 and len(report.scores) == 2 and report.score == max(report.scores)


def test_policy_fail_raises_with_the_report(models):
    source, target, config = models
    ids = torch.randint(3, 128, (1, 12))
    with pytest.raises(HandoffRefusedError, match="probe refused") as info:
        handoff(
            source,
            target,
            MapperModel.identity(config),
            ids,
            probe="prefix_audit",
            threshold=-1.0,
            policy="fail",
            audit_tokens=0,
        )
    assert info.value.report.accepted is False and "fallback_prefill" not in info.value.report.timings


def test_audit_refuses_a_gross_mapping_and_certifies_an_exact_one(models):
    """Another model's cache passed through an identity map is further from the target's own than zeros: refused
    before any probe. The target's own cache through an identity map is certified exact, even under a threshold that
    would refuse everything."""
    source, target, config = models
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(8))
    identity = MapperModel.identity(config)
    cache, report = handoff(source, target, identity, ids, probe="lookahead_margin", threshold=10.0)
    assert not report.accepted and report.reason.startswith("gross mapping error") and report.audit_error >= 1.0
    assert "probe" not in report.timings
    assert torch.equal(greedy(target, ids, cache), greedy(target, ids))
    cache, report = handoff(target, target, identity, ids, probe="lookahead_margin", threshold=-1.0)
    assert report.accepted and report.reason.startswith("exact mapping") and report.audit_error < 1e-3
    assert torch.equal(greedy(target, ids, cache), greedy(target, ids))


def test_accepted_cache_is_the_mapped_one(models):
    source, target, config = models
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    cache, report = handoff(target, target, MapperModel.identity(config), ids, probe="prefix_audit", threshold=1e-3)
    assert report.accepted and isinstance(cache, MappedCache) and report.mapped_tokens == 11
    assert torch.equal(greedy(target, ids, cache), greedy(target, ids))


def test_handoff_with_the_targets_first_layer_serves_the_targets_layer_zero(models):
    """`target_first_layer=True`: an identity mapper whose layer 0 is wrecked still hands off the target's own cache
    (the audit certifies it exact), in a left-padded batch too; without the flag the audit refuses the wreck."""
    source, target, config = models
    mapper = MapperModel.identity(config)
    with torch.no_grad():
        mapper.layers[0].key_proj.weight.mul_(-2.0)
        mapper.layers[0].value_proj.weight.mul_(-2.0)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    guard = {"probe": "prefix_audit", "threshold": 1e-3}
    cache, report = handoff(target, target, mapper, ids, attention_mask=mask, target_first_layer=True, **guard)
    assert report.accepted and isinstance(cache, MappedCache) and cache.mapping_info["first_layer"] == "target"
    assert torch.equal(greedy(target, ids, cache, mask), greedy(target, ids, None, mask))
    _, plain = handoff(target, target, mapper, ids, attention_mask=mask, **guard)
    assert not plain.accepted


def test_left_padded_batch_is_mapped_at_the_right_positions(models, tiny):
    """Left padding: handoff's own source prefill (mask-derived positions), a given plain-forward cache, and a given
    generate-style cache with its positions all map exactly (the audit certifies it) and generate the target's
    tokens."""
    _, target, config = models
    ids, mask = tiny.left_padded_batch(lengths=(10, 16))
    identity = MapperModel.identity(config)
    reference = greedy(target, ids, mask=mask)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    plain = target(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
    generate_style = tiny.prefill(target, ids, mask)
    for source_cache, source_positions in ((None, None), (plain, None), (generate_style, positions)):
        cache, report = handoff(
            target,
            target,
            identity,
            ids,
            attention_mask=mask,
            source_cache=source_cache,
            source_position_ids=source_positions,
            probe="lookahead_margin",
            threshold=-1.0,
        )
        assert report.accepted and report.reason.startswith("exact mapping"), report.reason
        assert torch.equal(greedy(target, ids, cache, mask), reference)


def test_tail_probe_holds_back_its_tokens(models):
    source, target, config = models
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(6))
    cache, report = handoff(
        target, target, MapperModel.identity(config), ids, probe={"name": "tail_nll", "tokens": 8}, threshold=100.0
    )
    assert report.accepted and report.hold_back == 8 and report.mapped_tokens == 12
    assert cache.get_seq_length() == 19 and "held_back" in report.timings
    assert torch.equal(greedy(target, ids, cache), greedy(target, ids))


def test_gate_refuses_mismatched_models(family):
    tokenizer, prompts, models = family
    mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-m", "tiny-l"))
    ids = prompts[0]
    # tiny-s is not the source this mapper was fitted for (depth, revision, id)
    cache, report = handoff(models["tiny-s"], models["tiny-l"], mapper, ids, probe="prefix_audit", threshold=1.0)
    assert not report.accepted and report.reason.startswith("incompatible") and "source" in report.reason
    assert torch.equal(greedy(models["tiny-l"], ids, cache), greedy(models["tiny-l"], ids))
    with pytest.raises(HandoffRefusedError, match="incompatible"):
        handoff(models["tiny-s"], models["tiny-l"], mapper, ids, probe="prefix_audit", threshold=1.0, policy="fail")


def test_bad_calls_get_clear_errors(models):
    source, target, config = models
    mapper = MapperModel.identity(config)
    ids = torch.randint(3, 128, (1, 12))
    with pytest.raises(ValueError, match="no calibrated handoff probe"):  # no audit could prove it exact
        handoff(source, target, mapper, ids, audit_tokens=0)
    with pytest.raises(ValueError, match="policy='maybe'"):
        handoff(source, target, mapper, ids, probe="prefix_audit", threshold=0.1, policy="maybe")
    with pytest.raises(ValueError, match="at least 2"):
        handoff(source, target, mapper, ids[:, :1], probe="prefix_audit", threshold=0.1)
    with pytest.raises(ValueError, match="covers 11 tokens"):
        cache = source(input_ids=ids[:, :-1], use_cache=True).past_key_values
        handoff(source, target, mapper, ids, source_cache=cache, probe="prefix_audit", threshold=0.1)
    with pytest.raises(ValueError, match="audit_tokens=-1"):
        handoff(source, target, mapper, ids, probe="prefix_audit", threshold=0.1, audit_tokens=-1)
    with pytest.raises(TypeError, match="integer token ids"):
        handoff(source, target, mapper, ids.float(), probe="prefix_audit", threshold=0.1)


def test_nan_source_cache_falls_back(models):
    source, target, config = models
    ids = torch.randint(3, 128, (1, 12))
    cache = source(input_ids=ids, use_cache=True).past_key_values
    cache.layers[1].keys[0, 0, 3, 0] = float("nan")
    served, report = handoff(
        source, target, MapperModel.identity(config), ids, source_cache=cache, probe="prefix_audit", threshold=1.0
    )
    assert not report.accepted and report.reason.startswith("mapping failed") and "NaN" in report.reason
    assert torch.equal(greedy(target, ids, served), greedy(target, ids))


# ------------------------------------------------------------------------------------- calibration arithmetic


def test_roc_and_threshold_are_exact():
    risks = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    changed = [False, False, False, True, False, True, True, False, True, True]
    roc = roc_curve(risks, changed)
    assert roc[0]["threshold"] < min(risks) and roc[0]["true_alarm"] == roc[0]["false_alarm"] == 1.0
    assert roc[-1]["true_alarm"] == 0.0 and roc[-1]["false_alarm"] == 0.0
    # false alarms <= 20 %: refuse above 0.5 (one of five kept answers, 0.8, is refused; 4 of 5 changed caught)
    assert calibrate_threshold(risks, changed, 0.2) == 0.5
    assert calibrate_threshold(risks, changed, 0.0) == 0.8
    assert auc(risks, changed) == pytest.approx(21 / 25)
    with pytest.raises(ValueError, match="kept its answer"):
        calibrate_threshold([0.1], [True])


def test_calibration_is_stored_and_old_configs_load(models, tmp_path):
    _, _, config = models
    mapper = MapperModel.identity(config)
    assert mapper.config.handoff_probe is None
    stored = calibrate_probe(
        mapper,
        {"name": "prefix_audit", "tokens": 16},
        [0.1, 0.5, 0.9],
        [False, True, True],
        max_false_alarm=0.0,
        provenance={"tasks": ["recall"]},
    )
    assert stored["threshold"] == 0.1 and stored["calibration"]["true_alarm"] == 1.0
    mapper.save_pretrained(tmp_path / "m")
    loaded = MapperModel.from_pretrained(tmp_path / "m")
    assert loaded.config.handoff_probe == stored
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    raw.pop("handoff_probe")
    assert MapperConfig.from_dict(raw).handoff_probe is None
    # the card shows the guard when there is one
    from hf_kvmap.card import render_card

    card = (tmp_path / "m" / "README.md").read_text()
    assert "## Guarded handoff" in card and "| probe | `prefix_audit:16` |" in card
    assert "| threshold (refuse when risk is above) | 0.1 |" in card
    assert "## Guarded handoff" not in str(render_card(MapperModel.identity(config)))


# ------------------------------------------------------------------------------- the shipped, calibrated guards


def _shipped(source_name, target_name):
    mapper = MapperModel.from_pretrained(zoo.mapper_path(source_name, target_name)).float()
    assert mapper.config.handoff_probe, f"{source_name}->{target_name} ships no calibrated probe"
    return mapper


@pytest.mark.parametrize("direction", SHIPPED, ids=lambda d: f"{d[0]}-to-{d[1]}")
def test_shipped_guard_accepts_an_exact_mapping(direction, family):
    """The calibrated probe and threshold of each shipped mapper, applied to an identity mapping of the target onto
    itself: every prompt is accepted and generation is the target's own."""
    tokenizer, prompts, models = family
    stored = _shipped(*direction).config.handoff_probe
    target = models[direction[1]]
    identity = MapperModel.identity(target.config)
    for ids in prompts:
        cache, report = handoff(target, target, identity, ids, probe=stored["probe"], threshold=stored["threshold"])
        assert report.accepted, report.reason
        assert torch.equal(greedy(target, ids, cache), greedy(target, ids))


def _broken(mapper, how):
    broken = copy.deepcopy(mapper)
    with torch.no_grad():
        if how == "zeroed":
            for parameter in broken.parameters():
                parameter.zero_()
        else:  # every map gets the weights of the same map of the next layer of its shape (a wrong map); a map
            # no other layer shares the shape of (a windowed one) sends each KV head's output to the next head
            layers = list(broken.layers)
            heads = broken.config.target_geometry.num_kv_heads
            for part in ("key_proj", "value_proj"):
                maps = [getattr(layer, part) for layer in layers]
                states = [copy.deepcopy(module.state_dict()) for module in maps]
                for idx, module in enumerate(maps):
                    others = [(idx + step) % len(maps) for step in range(1, len(maps))]
                    shape = module.weight.shape
                    donor = next((other for other in others if maps[other].weight.shape == shape), None)
                    if donor is not None:
                        module.load_state_dict(states[donor])
                        continue
                    assert heads > 1, "a map with no donor and one KV head cannot be mismatched"
                    for tensor in (module.weight, module.bias):
                        tensor.copy_(tensor.roll(shape[0] // heads, dims=0))
    return broken


@pytest.mark.parametrize("how", ["zeroed", "mismatched"])
@pytest.mark.parametrize("direction", SHIPPED, ids=lambda d: f"{d[0]}-to-{d[1]}")
def test_shipped_guard_refuses_a_broken_mapper(direction, how, family):
    tokenizer, prompts, models = family
    mapper = _broken(_shipped(*direction), how)
    source, target = models[direction[0]], models[direction[1]]
    for ids in prompts:
        cache, report = handoff(source, target, mapper, ids)
        assert not report.accepted, report.reason
        assert torch.equal(greedy(target, ids, cache), greedy(target, ids))


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_given_source_cache_goes_to_the_policy_at_any_layer(models, layer, bad):
    """NaN or inf in a given source cache is a corrupted cache, at layer 0 as at any other: the policy handles it, and
    the reason names the value and where it is (not the prompt)."""
    source, target, config = models
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    source_cache = source(input_ids=ids, use_cache=True).past_key_values
    source_cache.layers[layer].values[0, 1, 5, 2] = bad
    mapper = MapperModel.identity(config)
    cache, report = handoff(source, target, mapper, ids, source_cache=source_cache, probe="tail_nll", threshold=9.0)
    assert not report.accepted and report.reason.startswith("mapping failed")
    assert f"layer {layer} values contains NaN or inf values ({bad}" in report.reason
    assert "position 5" in report.reason and "input_ids" not in report.reason
    assert torch.equal(greedy(target, ids, cache), greedy(target, ids))
    with pytest.raises(HandoffRefusedError, match=f"layer {layer} values contains NaN or inf"):
        handoff(source, target, mapper, ids, source_cache=source_cache, policy="fail", probe="tail_nll", threshold=9.0)
