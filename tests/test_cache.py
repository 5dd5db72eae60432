"""`MappedCache`: what `from_source` refuses, how much it holds back, and the reader's dtype."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, Qwen3Config

from hf_kvmap import (
    MappedCache,
    MapperModel,
)
from hf_kvmap._compat import cache_kwargs

pytestmark = pytest.mark.usefixtures("one_thread")


def _mapper_and_cache(tiny, config=None, tokens=12):
    config = config or tiny.SUPPORTED["qwen3"]()
    model = tiny.model(config)
    ids = torch.randint(3, 128, (1, tokens))
    return MapperModel.identity(config), tiny.prefill(model, ids)


def test_sliding_window_cache_layers_are_refused(tiny):
    mapper, _ = _mapper_and_cache(tiny)
    config = Qwen3Config(
        **{
            **tiny.COMMON,
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


def test_wrong_layer_count_is_refused(tiny):
    mapper, cache = _mapper_and_cache(tiny)
    with pytest.raises(ValueError, match="has 1 layers but the mapper expects 2"):
        MappedCache.from_source([(cache.layers[0].keys, cache.layers[0].values)], mapper)


@pytest.mark.parametrize(
    "shape,fragment", [((1, 4, 12, 16), "4 KV heads but the mapper expects 2"), ((1, 2, 12, 8), "head_dim 8")]
)
def test_wrong_head_geometry_is_refused(tiny, shape, fragment):
    mapper, _ = _mapper_and_cache(tiny)
    bad = [(torch.zeros(shape), torch.zeros(shape))] * 2
    with pytest.raises(ValueError, match=fragment):
        MappedCache.from_source(bad, mapper)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_cache_is_refused(tiny, value):
    mapper, cache = _mapper_and_cache(tiny)
    cache.layers[1].values[0, 0, 3, 0] = value
    with pytest.raises(ValueError, match="NaN or inf"):
        MappedCache.from_source(cache, mapper)


@pytest.mark.parametrize("hold_back,fragment", [(0, "at least the final prompt token"), (12, "leaves nothing")])
def test_bad_hold_back_is_refused(tiny, hold_back, fragment):
    mapper, cache = _mapper_and_cache(tiny, tokens=12)
    with pytest.raises(ValueError, match=fragment):
        MappedCache.from_source(cache, mapper, hold_back=hold_back)


def test_hold_back_several_tokens(tiny):
    config = tiny.SUPPORTED["qwen3"]()
    model = tiny.model(config)
    ids = torch.randint(3, 128, (1, 15))
    cache = MappedCache.from_source(tiny.prefill(model, ids), MapperModel.identity(config), hold_back=4)
    assert cache.get_seq_length() == 11 and cache.mapping_info["hold_back"] == 4
    assert torch.equal(tiny.greedy(model, ids, cache=cache), tiny.greedy(model, ids))


def test_attention_mask_shape_is_checked(tiny):
    mapper, cache = _mapper_and_cache(tiny, tokens=12)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        MappedCache.from_source(cache, mapper, attention_mask=torch.ones(1, 11, dtype=torch.long))


def test_mapped_cache_follows_the_reader_dtype(tiny):
    """A float32 source cache handed to a bfloat16 target: the target's dtype wins, generation runs."""
    config = tiny.SUPPORTED["qwen3"]()
    source = tiny.model(config)
    target = tiny.model(config).to(torch.bfloat16)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(10))
    cache = MappedCache.from_source(tiny.prefill(source, ids), MapperModel.identity(config))
    assert cache.layers[0].keys.dtype == torch.float32
    out = tiny.greedy(target, ids, cache=cache, new=4)
    assert out.shape == (1, 16)
    assert cache.layers[0].keys.dtype == torch.bfloat16 and cache.get_seq_length() == 15


def test_mapped_cache_from_mlp_mapper_shapes_and_devices(mlp_pair, fitted):
    source, target = mlp_pair
    mapper, _ = fitted
    ids = torch.randint(3, 64, (2, 12))
    source_cache = source(ids, use_cache=True).past_key_values
    cache = MappedCache.from_source(source_cache, mapper)
    assert cache.mapping_info["kind"] == "mlp"
    assert len(cache.layers) == 3
    for layer in cache.layers:
        assert layer.keys.shape == layer.values.shape == (2, 4, 11, 8)
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
    # the target reads it (a forward with the held-back token)
    out = target(ids[:, -1:], **cache_kwargs(cache))
    assert torch.isfinite(out.logits).all()

    placed = copy.deepcopy(mapper)  # the module-scoped fitted mapper stays on the CPU
    placed.layers[1].to("meta")
    cache = MappedCache.from_source(source_cache, placed)
    assert [layer.keys.device.type for layer in cache.layers] == ["cpu", "meta", "cpu"]
    assert [layer.values.device.type for layer in cache.layers] == ["cpu", "meta", "cpu"]
    assert cache.layers[1].keys.shape == (2, 4, 11, 8)


