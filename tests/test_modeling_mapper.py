"""`MapperModel`: the mapping (identity exactness over every architecture, windows), save and load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, DynamicCache, LlamaConfig, Qwen3Config

from hf_kvmap import (
    MappedCache,
    MapperConfig,
    MapperModel,
)
from hf_kvmap._compat import cache_kwargs
from hf_kvmap.configuration_mapper import summarize_model_config
from hf_kvmap.rope import RotaryCodec

pytestmark = pytest.mark.usefixtures("one_thread")


def test_identity_mapper_generates_identical_tokens(tiny, arch):
    config = tiny.SUPPORTED[arch]()
    model = tiny.model(config)
    ids = torch.randint(3, 128, (1, 17), generator=torch.Generator().manual_seed(3))
    cache = MappedCache.from_source(tiny.prefill(model, ids), MapperModel.identity(config))
    assert isinstance(cache, DynamicCache)
    assert cache.get_seq_length() == 16
    # the mapped cache is the source cache (up to float rounding of the strip/apply round trip)
    source = tiny.prefill(model, ids)
    for mapped, original in zip(cache.layers, source.layers):
        torch.testing.assert_close(mapped.keys, original.keys[:, :, :16], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mapped.values, original.values[:, :, :16], rtol=0, atol=0)
    assert torch.equal(tiny.greedy(model, ids, cache=cache), tiny.greedy(model, ids))


def test_identity_mapper_batched_left_padding(tiny, arch):
    config = tiny.SUPPORTED[arch]()
    model = tiny.model(config)
    ids, mask = tiny.left_padded_batch()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # the generate-style prefill's positions
    cache = MappedCache.from_source(
        tiny.prefill(model, ids, mask),
        MapperModel.identity(config),
        attention_mask=mask,
        source_position_ids=positions,
    )
    assert torch.equal(tiny.greedy(model, ids, mask, cache=cache), tiny.greedy(model, ids, mask))


def test_identity_mapper_sampling_matches_with_same_seed(tiny):
    config = tiny.SUPPORTED["qwen3"]()
    model = tiny.model(config)
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(4))
    cache = MappedCache.from_source(tiny.prefill(model, ids), MapperModel.identity(config))
    torch.manual_seed(11)
    mapped = model.generate(ids, **cache_kwargs(cache), max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=0)
    torch.manual_seed(11)
    plain = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=0)
    assert torch.equal(mapped, plain)


@pytest.mark.parametrize("make_config", [Qwen3Config, LlamaConfig], ids=["qwen3", "llama"])
def test_rerope_between_rope_bases_is_exact(tiny, make_config):
    """One layer: the content-space K/V depend only on the embeddings, so re-roping must reproduce the other cache."""
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=0,
    )
    config_a = make_config(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config_b = make_config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    model_a, model_b = tiny.model(config_a), tiny.model(config_b)
    model_b.load_state_dict(model_a.state_dict())
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(5))
    cache = MappedCache.from_source(tiny.prefill(model_a, ids), MapperModel.identity(config_a, config_b))
    truth = tiny.prefill(model_b, ids)
    keys, true_keys = cache.layers[0].keys, truth.layers[0].keys[:, :, :39]
    assert ((keys - true_keys).norm() / true_keys.norm()).item() < 1e-5
    assert not torch.allclose(
        tiny.prefill(model_a, ids).layers[0].keys, truth.layers[0].keys, atol=1e-3
    )  # bases differ
    assert torch.equal(tiny.greedy(model_b, ids, cache=cache), tiny.greedy(model_b, ids))


def test_save_and_load_round_trip(tiny, tmp_path):
    config = tiny.SUPPORTED["qwen3"]()
    mapper = MapperModel.identity(config, source_model_id="org/source", target_model_id="org/target")
    with torch.no_grad():
        for param in mapper.parameters():
            param.add_(torch.randn_like(param))
    mapper.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "kvmap_mapper"
    assert saved["source_summary"]["model_type"] == "qwen3" and saved["source_layers"] == [[0], [1]]
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, MapperModel) and isinstance(AutoConfig.from_pretrained(tmp_path), MapperConfig)
    for (name, a), (_, b) in zip(mapper.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.config.source_model_id == "org/source"
    half = MapperModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.layers[0].key_proj.weight.dtype == torch.bfloat16


def test_sharded_save(tiny, tmp_path):
    mapper = MapperModel.identity(tiny.SUPPORTED["llama"]())
    mapper.save_pretrained(tmp_path, max_shard_size="5KB")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors.index.json" in names
    assert len([n for n in names if n.endswith(".safetensors")]) >= 2
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pkl"))]
    loaded = MapperModel.from_pretrained(tmp_path)
    for a, b in zip(mapper.parameters(), loaded.parameters()):
        assert torch.equal(a, b)


def test_forward_maps_tensors(tiny):
    config = tiny.SUPPORTED["llama"]()
    model = tiny.model(config)
    ids = torch.randint(3, 128, (1, 8))
    source = tiny.prefill(model, ids)
    out = MapperModel.identity(config)(
        [layer.keys for layer in source.layers], [layer.values for layer in source.layers]
    )
    assert len(out) == 2
    torch.testing.assert_close(out[1][0], source.layers[1].keys, rtol=1e-5, atol=1e-5)


def test_identity_needs_matching_geometry(tiny):
    small = tiny.SUPPORTED["qwen3"]()
    other = Qwen3Config(**{**tiny.COMMON, "head_dim": 16, "num_hidden_layers": 3})
    with pytest.raises(ValueError, match="same KV geometry"):
        MapperModel.identity(small, other)


def test_identity_mapper_beam_search_matches(tiny):
    config = tiny.SUPPORTED["llama"]()
    model = tiny.model(config)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(8))
    cache = MappedCache.from_source(tiny.prefill(model, ids), MapperModel.identity(config))
    cache.batch_repeat_interleave(3)  # generate() does not expand a prefilled cache for beams (DynamicCache neither)
    kwargs = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **cache_kwargs(cache), **kwargs), model.generate(ids, **kwargs))


def test_bfloat16_cache_and_mapper_dtypes(tiny):
    config = tiny.SUPPORTED["qwen3"]()
    model = tiny.model(config).to(torch.bfloat16)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(9))
    source = tiny.prefill(model, ids)
    cache = MappedCache.from_source(source, MapperModel.identity(config))  # float32 mapper, bf16 cache
    assert cache.layers[0].keys.dtype == torch.bfloat16
    torch.testing.assert_close(cache.layers[1].keys, source.layers[1].keys[:, :, :11], rtol=1e-2, atol=1e-2)
    as_float = MappedCache.from_source(source, MapperModel.identity(config, dtype=torch.bfloat16), dtype=torch.float32)
    assert as_float.layers[0].values.dtype == torch.float32


def _config(model_config, **kwargs) -> MapperConfig:
    side = summarize_model_config(model_config)
    return MapperConfig(source_summary=side, target_summary=side, **kwargs)


@pytest.mark.parametrize("input_kinds", ["same", "both"])
def test_windowed_identity_generates_identical_tokens(tiny, input_kinds):
    config = tiny.SUPPORTED["qwen3"]()
    model = tiny.model(config)
    ids = torch.randint(3, 128, (1, 17), generator=torch.Generator().manual_seed(3))
    mapper = MapperModel.identity(config, context_window=3, input_kinds=input_kinds)
    cache = MappedCache.from_source(tiny.prefill(model, ids), mapper)
    for mapped, original in zip(cache.layers, tiny.prefill(model, ids).layers):
        torch.testing.assert_close(mapped.keys, original.keys[:, :, :16], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mapped.values, original.values[:, :, :16], rtol=0, atol=0)
    assert torch.equal(tiny.greedy(model, ids, cache=cache), tiny.greedy(model, ids))


def test_planted_shift_is_applied_exactly_and_left_padding_changes_nothing(tiny):
    """A map that copies the previous position's content: the mapped cache at t is the source's at t - 1 (zeros at
    each sequence's first token), and a left-padded batch maps each row exactly as that row alone."""
    config = tiny.SUPPORTED["qwen3"]()
    model = tiny.model(config)
    mapper = MapperModel(_config(config, context_window=1))
    width = config.num_key_value_heads * config.head_dim
    with torch.no_grad():
        for layer in mapper.layers:
            for proj in (layer.key_proj, layer.value_proj):
                proj.weight.zero_()
                proj.weight[:, width:] = torch.eye(width)
                proj.bias.zero_()
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    source = tiny.prefill(model, ids)
    cache = MappedCache.from_source(source, mapper)
    codec = RotaryCodec(config)
    table = codec.table(torch.arange(11)[None])
    for mapped, original in zip(cache.layers, source.layers):
        assert torch.equal(mapped.values[:, :, 0], torch.zeros_like(mapped.values[:, :, 0]))
        torch.testing.assert_close(mapped.values[:, :, 1:], original.values[:, :, :10], rtol=0, atol=0)
        content = table.strip(original.keys[:, :, :11])
        torch.testing.assert_close(table.strip(mapped.keys)[:, :, 1:], content[:, :, :10], rtol=1e-5, atol=1e-5)

    # random weights over a 3-position window: padded batch rows == the rows alone
    torch.manual_seed(0)
    mapper = MapperModel(_config(config, context_window=3, input_kinds="both"))
    ids, mask = tiny.left_padded_batch()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, use_cache=True).past_key_values  # every row at 0 .. T-1
    for batched in (
        MappedCache.from_source(plain, mapper, attention_mask=mask),
        MappedCache.from_source(
            tiny.prefill(model, ids, mask), mapper, attention_mask=mask, source_position_ids=positions
        ),
    ):
        for row in range(ids.shape[0]):
            start = int((mask[row] == 0).sum())
            alone = MappedCache.from_source(tiny.prefill(model, ids[row : row + 1, start:]), mapper)
            for mapped, single in zip(batched.layers, alone.layers):
                torch.testing.assert_close(mapped.keys[row : row + 1, :, start:], single.keys, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(
                    mapped.values[row : row + 1, :, start:], single.values, rtol=1e-4, atol=1e-5
                )


def test_save_and_load_round_trip_is_exact(tmp_path, fitted):
    mapper, _ = fitted
    mapper.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, MapperModel) and loaded.config.kind == "mlp"
    assert loaded.config.calibration["mlp_training"] == json.loads(
        json.dumps(mapper.config.calibration["mlp_training"])
    )
    assert loaded.state_dict().keys() == mapper.state_dict().keys()
    for name, tensor in mapper.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    half = MapperModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.layers[0].value_proj.weight_hidden.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------ safe saves
