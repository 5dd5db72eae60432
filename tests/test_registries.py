"""Every registered mapper kind and fine-tuning objective, one parametrized test each: a method added to a registry is
covered by adding it (one file, one registration), with nothing to list here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_kvmap import FitOptions, MappedCache, MapperModel, fit_mapper
from hf_kvmap.configuration_mapper import MAPPER_KINDS
from hf_kvmap.finetune import OBJECTIVE_REGISTRY, Objective, calibration_rows, register_objective
from hf_kvmap.fitting import FEATURE_FITTERS
from hf_kvmap.kinds import KIND_REGISTRY, MapperKind, register_mapper_kind
from hf_kvmap.modeling_mapper import MAP_MODULES
from hf_kvmap.objectives import FINETUNES

#: Small settings per kind so that a fit takes a second (the kinds' own defaults are for real models).
KIND_SETTINGS = {"mlp": {"hidden_size": 64, "epochs": 2, "batch_tokens": 64}}
#: Small settings per objective (as `FitOptions` fields).
OBJECTIVE_SETTINGS = {
    "kl": {"kl_lr": 3e-3},
    "attention": {"attn_lr": 3e-3},
}


def test_the_views_of_the_registries_hold_every_entry_and_nothing_else():
    assert MAPPER_KINDS == tuple(KIND_REGISTRY) == ("ridge", "mlp")
    assert set(MAP_MODULES) == set(FEATURE_FITTERS) == set(KIND_REGISTRY)
    assert set(FINETUNES) == set(OBJECTIVE_REGISTRY) == {"kl", "attention"}
    assert all(FINETUNES[name][0] is cls.function for name, cls in OBJECTIVE_REGISTRY.items())


def test_a_second_method_of_a_registered_name_is_refused():
    class Other(MapperKind):
        name = "ridge"

    class OtherObjective(Objective):
        name = "kl"

    with pytest.raises(ValueError, match="'ridge' is already registered"):
        register_mapper_kind(Other)
    with pytest.raises(ValueError, match="'kl' is already registered"):
        register_objective(OtherObjective)
    assert KIND_REGISTRY["ridge"] is not Other and OBJECTIVE_REGISTRY["kl"] is not OtherObjective


@pytest.mark.parametrize("name", sorted(KIND_REGISTRY))
def test_kind_options_are_fit_options_with_the_same_defaults(name):
    options = KIND_REGISTRY[name].options_class()
    for field in dataclasses.fields(options):
        assert getattr(FitOptions(), field.name) == getattr(options, field.name), field.name


@pytest.mark.parametrize("name", sorted(KIND_REGISTRY))
def test_kind_fits_maps_a_cache_of_the_target_shape_and_round_trips(name, tiny, tmp_path):
    source, target = tiny.model(seed=0), tiny.model(tiny.config(layers=3, kv_heads=1, head_dim=32), seed=1)
    batches = tiny.batches(count=3, size=4, length=32)
    # a context window on one map: every kind is fitted on features kept in memory at least once
    mapper = fit_mapper(
        source, target, batches, kind=name, top_k=1, progress=False, layer_inputs={1: {"key": {"context_window": 1}}},
        **KIND_SETTINGS.get(name, {}),
    )  # fmt: skip
    assert mapper.config.kind == name
    assert all(
        type(layer.key_proj) is type(KIND_REGISTRY[name].build_map(mapper.config, 1)) for layer in mapper.layers
    )
    ids = tiny.batches(seed=9, count=1, size=2, length=12)[0]
    cache = MappedCache.from_source(source(ids, use_cache=True).past_key_values, mapper)
    geometry = target.config
    assert len(cache.layers) == geometry.num_hidden_layers
    for layer in cache.layers:
        assert tuple(layer.keys.shape) == (2, geometry.num_key_value_heads, 11, geometry.head_dim)
        assert layer.keys.shape == layer.values.shape and torch.isfinite(layer.keys).all()
    mapper.save_pretrained(tmp_path / name)
    loaded = MapperModel.from_pretrained(tmp_path / name)
    again = MappedCache.from_source(source(ids, use_cache=True).past_key_values, loaded)
    assert all(
        torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(cache.layers, again.layers)
    )


@pytest.mark.parametrize("name", sorted(OBJECTIVE_REGISTRY))
def test_objective_options_are_the_prefixed_fit_options(name):
    objective = OBJECTIVE_REGISTRY[name]
    options = FitOptions(objective=name)
    assert objective.settings_from(options) == options.objective_settings()[name]
    defaults = objective.options_class()
    assert dataclasses.asdict(defaults) == objective.settings_from(FitOptions())


def _perturbed_identity(model, scale=0.05, seed=0):
    mapper = MapperModel.identity(model.config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in mapper.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return mapper


@pytest.mark.parametrize("name", sorted(OBJECTIVE_REGISTRY))
def test_objective_fine_tune_lowers_its_held_out_measure_and_records_itself(name, tiny):
    """From a perturbed identity (the measure is zero at the identity and positive off it), the one loop lowers the
    objective's held-out measure, keeps the best state, never updates the models and records the run."""
    model = tiny.model(seed=5)
    before = {key: t.clone() for key, t in model.state_dict().items()}
    mapper = _perturbed_identity(model)
    batches = tiny.batches(seed=6, count=5, size=8, length=32)
    objective = OBJECTIVE_REGISTRY[name]
    options = FitOptions(objective=name, **OBJECTIVE_SETTINGS[name]).replace(
        **{f"{objective.fit_options_prefix}{key}": value for key, value in
           {"steps": 20, "batch_size": 4, "eval_every": 5, "patience": None, "val_sequences": 8,
            "min_prefix": 8}.items()}
    )  # fmt: skip
    result = objective.function(mapper, model, model, batches, progress=False, **objective.settings_from(options))
    record = mapper.config.calibration[f"{name}_finetune"]
    initial, best = (record[key] for key in record if key.startswith(("initial_val", "best_val")))
    assert initial > 0 and best < initial and record["steps_run"] == 20
    assert [row["step"] for row in record["history"]] == list(range(0, 21, 5))
    assert record == result.to_dict() and len(calibration_rows(batches)) == 40
    assert all(torch.equal(t, before[key]) for key, t in model.state_dict().items())