# ------------------------------------------------------------------------------------------------ positions
def test_plain_and_generate_style_prefills_of_a_left_padded_batch_both_map_exactly(tiny, arch):
    """A plain forward puts every row at 0..T-1 (padding included); `generate` reads at mask-derived positions.
    With `source_position_ids` left at its default (a plain forward) and the target positions from the mask, the
    plain prefill maps exactly; the generate-style prefill maps exactly when its positions are passed."""
    config = tiny.SUPPORTED[arch]()
    model = tiny.model(config)
    ids, mask = tiny.left_padded_batch()
    mapper = MapperModel.identity(config)
    reference = tiny.greedy(model, ids, mask)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, use_cache=True).past_key_values
    cache = MappedCache.from_source(plain, mapper, attention_mask=mask)
    assert torch.equal(tiny.greedy(model, ids, mask, cache=cache), reference)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    cache = MappedCache.from_source(
        tiny.prefill(model, ids, mask), mapper, attention_mask=mask, source_position_ids=positions
    )
    assert torch.equal(tiny.greedy(model, ids, mask, cache=cache), reference)


def test_a_left_padded_cache_of_unstated_positions_is_checked_by_the_source_or_warned_about(tiny, caplog):
    """The cache alone cannot say at which positions a left-padded batch was built: with `source_model` and the ids the
    first layer is checked against the source at the positions stated (the default: a plain forward's), so a
    generate-style cache mapped as a plain one raises instead of mapping wrong; without them a warning names the
    assumption."""
    from transformers.utils import logging as hf_logging

    config = tiny.SUPPORTED["qwen3"]()
    model = tiny.model(config)
    ids, mask = tiny.left_padded_batch()
    mapper = MapperModel.identity(config)
    reference = tiny.greedy(model, ids, mask)
    generate_style = tiny.prefill(model, ids, mask)  # built at the mask's positions
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, use_cache=True).past_key_values
    checked = {"source_model": model, "input_ids": ids}
    cache = MappedCache.from_source(plain, mapper, attention_mask=mask, **checked)
    assert torch.equal(tiny.greedy(model, ids, mask, cache=cache), reference)
    with pytest.raises(ValueError, match="not the source's cache .* pass `source_position_ids`"):
        MappedCache.from_source(generate_style, mapper, attention_mask=mask, **checked)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    cache = MappedCache.from_source(
        generate_style, mapper, attention_mask=mask, source_position_ids=positions, **checked
    )
    assert torch.equal(tiny.greedy(model, ids, mask, cache=cache), reference)
    with pytest.raises(ValueError, match="pass `input_ids` with it"):
        MappedCache.from_source(plain, mapper, attention_mask=mask, source_model=model)
    with pytest.raises(ValueError, match="input_ids are read by `target_model` .* or `source_model`"):
        MappedCache.from_source(plain, mapper, attention_mask=mask, input_ids=ids)

    def warned(cache, **kwargs) -> list[str]:
        hf_logging.warning_once.cache_clear()  # each call may warn afresh
        caplog.clear()
        with caplog.at_level("WARNING", logger="hf_kvmap"):
            MappedCache.from_source(cache, mapper, **kwargs)
        return [r.getMessage() for r in caplog.records if "left-pads the batch" in r.getMessage()]

    message = warned(plain, attention_mask=mask)  # unstated and unchecked
    assert len(message) == 1 and "pass `source_position_ids`" in message[0]
    plain_positions = torch.arange(ids.shape[1]).expand_as(ids)
    assert warned(plain, attention_mask=mask, source_position_ids=plain_positions) == []  # stated
    assert warned(plain, attention_mask=mask, **checked) == []  # checked
    assert warned(plain, attention_mask=torch.ones_like(mask)) == []  # no padding: nothing to tell apart


@pytest.mark.parametrize(
    "mask,fragment",
    [
        ([[1, 1, 1, 0], [1, 1, 1, 1]], "right padding"),
        ([[0, 1, 0, 1], [1, 1, 1, 1]], "right padding"),
        ([[0, 2, 1, 1], [1, 1, 1, 1]], "only 0 and 1"),
        ([[0.0, 0.5, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]], "only 0 and 1"),
        ([[0, 0, 0, 1], [1, 1, 1, 1]], "row 0 has 1 token"),
    ],
)
def test_right_padding_and_non_binary_masks_are_refused(tiny, mask, fragment):
    config = tiny.SUPPORTED["qwen3"]()
    cache = tiny.prefill(tiny.model(config), torch.randint(3, 128, (2, 4)))
    with pytest.raises(ValueError, match=fragment):
        MappedCache.from_source(cache, MapperModel.identity(config), attention_mask=torch.tensor(mask))


def test_source_position_ids_shape_is_checked_and_exclusive_with_position_ids(tiny):
    mapper, cache = _mapper_and_cache(tiny, tokens=12)
    with pytest.raises(ValueError, match="source_position_ids has shape"):
        MappedCache.from_source(cache, mapper, source_position_ids=torch.arange(11)[None])
    with pytest.raises(ValueError, match="either `position_ids` .* or `source_position_ids`"):
        MappedCache.from_source(
            cache, mapper, position_ids=torch.arange(12)[None], source_position_ids=torch.arange(12)[None]
        )