def test_a_crash_while_saving_leaves_the_mapper_that_was_there(tiny, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    config = tiny.SUPPORTED["qwen3"]()
    MapperModel.identity(config).save_pretrained(tmp_path / "mapper")
    before = {p.name: p.read_bytes() for p in (tmp_path / "mapper").iterdir()}

    def crash(self, folder, *args, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"half a file")
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        MapperModel.identity(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "mapper")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in (tmp_path / "mapper").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mapper"]  # no temporary folder left behind
    assert MapperModel.from_pretrained(tmp_path / "mapper").dtype == torch.float32


def test_saving_over_files_that_are_not_a_mappers_is_refused(tiny, tmp_path):
    config = tiny.SUPPORTED["qwen3"]()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not part of a mapper.*notes.txt"):
        MapperModel.identity(config).save_pretrained(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    MapperModel.identity(config).save_pretrained(tmp_path, overwrite=True)
    assert not (tmp_path / "notes.txt").exists() and MapperModel.from_pretrained(tmp_path) is not None


def test_saving_into_the_current_folder_swaps_the_folder_itself(tiny, tmp_path, monkeypatch):
    config = tiny.SUPPORTED["qwen3"]()
    (tmp_path / "mapper").mkdir()
    monkeypatch.chdir(tmp_path / "mapper")
    MapperModel.identity(config).save_pretrained(".")
    MapperModel.identity(config, dtype=torch.bfloat16).save_pretrained(".")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mapper"]
    assert MapperModel.from_pretrained(tmp_path / "mapper").dtype == torch.bfloat16


def test_direct_affine_way_matches_the_feature_tensor_way():
    """Outside autograd an affine map of plain inputs accumulates one product per source layer (`hf_kvmap.mapping`);
    the shipped tiny-m -> tiny-l mapper mixes such layers with a windowed one and has a key norm: both ways give the
    same cache up to float rounding, and the direct way is taken exactly where it applies."""
    from hf_kvmap import zoo
    from hf_kvmap.mapping import direct_affine

    mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-m", "tiny-l"))
    ids = torch.tensor([zoo.load_tokenizer()("ab=123\ncd=456\nef=789\n?cd=")["input_ids"]])
    cache = zoo.load_model("tiny-m")(ids, use_cache=True).past_key_values
    keys, values = [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
    with torch.no_grad():
        direct = mapper(keys, values)
        taken = [direct_affine(mapper.config, idx, layer) for idx, layer in enumerate(mapper.layers)]
    windowed = {int(layer) for layer in mapper.config.layer_inputs}
    assert taken == [idx not in windowed for idx in range(len(mapper.layers))] and windowed and any(taken)
    with torch.enable_grad():  # autograd: the feature-tensor way everywhere
        assert not any(direct_affine(mapper.config, idx, layer) for idx, layer in enumerate(mapper.layers))
        general = [(k.detach(), v.detach()) for k, v in mapper(keys, values)]
    for (k_direct, v_direct), (k_general, v_general) in zip(direct, general):
        torch.testing.assert_close(k_direct, k_general, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_direct, v_general, rtol=1e-5, atol=1e-5)
