"""Maps that keep what the target reads: per-map inputs (`layer_inputs`), the target's key norm (`key_norm`) and the
end-to-end objective (`objective="kl"`, `hf_kvmap.objectives`)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from hf_kvmap import MappedCache, MapperConfig, MapperModel, fit_mapper, flops
from hf_kvmap.cli import main as cli_main
from hf_kvmap.configuration_mapper import summarize_model_config
from hf_kvmap.objectives import calibration_rows, held_out_kl, kl_finetune, mapped_kl

WINDOW = {1: {"key": {"context_window": 2, "input_kinds": "both"}}}


def _fit(model, target, batches, **options):
    return fit_mapper(model, target, batches, top_k=None, ridge_lambda=1e-6, progress=False, **options)


def test_layer_inputs_reproduce_the_full_window_fit_on_their_maps(tiny):
    source, target = tiny.model(seed=0), tiny.model(seed=1, layers=3)
    batches = tiny.batches(count=4, size=4, length=32)
    windowed = _fit(source, target, batches, context_window=2, input_kinds="both")
    per_position = _fit(source, target, batches)
    mixed = _fit(source, target, batches, layer_inputs=WINDOW)
    assert mixed.config.layer_inputs == {"1": WINDOW[1]} and mixed.config.max_context_window == 2
    assert mixed.config.part_inputs(1, "key") == (2, "both") and mixed.config.part_inputs(1, "value") == (0, "same")
    for layer in range(3):
        for part in ("key_proj", "value_proj"):
            reference = windowed if (layer, part) == (1, "key_proj") else per_position
            ours, theirs = getattr(mixed.layers[layer], part), getattr(reference.layers[layer], part)
            torch.testing.assert_close(ours.weight, theirs.weight, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(ours.bias, theirs.bias, rtol=1e-4, atol=1e-5)
    # the cache it builds: the windowed mapper's keys in layer 1, the per-position mapper's everywhere else
    ids = torch.randint(3, tiny.VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    cache = tiny.prefill(source, ids)
    built = {
        name: MappedCache.from_source(cache, mapper)
        for name, mapper in (("mixed", mixed), ("windowed", windowed), ("per_position", per_position))
    }
    for layer in range(3):
        keys = built["windowed" if layer == 1 else "per_position"].layers[layer].keys
        torch.testing.assert_close(built["mixed"].layers[layer].keys, keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(
            built["mixed"].layers[layer].values, built["per_position"].layers[layer].values, rtol=1e-4, atol=1e-4
        )
    # the parameter count follows each map's own width (and is what the module holds)
    assert flops.mapper_parameters(mixed.config) == sum(p.numel() for p in mixed.parameters())
    width = mixed.config.source_geometry.layer_width * 2  # k = 2 source layers
    assert mixed.layers[1].key_proj.weight.shape[1] == 3 * 2 * width
    assert mixed.layers[1].value_proj.weight.shape[1] == width


def test_layer_window_self_fit_recovers_the_identity_and_generates_identically(tiny):
    model = tiny.model(seed=2)
    batches = tiny.batches(count=6, size=4, length=40)
    mapper = fit_mapper(model, model, batches, top_k=1, ridge_lambda=1e-8, progress=False, layer_inputs=WINDOW)
    width = mapper.config.source_geometry.layer_width
    weight = mapper.layers[1].key_proj.weight  # [k_t, v_t, k_t-1, v_t-1, k_t-2, v_t-2]
    assert weight.shape == (width, 6 * width)
    torch.testing.assert_close(weight[:, :width], torch.eye(width), atol=2e-3, rtol=0)
    assert weight[:, width:].abs().max() < 2e-3
    ids = torch.randint(3, tiny.VOCAB, (1, 24), generator=torch.Generator().manual_seed(4))
    cache = MappedCache.from_source(tiny.prefill(model, ids), mapper)
    assert torch.equal(tiny.greedy(model, ids, cache=cache), tiny.greedy(model, ids))


def test_layer_inputs_are_validated_and_old_configs_load(tiny):
    side = summarize_model_config(tiny.config(layers=2))
    for bad, match in (
        ({5: {"key": {"context_window": 1}}}, "target layers \\[5\\]"),
        ({0: {"query": {"context_window": 1}}}, "part"),
        ({0: {"key": {"context_window": -1}}}, "context_window"),
        ({0: {"key": {"input_kinds": "all"}}}, "input_kinds"),
        ({0: {"key": {"window": 2}}}, "unknown fields"),
    ):
        with pytest.raises(ValueError, match=match):
            MapperConfig(source_summary=side, target_summary=side, layer_inputs=bad)
    old = MapperConfig(source_summary=side, target_summary=side).to_dict()
    for name in ("layer_inputs", "key_norm", "key_norm_eps"):
        old.pop(name)
    loaded = MapperConfig.from_dict(old)
    assert loaded.layer_inputs == {} and loaded.key_norm is False and loaded.input_width(0, "value") == 32


def test_key_norm_is_the_targets_and_undoes_shrinkage(tiny):
    model = tiny.model(seed=3)
    norms = [layer.self_attn.k_norm for layer in model.model.layers]
    with torch.no_grad():  # a non-trivial key-norm weight
        for index, norm in enumerate(norms):
            norm.weight.copy_(torch.linspace(0.5, 1.5, norm.weight.numel()) + 0.1 * index)
    batches = tiny.batches(count=4, size=4, length=32)
    mapper = fit_mapper(model, model, batches, top_k=1, ridge_lambda=1e-8, progress=False, key_norm=True)
    for layer, norm in zip(mapper.layers, norms):
        assert torch.equal(layer.key_norm_weight, norm.weight)
    assert mapper.config.key_norm_eps == norms[0].variance_epsilon
    assert flops.mapper_parameters(mapper.config) == sum(t.numel() for t in mapper.state_dict().values())
    ids = torch.randint(3, tiny.VOCAB, (1, 24), generator=torch.Generator().manual_seed(5))
    source_cache = tiny.prefill(model, ids)
    mapped = MappedCache.from_source(source_cache, mapper)
    reference_keys = [layer.keys.clone() for layer in mapped.layers]
    assert torch.equal(tiny.greedy(model, ids, cache=mapped), tiny.greedy(model, ids))
    # a key map that shrinks its prediction (a regression's conditional mean does) is restored onto the norm's surface
    with torch.no_grad():
        for layer in mapper.layers:
            layer.key_proj.weight.mul_(0.3)
            layer.key_proj.bias.mul_(0.3)
    shrunk = MappedCache.from_source(source_cache, mapper)
    for ours, reference in zip(shrunk.layers, reference_keys):
        torch.testing.assert_close(ours.keys, reference, rtol=1e-4, atol=1e-4)


def test_key_norm_needs_a_target_that_has_one(tiny):
    llama = LlamaConfig(
        vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    model = tiny.model(config=llama)
    with pytest.raises(ValueError, match="k_norm"):
        fit_mapper(model, model, tiny.batches(count=2), top_k=1, progress=False, key_norm=True)


def _perturbed_identity(model, scale=0.05, seed=0):
    mapper = MapperModel.identity(model.config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in mapper.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return mapper


def test_mapped_kl_is_zero_for_the_identity_and_positive_when_perturbed(tiny):
    model = tiny.model(seed=4)
    ids = tiny.batches(count=1, size=3, length=24)[0]
    identity = MapperModel.identity(model.config)
    assert abs(mapped_kl(identity, model, model, ids, 10).item()) < 1e-6
    assert mapped_kl(_perturbed_identity(model), model, model, ids, 10).item() > 1e-3
    with pytest.raises(ValueError, match="split"):
        mapped_kl(identity, model, model, ids, 24)


def test_kl_finetune_reduces_held_out_kl_and_only_trains_the_mapper(tiny):
    model = tiny.model(seed=5)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    mapper = _perturbed_identity(model)
    batches = tiny.batches(seed=6, count=5, size=8, length=32)
    rows = calibration_rows(batches)
    start = held_out_kl(mapper, model, model, rows[:8], (8, 16), 8)
    result = kl_finetune(
        mapper, model, model, batches, steps=60, lr=3e-3, batch_size=4, eval_every=10, patience=None,
        val_sequences=8, min_prefix=8, seed=0, progress=False,
    )  # fmt: skip
    assert result.best_val_kl < 0.5 * result.initial_val_kl and result.steps_run == 60
    assert result.sequences_train == 32 and result.sequences_val == 8 and result.sequence_length == 32
    assert [row["step"] for row in result.history] == list(range(0, 61, 10))
    assert held_out_kl(mapper, model, model, rows[:8], (8, 16), 8) < start
    # the models are never updated and get their requires_grad back
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters())
    record = mapper.config.calibration["kl_finetune"]
    assert record["best_val_kl"] == result.best_val_kl and record["settings"]["lr"] == 3e-3
    # the best state is the one kept: its held-out KL is the recorded best
    held = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))[:8]]
    assert held_out_kl(mapper, model, model, held, (8, 16, 24), 4) == pytest.approx(result.best_val_kl, rel=1e-5)
    # keeping the references in memory computes the same thing
    cached = _perturbed_identity(model)
    again = kl_finetune(
        cached, model, model, batches, steps=20, lr=3e-3, batch_size=4, eval_every=10, patience=None,
        val_sequences=8, min_prefix=8, seed=0, progress=False, cache_references=True,
    )  # fmt: skip
    assert [row["val_kl"] for row in again.history] == pytest.approx(
        [row["val_kl"] for row in result.history[:3]], rel=1e-4
    )


def test_kl_finetune_refuses_unusable_calibration(tiny):
    model = tiny.model(seed=6)
    mapper = MapperModel.identity(model.config)
    with pytest.raises(ValueError, match="padded"):
        kl_finetune(mapper, model, model, [{"input_ids": torch.ones(2, 40, dtype=torch.long),
                                            "attention_mask": torch.tensor([[0] + [1] * 39] * 2)}], progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="one length"):
        kl_finetune(mapper, model, model, [torch.ones(2, 40, dtype=torch.long), torch.ones(2, 50, dtype=torch.long)])
    with pytest.raises(ValueError, match="val_sequences"):
        kl_finetune(mapper, model, model, tiny.batches(count=1, size=4, length=80), val_sequences=4, progress=False)
    with pytest.raises(ValueError, match="too short"):
        kl_finetune(mapper, model, model, tiny.batches(count=2, size=40, length=40), progress=False)


def test_fit_with_objective_kl_records_it_and_keeps_its_dtype(tiny):
    source, target = tiny.model(seed=7), tiny.model(seed=8)
    batches = tiny.batches(seed=9, count=6, size=8, length=32)
    mapper = fit_mapper(
        source, target, batches, top_k=1, progress=False, objective="kl", kl_steps=6, kl_eval_every=3,
        kl_val_sequences=8, kl_min_prefix=8, key_norm=True, layer_inputs=WINDOW, dtype=torch.bfloat16,
    )  # fmt: skip
    record = mapper.config.calibration["kl_finetune"]
    assert record["steps_run"] == 6 and record["best_val_kl"] <= record["initial_val_kl"]
    assert next(mapper.parameters()).dtype == torch.bfloat16
    assert mapper.config.key_norm and mapper.config.layer_inputs == {"1": WINDOW[1]}


@pytest.mark.parametrize("objective", ["kl", "attention"])
def test_cli_fit_objective_key_norm_and_layer_window(tiny, tmp_path, objective):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(30)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    for name, seed, layers in (("src", 0, 2), ("tgt", 1, 3)):
        tiny.model(sharpen=False, seed=seed, layers=layers, vocab=32).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    generator = torch.Generator().manual_seed(0)
    lines = [" ".join(f"w{i}" for i in torch.randint(0, 30, (60,), generator=generator).tolist()) for _ in range(40)]
    (tmp_path / "data.txt").write_text("\n".join(lines))
    out = tmp_path / "kl"
    args = ["fit", "--source", str(tmp_path / "src"), "--target", str(tmp_path / "tgt"), "--data"]
    args += [str(tmp_path / "data.txt"), "--top-k", "1", "--seq-len", "24", "--max-sequences", "40", "--stride", "1"]
    prefix = {"kl": "--kl", "attention": "--attn"}[objective]
    args += ["--layer-window", "2:key=1:both", "--key-norm", "--objective", objective, f"{prefix}-steps", "4"]
    args += [f"{prefix}-eval-every", "2", f"{prefix}-val-sequences", "8", f"{prefix}-min-prefix", "6"]
    args += [f"{prefix}-batch-size", "4"] + (["--attn-loss", "logits", "--attn-no-normalize"] * (objective != "kl"))
    assert cli_main([*args, "--out", str(out), "--no-progress"]) == 0
    mapper = MapperModel.from_pretrained(out)
    assert mapper.config.layer_inputs == {"2": {"key": {"context_window": 1, "input_kinds": "both"}}}
    record = mapper.config.calibration[f"{objective}_finetune"]
    assert mapper.config.key_norm and record["steps_run"] == 4 and mapper.config.objective == objective
    card = (out / "README.md").read_text()
    assert (
        "| target layer 2 key map reads | source keys and values, context window 1 |" in card
        and "key normalis" in card
    )
    if objective == "kl":
        assert "end-to-end KL through the frozen target" in card
    else:
        assert record["settings"]["loss"] == "logits" and record["settings"]["normalize"] is False
        assert "per-layer attention logits over the mapped keys of the frozen target's own queries" in card
    saved = json.loads((out / "config.json").read_text())
    assert saved["layer_inputs"] == {"2": {"key": {"context_window": 1, "input_kinds": "both"}}}
    for bad in ("2:query=1", "two:key=1", "2:key=1:both:x"):
        with pytest.raises(SystemExit, match="LAYER:PART"):
            cli_main(["fit", "--layer-window", bad, "--from-stats", str(tmp_path), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="drop --from-stats"):
        cli_main(["fit", "--objective", objective, "--from-stats", str(tmp_path), "--out", str(tmp_path / "x")])
