"""`hf_kvmap.packed_attention`: one-token attention over grouped key/value heads computed packed, everything else by
transformers' `sdpa`; a model switched to it decodes the tokens it decoded before."""

from __future__ import annotations

import types

import pytest
import torch

from hf_kvmap import output_cache
from hf_kvmap._compat import attention_implementation, cache_kwargs
from hf_kvmap.packed_attention import PACKED_SDPA, packed_sdpa_forward, use_packed_attention


def _stock(module, query, key, value, mask, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, **kwargs)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_token_query_packed_is_sdpas_attention(dtype):
    generator = torch.Generator().manual_seed(0)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    query = torch.randn(2, 6, 1, 16, generator=generator).to(dtype)
    key, value = (torch.randn(2, 2, 37, 16, generator=generator).to(dtype) for _ in range(2))
    packed, weights = packed_sdpa_forward(module, query, key, value, None, scaling=0.25)
    assert weights is None and packed.shape == (2, 1, 6, 16)
    expected = _stock(module, query, key, value, None, scaling=0.25)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    assert torch.allclose(packed.float(), expected.float(), atol=tolerance)
    # by hand: query head h attends over key/value head h // 3
    scores = (query.float() @ key.float().repeat_interleave(3, 1).transpose(-1, -2) * 0.25).softmax(-1)
    by_hand = (scores @ value.float().repeat_interleave(3, 1)).transpose(1, 2)
    assert torch.allclose(packed.float(), by_hand, atol=tolerance)


def test_every_other_call_is_sdpas_own():
    """A prefill (several query tokens) or a masked step goes to transformers' sdpa unchanged: the same tensor."""
    generator = torch.Generator().manual_seed(1)
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True)
    key, value = (torch.randn(1, 2, 9, 8, generator=generator) for _ in range(2))
    prefill = torch.randn(1, 4, 9, 8, generator=generator)
    assert torch.equal(
        packed_sdpa_forward(module, prefill, key, value, None)[0], _stock(module, prefill, key, value, None)
    )
    step = torch.randn(1, 4, 1, 8, generator=generator)
    mask = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    mask[..., :3] = False  # left padding
    assert torch.equal(packed_sdpa_forward(module, step, key, value, mask)[0], _stock(module, step, key, value, mask))


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_a_model_switched_to_it_decodes_the_same_tokens(tiny, monkeypatch, kv_heads):
    """Greedy generation (two rows, no padding) gives the tokens it gave under sdpa, and its decoding steps ran
    packed: torch's attention saw the query heads of each key/value head as queries of that head."""
    model = tiny.model(seed=4, attn_implementation="sdpa", kv_heads=kv_heads)
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
        cache = output_cache(model(input_ids=ids[:, :-1], use_cache=True))
        step = model(input_ids=ids[:, -1:], **cache_kwargs(cache)).logits
    use_packed_attention(model)
    assert attention_implementation(model) == PACKED_SDPA
    shapes, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        shapes.append(tuple(query.shape))
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        after = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
        cache = output_cache(model(input_ids=ids[:, :-1], use_cache=True))
        again = model(input_ids=ids[:, -1:], **cache_kwargs(cache)).logits
    assert (2, kv_heads, 4 // kv_heads, 16) in shapes  # the packed steps
    assert (2, 4, 23, 16) in shapes  # the prefill as sdpa runs it
    assert torch.equal(before, after)
    assert torch.allclose(step, again, atol=1e-5)
    use_packed_attention(model)  # a second call keeps it


def test_a_model_on_another_implementation_is_refused(tiny, monkeypatch):
    model = tiny.model(seed=0, attn_implementation="eager")
    with pytest.raises(ValueError, match="runs 'eager'. Load it with attn_implementation='sdpa'"):
        use_packed_attention(model)
    stuck = tiny.model(seed=0, attn_implementation="sdpa")  # a model whose switch transformers only warns about
    monkeypatch.setattr(stuck, "set_attn_implementation", lambda name: None)
    with pytest.raises(ValueError, match="did not take attn_implementation='hf_kvmap_packed_sdpa'"):
        use_packed_attention(stuck)


def test_repair_runs_on_a_target_switched_to_it(tiny):
    """The repair's recompute (a custom 4-D mask) takes the packed implementation as it takes sdpa."""
    from hf_kvmap import MapperModel, RepairConfig, repair_cache
    from hf_kvmap.cache import MappedCache

    target = tiny.model(seed=5, attn_implementation="sdpa")
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(3))
    mapper = MapperModel.identity(target.config)
    caches = []
    for packed in (False, True):
        if packed:
            use_packed_attention(target)
        with torch.no_grad():
            source_cache = output_cache(target(input_ids=ids, use_cache=True))
        cache = MappedCache.from_source(source_cache, mapper)
        repair_cache(target, cache, ids, RepairConfig("tail", fraction=0.25))
        caches.append(cache)
    for stock, packed in zip(*(c.layers for c in caches)):
        assert torch.allclose(stock.keys, packed.keys, atol=1e-5) and torch.allclose(
            stock.values, packed.values, atol=1e-5
        )
