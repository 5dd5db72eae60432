"""The per-layer attention objective (`objective="attention"`, `hf_kvmap.objectives.attention`) and the one
early-stopping loop every fine-tune shares (`hf_kvmap.early_stopping`)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_kvmap import FitOptions, MapperConfig, MapperModel, fit_mapper
from hf_kvmap.configuration_mapper import summarize_model_config
from hf_kvmap.early_stopping import train_with_early_stopping
from hf_kvmap.objectives.attention import (
    _attend,
    _project,
    _Reads,
    attention_errors,
    attention_finetune,
    held_out_attention_error,
    target_reads,
)

WINDOW = {1: {"key": {"context_window": 2, "input_kinds": "both"}}}


def _source_kv(model, ids):
    with torch.no_grad():
        cache = model.base_model(input_ids=ids, use_cache=True).past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


def _perturbed_identity(config, scale=0.05, seed=0):
    mapper = MapperModel.identity(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in mapper.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return mapper


def test_target_reads_are_what_the_targets_attention_computes(tiny, arch):
    """The queries, keys, values and scale read from the target reproduce each layer's attention output (through
    its output projection) as the target computed it, for every supported architecture; the attention registry is
    left as it was."""
    model = tiny.model(config=tiny.SUPPORTED[arch](), seed=1)
    ids = tiny.batches(count=1, size=2, length=24)[0]
    outputs = {}
    hooks = [
        layer.self_attn.register_forward_hook(lambda module, args, out, i=i: outputs.__setitem__(i, out[0]))
        for i, layer in enumerate(model.model.layers)
    ]
    registry = dict(ALL_ATTENTION_FUNCTIONS.items())
    try:
        reads = target_reads(model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    assert dict(ALL_ATTENTION_FUNCTIONS.items()) == registry
    assert len(reads.queries) == len(outputs) == model.config.num_hidden_layers
    for layer, output in outputs.items():
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        assert reads.queries[layer].shape == (
            2,
            model.config.num_attention_heads,
            24,
            getattr(model.config, "head_dim", head_dim),
        )
        ours = _project(reads.modules[layer], _attend(reads.queries[layer], reads.keys[layer], reads.values[layer],
                                                      reads.scalings[layer], 0))  # fmt: skip
        torch.testing.assert_close(ours, output, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss", ["output", "logits"])
def test_attention_error_is_zero_for_the_identity_and_positive_when_perturbed(tiny, loss):
    model = tiny.model(seed=4)
    ids = tiny.batches(count=1, size=3, length=24)[0]
    reads, source_kv = target_reads(model, ids), _source_kv(model, ids)
    identity = MapperModel.identity(model.config)
    errors = [e.item() for e in attention_errors(identity, source_kv, reads, 10, loss=loss)]
    assert len(errors) == model.config.num_hidden_layers and max(errors) < 1e-10
    perturbed = attention_errors(_perturbed_identity(model.config), source_kv, reads, 10, loss=loss)
    assert min(e.item() for e in perturbed) > 1e-4
    with pytest.raises(ValueError, match="split"):
        attention_errors(identity, source_kv, reads, 24)
    with pytest.raises(ValueError, match="loss"):
        attention_errors(identity, source_kv, reads, 10, loss="kl")


@pytest.mark.parametrize("loss", ["output", "logits"])
def test_layer_at_a_time_backward_gives_the_gradients_of_the_mean(tiny, loss):
    """`backward=` maps and back-propagates one layer at a time (one layer's graph alive): the same errors, and the
    gradients of the mean error over layers, as one backward over every layer; a windowed layer included."""
    model = tiny.model(seed=4)
    ids = tiny.batches(count=1, size=3, length=24)[0]
    reads, source_kv = target_reads(model, ids), _source_kv(model, ids)
    config = MapperConfig(
        source_summary=summarize_model_config(model.config), target_summary=summarize_model_config(model.config),
        layer_inputs=WINDOW,
    )  # fmt: skip
    mapper = MapperModel(config)
    errors = attention_errors(mapper, source_kv, reads, 10, loss=loss)
    torch.stack(errors).mean().backward()
    expected = {name: p.grad.clone() for name, p in mapper.named_parameters() if p.grad is not None}
    mapper.zero_grad(set_to_none=True)
    layerwise = attention_errors(mapper, source_kv, reads, 10, loss=loss, backward=1 / len(errors))
    assert all(not e.requires_grad for e in layerwise)
    torch.testing.assert_close(torch.stack(layerwise), torch.stack(errors).detach())
    got = {name: p.grad for name, p in mapper.named_parameters() if p.grad is not None}
    assert sorted(got) == sorted(expected) and len(got) > 0
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-9)


def test_mapping_named_layers_alone_gives_those_layers(tiny):
    model = tiny.model(seed=4)
    ids = tiny.batches(count=1, size=2, length=16)[0]
    source_kv = _source_kv(model, ids)
    mapper = _perturbed_identity(model.config)
    keys, values = [k for k, _ in source_kv], [v for _, v in source_kv]
    with torch.no_grad():
        every = mapper(keys, values)
        last_first = mapper(keys, values, layers=[1, 0])
    assert all(torch.equal(a, b) for a, b in zip(last_first[0] + last_first[1], every[1] + every[0]))
    with pytest.raises(ValueError, match="layers"):
        mapper(keys, values, layers=[model.config.num_hidden_layers])


def test_attention_finetune_of_the_identity_changes_nothing(tiny):
    model = tiny.model(seed=5)
    mapper = MapperModel.identity(model.config)
    before = {name: t.clone() for name, t in mapper.state_dict().items()}
    result = attention_finetune(
        mapper, model, model, tiny.batches(seed=6, count=3, size=8, length=32), steps=6, lr=1e-2, batch_size=4,
        eval_every=2, patience=None, val_sequences=8, min_prefix=8, progress=False,
    )  # fmt: skip
    assert result.best_step == 0 and result.steps_run == 6 and result.initial_val_error < 1e-10
    assert all(torch.equal(t, before[name]) for name, t in mapper.state_dict().items())


def test_attention_finetune_beats_the_closed_form_fit_and_only_trains_the_mapper(tiny):
    """A self-map under a strong ridge penalty: the closed form shrinks the maps (the least-squares optimum of a
    regularised fit is not the one of the attention outputs); the fine-tune moves them back, on unseen sequences
    too. (Between two random models the closed form is already what little 40 sequences allow.)"""
    source = target = tiny.model(seed=7, layers=3)
    batches = tiny.batches(seed=9, count=5, size=8, length=32)
    mapper = fit_mapper(source, target, batches, top_k=1, progress=False, ridge_lambda=30.0, layer_inputs=WINDOW)
    closed_form = {name: t.clone() for name, t in mapper.state_dict().items()}
    models_before = {name: t.clone() for name, t in target.state_dict().items()}
    held_out = tiny.batches(seed=10, count=1, size=8, length=32)[0]
    reads = _Reads(source, target, held_out, cache=True, batch_size=8)
    start, _ = held_out_attention_error(mapper, reads, 8, (8, 16, 24), 8)
    result = attention_finetune(
        mapper, source, target, batches, steps=40, lr=3e-3, batch_size=4, eval_every=10, patience=None,
        val_sequences=8, min_prefix=8, progress=False,
    )  # fmt: skip
    assert result.best_val_error < 0.8 * result.initial_val_error and result.best_step > 0
    assert len(result.best_layer_errors) == 3 and sum(result.best_layer_errors) / 3 == pytest.approx(
        result.best_val_error, rel=1e-5
    )
    assert [row["step"] for row in result.history] == [0, 10, 20, 30, 40]
    # on sequences it never saw, too
    assert held_out_attention_error(mapper, reads, 8, (8, 16, 24), 8)[0] < 0.9 * start
    assert any(not torch.equal(t, closed_form[name]) for name, t in mapper.state_dict().items())
    # no gradient ever reaches the models, which are unchanged and get their requires_grad back
    assert all(p.grad is None and p.requires_grad for p in target.parameters())
    assert all(torch.equal(t, models_before[name]) for name, t in target.state_dict().items())
    record = mapper.config.calibration["attention_finetune"]
    assert record["best_val_error"] == result.best_val_error and record["settings"]["loss"] == "output"


def test_cached_and_streamed_references_agree(tiny):
    source, target = tiny.model(seed=11), tiny.model(seed=12)
    batches = tiny.batches(seed=13, count=3, size=8, length=32)
    runs = []
    for cache in (False, True):
        mapper = _perturbed_identity(target.config, seed=1)
        runs.append(attention_finetune(
            mapper, source, target, batches, steps=8, lr=1e-3, batch_size=4, eval_every=4, val_sequences=8,
            min_prefix=8, cache_references=cache, loss="logits", space="heads", progress=False,
        ))  # fmt: skip
    assert [r["val_error"] for r in runs[0].history] == pytest.approx([r["val_error"] for r in runs[1].history])


def test_fit_with_objective_attention_records_it_round_trips_and_is_hashed(tiny, tmp_path):
    source, target = tiny.model(seed=14), tiny.model(seed=15)
    batches = tiny.batches(seed=16, count=5, size=8, length=32)
    mapper = fit_mapper(
        source, target, batches, top_k=1, progress=False, objective="attention+kl", attn_steps=4,
        attn_eval_every=2, attn_val_sequences=8, attn_min_prefix=8, attn_space="heads", kl_steps=2,
        kl_eval_every=1, kl_val_sequences=8, kl_min_prefix=8, dtype=torch.bfloat16,
    )  # fmt: skip
    config = mapper.config
    assert config.objective == "attention+kl" and list(config.objective_settings) == ["attention", "kl"]
    assert config.objective_settings["attention"]["space"] == "heads" and config.objective_settings["kl"]["steps"] == 2
    assert config.calibration["attention_finetune"]["steps_run"] == 4
    assert config.calibration["kl_finetune"]["steps_run"] == 2
    assert next(mapper.parameters()).dtype == torch.bfloat16
    mapper.save_pretrained(tmp_path / "m")
    loaded = MapperModel.from_pretrained(tmp_path / "m")
    assert loaded.config.objective == "attention+kl" and loaded.config.objective_settings == config.objective_settings
    card = (tmp_path / "m" / "README.md").read_text()
    assert "per-layer attention output over the mapped cache of the frozen target" in card and "end-to-end KL" in card
    # the settings are covered by the content hash: an edited record is refused
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    saved["objective_settings"]["attention"]["lr"] = 0.5
    (tmp_path / "m" / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="the artifact was modified"):
        MapperModel.from_pretrained(tmp_path / "m")
    # a plain fit records "mse", hashed as before the field existed
    plain = fit_mapper(source, target, batches, top_k=1, progress=False)
    assert plain.config.objective == "mse" and plain.config.objective_settings == {}


def test_attention_settings_are_validated(tiny):
    for bad, match in (
        ({"attn_loss": "kl"}, "attn_loss"),
        ({"attn_space": "values"}, "attn_space"),
        ({"attn_lr": 0}, "attn_lr"),
        ({"attn_steps": -1}, "attn_steps"),
        ({"attn_patience": 1.5}, "attn_patience"),
        ({"objective": "attention+mse"}, "objective"),
    ):
        with pytest.raises(ValueError, match=match):
            FitOptions(**bad)
    side = summarize_model_config(tiny.config(layers=2))
    with pytest.raises(ValueError, match="objective"):
        MapperConfig(source_summary=side, target_summary=side, objective="attn")
    with pytest.raises(ValueError, match="not fine-tunes"):
        MapperConfig(source_summary=side, target_summary=side, objective="kl", objective_settings={"attention": {}})
    old = MapperConfig(source_summary=side, target_summary=side).to_dict()
    for name in ("objective", "objective_settings"):
        old.pop(name)
    loaded = MapperConfig.from_dict(old)
    assert loaded.objective is None and loaded.objective_settings == {}
    model = tiny.model(seed=17)
    mapper = MapperModel.identity(model.config)
    padded = [{"input_ids": torch.ones(2, 40, dtype=torch.long), "attention_mask": torch.tensor([[0] + [1] * 39] * 2)}]
    with pytest.raises(ValueError, match="attention objective takes unpadded"):
        attention_finetune(mapper, model, model, padded, progress=False)
    with pytest.raises(ValueError, match="val_sequences"):
        attention_finetune(mapper, model, model, tiny.batches(count=1, size=4, length=80), val_sequences=4)
    with pytest.raises(ValueError, match="space"):
        attention_finetune(mapper, model, model, tiny.batches(count=1, size=4, length=80), space="x")
    with pytest.raises(ValueError, match="pass source_model, target_model and calibration"):
        from hf_kvmap import fitting

        fitted = fitting.fit(model, model, tiny.batches(count=2), top_k=1, progress=False, objective="attention")
        fitting.mapper_from_fitted(fitted)
    with pytest.raises(ValueError, match=r"objective='attention'.*hf_kvmap\.fitting\.mapper_from_fitted"):
        MapperModel.from_fitted(fitted)  # the model packages weights only; fine-tuning lives above it


def test_early_stopping_keeps_the_best_state_and_counts_patience_on_trained_states():
    module = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        module.weight.fill_(0.0)
    curve = iter([5.0, 3.0, 4.0, 2.5, 6.0, 6.0, 1.0])  # the start, then one value per evaluation

    def step(index):
        with torch.no_grad():
            module.weight.fill_(float(index))
        return {"train": float(index)}

    result = train_with_early_stopping(module, step, lambda: next(curve), units=10, patience=2, clock=False)
    # best 2.5 at unit 3; units 4 and 5 do not beat it: stop after unit 5 with the state of unit 3
    assert (result.initial, result.best, result.best_unit, result.units_run) == (5.0, 2.5, 3, 5)
    assert module.weight.item() == 3.0
    assert result.history == [{"step": i, "train": float(i), "val": v} for i, v in zip(range(1, 6), [3, 4, 2.5, 6, 6])]
    # a start better than every trained state is kept, but patience counts the trained states only
    module.weight.data.fill_(0.0)
    curve = iter([1.0, 3.0, 2.0, 2.5, 2.6])
    result = train_with_early_stopping(module, step, lambda: next(curve), units=4, patience=2)
    assert (result.best_unit, result.units_run, module.weight.item()) == (0, 4, 0.0)
    # without validation every unit runs and the last state stays
    result = train_with_early_stopping(module, step, None, units=3, eval_every=2, clock=False)
    assert result.best_unit == 3 and module.weight.item() == 3.0 and [r["step"] for r in result.history] == [2, 3]