# ------------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float8_e4m3fn, torch.complex64, "float32"])
def test_only_float_dtypes_a_model_reads_are_accepted(tiny, dtype):
    mapper, cache = _mapper_and_cache(tiny)
    with pytest.raises(ValueError, match="dtype="):
        MappedCache.from_source(cache, mapper, dtype=dtype)
    for ok in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert MappedCache.from_source(cache, mapper, dtype=ok).layers[0].keys.dtype == ok


@pytest.mark.parametrize("hold_back", [True, 2.0, "1", None])
def test_hold_back_must_be_an_integer(tiny, hold_back):
    mapper, cache = _mapper_and_cache(tiny)
    with pytest.raises(ValueError, match="hold_back="):
        MappedCache.from_source(cache, mapper, hold_back=hold_back)


def test_a_missing_cache_or_malformed_layers_are_refused_clearly(tiny):
    mapper, cache = _mapper_and_cache(tiny)
    with pytest.raises(ValueError, match="source_cache is None"):
        MappedCache.from_source(None, mapper)
    keys, values = cache.layers[0].keys, cache.layers[0].values
    with pytest.raises(ValueError, match="layer 0 is a tuple of 3"):
        MappedCache.from_source([(keys, values, keys), (keys, values)], mapper)
    with pytest.raises(ValueError, match="layer 1 is a Tensor"):
        MappedCache.from_source([(keys, values), keys], mapper)
    with pytest.raises(ValueError, match="source_cache is a str"):
        MappedCache.from_source("cache", mapper)


def test_a_cache_longer_than_the_models_positions_warns_once(tiny, caplog):
    config = tiny.SUPPORTED["qwen3"]()
    mapper = MapperModel.identity(config)
    long = config.max_position_embeddings + 4
    pairs = [(torch.randn(1, 2, long, 16), torch.randn(1, 2, long, 16)) for _ in range(2)]
    with caplog.at_level("WARNING", logger="hf_kvmap"):
        MappedCache.from_source(pairs, mapper)
        MappedCache.from_source(pairs, mapper)
    warnings = [r for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert len(warnings) == 1 and f"{long} tokens" in warnings[0].getMessage()


def test_target_first_layer_is_what_the_targets_own_forward_caches(tiny, arch):
    """Layer 0's keys and values depend only on the tokens and their positions: computed from the ids they equal
    the target's own prefill, for every supported architecture (and at shifted positions)."""
    from hf_kvmap.first_layer import target_first_layer

    model = tiny.model(config=tiny.SUPPORTED[arch](), seed=3)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).expand(2, 12) + torch.tensor([[0], [5]])
    with torch.no_grad():
        own = model(input_ids=ids, position_ids=positions, use_cache=True).past_key_values.layers[0]
    keys, values = target_first_layer(model, ids, positions)
    torch.testing.assert_close(keys, own.keys, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(values, own.values, rtol=1e-5, atol=1e-6)


def test_from_source_with_the_target_computes_its_first_layer(tiny):
    """With `target_model` and `input_ids` the first layer is the target's own (a deliberately wrong mapper's layer 0
    is not used) and every other layer is what the mapper alone gives; one without the other is refused."""
    from hf_kvmap import MappedCache, MapperModel

    model = tiny.model(seed=3)
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    mapper = MapperModel.identity(model.config)
    with torch.no_grad():
        mapper.layers[0].key_proj.weight.mul_(-1.0)
        source = model(input_ids=ids, use_cache=True).past_key_values
        plain = MappedCache.from_source(source, mapper)
        exact = MappedCache.from_source(source, mapper, first_layer="target", target_model=model, input_ids=ids)
    own = source.layers[0]
    torch.testing.assert_close(exact.layers[0].keys, own.keys[:, :, :9], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(exact.layers[0].values, own.values[:, :, :9], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(plain.layers[0].keys, own.keys[:, :, :9], atol=1e-3)
    for a, b in zip(exact.layers[1:], plain.layers[1:]):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert exact.mapping_info["first_layer"] == "target" and plain.mapping_info["first_layer"] == "mapped"
    with pytest.raises(ValueError, match="together"):
        MappedCache.from_source(source, mapper, first_layer="target", target_model=model)
    with pytest.raises(ValueError, match="input_ids"):
        MappedCache.from_source(source, mapper, first_layer="target", target_model=model, input_ids=ids[:, :5])
    with pytest.raises(ValueError, match="pass `target_model` and `input_ids`"):
        MappedCache.from_source(source, mapper, first_layer="target")
    with pytest.raises(ValueError, match="not read"):
        MappedCache.from_source(source, mapper, first_layer="mapped", target_model=model, input_ids=ids)
    with pytest.raises(ValueError, match="must be one of"):
        MappedCache.from_source(source, mapper, first_layer="exact")
    # before it was an option, `target_model` alone switched it on: still so, with a deprecation naming the caller
    with pytest.warns(DeprecationWarning, match="first_layer='target'") as caught:
        legacy = MappedCache.from_source(source, mapper, target_model=model, input_ids=ids)
    assert caught[0].filename == __file__ and legacy.mapping_info["first_layer"] == "target"
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(legacy.layers, exact.layers))