def _scorer_registries():
    from hf_kvmap.repair import STRATEGIES, Strategy, strategy_from_dict
    from hf_kvmap.serving.probes import PROBES, Probe, probe_from_dict

    return {"strategy": (STRATEGIES, Strategy, strategy_from_dict), "probe": (PROBES, Probe, probe_from_dict)}


@pytest.mark.parametrize("family", ["strategy", "probe"])
def test_strategies_and_probes_share_one_scoring_contract_and_one_builder(family):
    """Every registered strategy and probe is a `Scorer` that rebuilds from its settings (`scoring.from_settings`);
    a bad name, option or type gets the same error in both families, naming the fix."""
    from hf_kvmap.scoring import Scorer

    registry, base, build = _scorer_registries()[family]
    for name, cls in registry.items():
        assert issubclass(cls, base) and issubclass(cls, Scorer) and cls.score is not Scorer.score, name
        if name != "linear":  # a linear probe is built from its fitted weights
            made = build(name)
            assert build(made.settings()).settings() == made.settings() and repr(made).startswith(cls.__name__)
    kind = base.kind
    with pytest.raises(ValueError, match=f"Unknown {kind} 'nope'; registered (strategies|probes): "):
        build({"name": "nope"})
    with pytest.raises(TypeError, match=f"A {kind} is a name, a settings dict or a {base.__name__}; got a list"):
        build([1])
    with pytest.raises(TypeError, match=f"{kind.capitalize()} 'tail_nll|{kind.capitalize()} 'tail'"):
        build({"name": "tail_nll" if family == "probe" else "tail", "bogus": 1})


def test_the_base_checks_what_a_scorer_returns_before_it_decides():
    """The subclass scores, the base decides: a strategy's scores must be one per cached position and a probe's one
    per row, or the base refuses them before any top-k or threshold."""
    from types import SimpleNamespace

    from hf_kvmap.repair import Strategy
    from hf_kvmap.serving.probes import Probe

    class Flat(Strategy):
        name = "flat"

        def score(self, context):
            return torch.zeros(context.batch)

    class Wide(Probe):
        name = "wide"

        def score(self, context):
            return torch.zeros(context.batch, 2)

    candidates = torch.ones(2, 5, dtype=torch.bool)
    context = SimpleNamespace(batch=2, length=5, candidates=candidates, attention_mask=torch.ones(2, 6))
    with pytest.raises(
        ValueError, match=r"Repair strategy 'flat' returned scores of shape \(2,\); expected \(batch, "
    ):
        Flat().select(context, [1, 1])
    with pytest.raises(
        ValueError, match=r"Probe 'wide' returned scores of shape \(2, 2\); expected \(batch,\) = \(2,\)"
    ):
        Wide().risks(context)
