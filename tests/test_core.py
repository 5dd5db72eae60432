"""Core runtime: identity mappers give token-identical generation, re-rope is exact, bad input is refused."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import COMMON, REFUSED, SUPPORTED, build_model, left_padded_batch
from transformers import AutoConfig, AutoModel, DynamicCache, LlamaConfig, Qwen3Config

from hf_kvmap import MappedCache, MapperConfig, MapperModel, UnsupportedArchitectureError
from hf_kvmap.configuration_mapper import summarize_model_config
from hf_kvmap.rope import RotaryCodec


def prefill(model, ids, mask=None):
    kwargs = {}
    if mask is not None:
        position_ids = mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(mask == 0, 1)
        kwargs = {"attention_mask": mask, "position_ids": position_ids}
    with torch.no_grad():
        return model(ids, use_cache=True, **kwargs).past_key_values


def greedy(model, ids, mask=None, cache=None, new=8):
    return model.generate(
        ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False, pad_token_id=0
    )


@pytest.mark.parametrize("arch", sorted(SUPPORTED))
def test_identity_mapper_generates_identical_tokens(arch):
    config = SUPPORTED[arch]()
    model = build_model(config)
    ids = torch.randint(3, 128, (1, 17), generator=torch.Generator().manual_seed(3))
    cache = MappedCache.from_source(prefill(model, ids), MapperModel.identity(config))
    assert isinstance(cache, DynamicCache)
    assert cache.get_seq_length() == 16
    # the mapped cache is the source cache (up to float rounding of the strip/apply round trip)
    source = prefill(model, ids)
    for mapped, original in zip(cache.layers, source.layers):
        torch.testing.assert_close(mapped.keys, original.keys[:, :, :16], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mapped.values, original.values[:, :, :16], rtol=0, atol=0)
    assert torch.equal(greedy(model, ids, cache=cache), greedy(model, ids))


@pytest.mark.parametrize("arch", sorted(SUPPORTED))
def test_identity_mapper_batched_left_padding(arch):
    config = SUPPORTED[arch]()
    model = build_model(config)
    ids, mask = left_padded_batch()
    cache = MappedCache.from_source(prefill(model, ids, mask), MapperModel.identity(config), attention_mask=mask)
    assert torch.equal(greedy(model, ids, mask, cache=cache), greedy(model, ids, mask))


def test_identity_mapper_sampling_matches_with_same_seed():
    config = SUPPORTED["qwen3"]()
    model = build_model(config)
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(4))
    cache = MappedCache.from_source(prefill(model, ids), MapperModel.identity(config))
    torch.manual_seed(11)
    mapped = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=0)
    torch.manual_seed(11)
    plain = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=0)
    assert torch.equal(mapped, plain)


@pytest.mark.parametrize("make_config", [Qwen3Config, LlamaConfig], ids=["qwen3", "llama"])
def test_rerope_between_rope_bases_is_exact(make_config):
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
    model_a, model_b = build_model(config_a), build_model(config_b)
    model_b.load_state_dict(model_a.state_dict())
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(5))
    cache = MappedCache.from_source(prefill(model_a, ids), MapperModel.identity(config_a, config_b))
    truth = prefill(model_b, ids)
    keys, true_keys = cache.layers[0].keys, truth.layers[0].keys[:, :, :39]
    assert ((keys - true_keys).norm() / true_keys.norm()).item() < 1e-5
    assert not torch.allclose(prefill(model_a, ids).layers[0].keys, truth.layers[0].keys, atol=1e-3)  # bases differ
    assert torch.equal(greedy(model_b, ids, cache=cache), greedy(model_b, ids))


def test_rotary_codec_round_trip_and_scaling():
    config = SUPPORTED["qwen3-yarn"]()
    table = RotaryCodec(config).table(torch.arange(50)[None])
    keys = torch.randn(1, 2, 50, 16)
    torch.testing.assert_close(table.strip(table.apply(keys)), keys, rtol=1e-5, atol=1e-5)
    cos, sin, scale2 = table.on("cpu")
    assert scale2.min().item() > 1.01  # YaRN's attention factor is in cos/sin and is undone by the strip


def test_save_and_load_round_trip(tmp_path):
    config = SUPPORTED["qwen3"]()
    mapper = MapperModel.identity(config, source_model_id="org/source", target_model_id="org/target")
    with torch.no_grad():
        for param in mapper.parameters():
            param.add_(torch.randn_like(param))
    mapper.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "kvmap_mapper"
    assert saved["source_config"]["model_type"] == "qwen3" and saved["source_layers"] == [[0], [1]]
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, MapperModel) and isinstance(AutoConfig.from_pretrained(tmp_path), MapperConfig)
    for (name, a), (_, b) in zip(mapper.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.config.source_model_id == "org/source"
    half = MapperModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.layers[0].key_proj.weight.dtype == torch.bfloat16


def test_sharded_save(tmp_path):
    mapper = MapperModel.identity(SUPPORTED["llama"]())
    mapper.save_pretrained(tmp_path, max_shard_size="5KB")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors.index.json" in names
    assert len([n for n in names if n.endswith(".safetensors")]) >= 2
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pkl"))]
    loaded = MapperModel.from_pretrained(tmp_path)
    for a, b in zip(mapper.parameters(), loaded.parameters()):
        assert torch.equal(a, b)


def test_forward_maps_tensors():
    config = SUPPORTED["llama"]()
    model = build_model(config)
    ids = torch.randint(3, 128, (1, 8))
    source = prefill(model, ids)
    out = MapperModel.identity(config)(
        [layer.keys for layer in source.layers], [layer.values for layer in source.layers]
    )
    assert len(out) == 2
    torch.testing.assert_close(out[1][0], source.layers[1].keys, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- refusals


def _mapper_and_cache(config=None, tokens=12):
    config = config or SUPPORTED["qwen3"]()
    model = build_model(config)
    ids = torch.randint(3, 128, (1, tokens))
    return MapperModel.identity(config), prefill(model, ids)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_layouts_are_refused(name):
    make_config, fragment = REFUSED[name]
    with pytest.raises(UnsupportedArchitectureError, match=fragment):
        MapperModel.identity(make_config())


def test_sliding_window_cache_layers_are_refused():
    mapper, _ = _mapper_and_cache()
    config = Qwen3Config(
        **{
            **COMMON,
            "head_dim": 16,
            "use_sliding_window": True,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "sliding_attention"],
        }
    )
    cache = DynamicCache(config=config)
    for idx in range(2):
        cache.update(torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16), idx)
    with pytest.raises(ValueError, match="sliding-window layer"):
        MappedCache.from_source(cache, mapper)


def test_wrong_layer_count_is_refused():
    mapper, cache = _mapper_and_cache()
    with pytest.raises(ValueError, match="has 1 layers but the mapper expects 2"):
        MappedCache.from_source([(cache.layers[0].keys, cache.layers[0].values)], mapper)


@pytest.mark.parametrize(
    "shape,fragment", [((1, 4, 12, 16), "4 KV heads but the mapper expects 2"), ((1, 2, 12, 8), "head_dim 8")]
)
def test_wrong_head_geometry_is_refused(shape, fragment):
    mapper, _ = _mapper_and_cache()
    bad = [(torch.zeros(shape), torch.zeros(shape))] * 2
    with pytest.raises(ValueError, match=fragment):
        MappedCache.from_source(bad, mapper)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_cache_is_refused(value):
    mapper, cache = _mapper_and_cache()
    cache.layers[1].values[0, 0, 3, 0] = value
    with pytest.raises(ValueError, match="NaN or inf"):
        MappedCache.from_source(cache, mapper)


@pytest.mark.parametrize("hold_back,fragment", [(0, "at least the final prompt token"), (12, "leaves nothing")])
def test_bad_hold_back_is_refused(hold_back, fragment):
    mapper, cache = _mapper_and_cache(tokens=12)
    with pytest.raises(ValueError, match=fragment):
        MappedCache.from_source(cache, mapper, hold_back=hold_back)


def test_hold_back_several_tokens():
    config = SUPPORTED["qwen3"]()
    model = build_model(config)
    ids = torch.randint(3, 128, (1, 15))
    cache = MappedCache.from_source(prefill(model, ids), MapperModel.identity(config), hold_back=4)
    assert cache.get_seq_length() == 11 and cache.mapping_info["hold_back"] == 4
    assert torch.equal(greedy(model, ids, cache=cache), greedy(model, ids))


def test_attention_mask_shape_is_checked():
    mapper, cache = _mapper_and_cache(tokens=12)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        MappedCache.from_source(cache, mapper, attention_mask=torch.ones(1, 11, dtype=torch.long))


def test_identity_needs_matching_geometry():
    small = SUPPORTED["qwen3"]()
    other = Qwen3Config(**{**COMMON, "head_dim": 16, "num_hidden_layers": 3})
    with pytest.raises(ValueError, match="same KV geometry"):
        MapperModel.identity(small, other)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"kind": "lstm"}, "kind='lstm'"),
        ({"lambda_convention": "relative"}, "lambda_convention"),
        ({"ridge_lambda": -1.0}, "ridge_lambda"),
        ({"source_layers": [[0]]}, "source_layers has 1 entries"),
        ({"source_layers": [[0], [5]]}, "names source layers \\[5\\]"),
        ({"source_layers": [[0], []]}, "is empty"),
    ],
)
def test_config_validation(kwargs, fragment):
    side = summarize_model_config(SUPPORTED["qwen3"]())
    with pytest.raises(ValueError, match=fragment):
        MapperConfig(source_config=side, target_config=side, **kwargs)


def test_identity_mapper_beam_search_matches():
    config = SUPPORTED["llama"]()
    model = build_model(config)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(8))
    cache = MappedCache.from_source(prefill(model, ids), MapperModel.identity(config))
    cache.batch_repeat_interleave(3)  # generate() does not expand a prefilled cache for beams (DynamicCache neither)
    kwargs = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, past_key_values=cache, **kwargs), model.generate(ids, **kwargs))


def test_bfloat16_cache_and_mapper_dtypes():
    config = SUPPORTED["qwen3"]()
    model = build_model(config).to(torch.bfloat16)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(9))
    source = prefill(model, ids)
    cache = MappedCache.from_source(source, MapperModel.identity(config))  # float32 mapper, bf16 cache
    assert cache.layers[0].keys.dtype == torch.bfloat16
    torch.testing.assert_close(cache.layers[1].keys, source.layers[1].keys[:, :, :11], rtol=1e-2, atol=1e-2)
    as_float = MappedCache.from_source(source, MapperModel.identity(config, dtype=torch.bfloat16), dtype=torch.float32)
    assert as_float.layers[0].values.dtype == torch.float32


def test_mapped_cache_follows_the_reader_dtype():
    """A float32 source cache handed to a bfloat16 target: the target's dtype wins, generation runs."""
    config = SUPPORTED["qwen3"]()
    source = build_model(config)
    target = build_model(config).to(torch.bfloat16)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(10))
    cache = MappedCache.from_source(prefill(source, ids), MapperModel.identity(config))
    assert cache.layers[0].keys.dtype == torch.float32
    out = greedy(target, ids, cache=cache, new=4)
    assert out.shape == (1, 16)
    assert cache.layers[0].keys.dtype == torch.bfloat16 and cache.get_seq_length() == 15
