"""`DecodeRefresh`: repairing the prompt positions the target reads while it decodes (exact invariants on tiny models:
a refresh of the target's own cache changes nothing, a refresh of every position is the target's own prefill, the
positions chosen are the top ones of the model's own attention of its latest tokens, budgets and skips hold)."""

import pytest
import torch
from transformers import LogitsProcessorList

from hf_kvmap import MappedCache, MapperModel
from hf_kvmap._compat import cache_kwargs
from hf_kvmap.repair import DecodeRefresh, RepairConfig, repair_cache
from hf_kvmap.repair.target_attention import TargetAttentionStrategy

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5


@pytest.fixture(scope="module", params=["eager", "sdpa"])
def pair(request, tiny):
    """`(source, target, identity mapper)` of one geometry with independent weights: the mapped cache is far off."""
    config = tiny.config(layers=3)
    source = tiny.model(config, seed=1, attn_implementation=request.param)
    return source, tiny.model(config, seed=0, attn_implementation=request.param), MapperModel.identity(config)


def _prompt(tokens=24, seed=3):
    return torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(seed))


def _mapped(pair, tiny, ids):
    source, _, mapper = pair
    return MappedCache.from_source(tiny.prefill(source, ids), mapper)


def _generate(model, ids, cache, processor=None, new=8):
    processors = LogitsProcessorList([processor] if processor is not None else [])
    return model.generate(
        ids,
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        logits_processor=processors,
        **cache_kwargs(cache),
    )


def _prompt_diff(cache, own, length):
    return max(
        (a[..., :length, :] - b[..., :length, :]).abs().max().item()
        for x, y in zip(cache.layers, own.layers)
        for a, b in ((x.keys, y.keys), (x.values, y.values))
    )


def test_refreshing_the_targets_own_cache_changes_nothing(pair, tiny):
    _, target, _ = pair
    ids = _prompt()
    expected = _generate(target, ids, tiny.prefill(target, ids[:, :-1]))
    cache = tiny.prefill(target, ids[:, :-1])
    refresh = DecodeRefresh(target, cache, every=1, tokens=5)
    assert torch.equal(_generate(target, ids, cache, refresh), expected)
    assert refresh.recomputed == [23] and refresh.refreshes == 5  # 5 + 5 + 5 + 5 + 3 of the 23 cached positions
    # each position once: the refresh keeps what it recomputed itself, and sets nothing on a cache that keeps no record
    assert bool(refresh.done.all()) and not hasattr(cache, "recomputed")


def test_refreshing_every_position_makes_the_prompt_the_targets_own(pair, tiny):
    _, target, _ = pair
    ids = _prompt()
    cache, own = _mapped(pair, tiny, ids), tiny.prefill(target, ids[:, :-1])
    assert _prompt_diff(cache, own, 23) > 0.1
    refresh = DecodeRefresh(target, cache, every=2, fraction=1.0)
    _generate(target, ids, cache, refresh, new=3)  # one refresh, after the second token
    assert _prompt_diff(cache, own, 23) < TOL
    info = cache.mapping_info["refresh"]
    assert info["refreshes"] == 1 and info["recomputed"] == [23] and info["recomputed_fraction"] == 1.0
    assert cache.mapping_info["approximate"] is True  # the generated tokens keep what they were computed with


def test_a_refresh_recomputes_the_top_positions_of_the_latest_tokens_own_attention(tiny):
    """The refresh's default scores are the eager forward's softmax weights of the last `every` tokens' queries,
    summed over heads and layers, at the query that reads a position most; it recomputes their top `tokens`."""
    model = tiny.model(tiny.config(layers=3), seed=2)
    ids = _prompt(tokens=20)
    full = _generate(model, ids, None, new=4)  # 20 prompt tokens + 4 generated
    cache = tiny.prefill(model, ids[:, :-1])  # 19 cached prompt positions
    refresh = DecodeRefresh(model, cache, every=4, tokens=5)
    with torch.no_grad():
        model(full[:, 19:-1], use_cache=True, **cache_kwargs(cache))  # the cache now holds 23 tokens
        out = model(full[:, :-1], output_attentions=True)
    per_query = sum(weights[:, :, -4:].sum(1) for weights in out.attentions)  # (1, 4 queries, 23)
    expected = per_query.amax(1)[0, :19]
    refresh.refresh(full[:, :-1])
    chosen = refresh.done[0].nonzero().squeeze(-1)
    assert chosen.tolist() == sorted(expected.topk(5).indices.tolist())
    settings = TargetAttentionStrategy(last_tokens=4, reduce="max").settings()
    assert settings == {"name": "target_attention", "last_tokens": 4, "reduce": "max"}


def test_positions_repaired_before_are_skipped_and_the_limit_holds(pair, tiny):
    source, target, mapper = pair
    ids = _prompt()
    cache = _mapped(pair, tiny, ids)
    repair_cache(target, cache, ids, RepairConfig("tail", tokens=6))
    assert cache.recomputed[0].nonzero().squeeze(-1).tolist() == list(range(17, 23))
    refresh = DecodeRefresh(target, cache, every=1, tokens=3, limit=0.5)
    _generate(target, ids, cache, refresh, new=8)
    assert refresh.recomputed == [11]  # 3 + 3 + 3 + 2: half of 23, rounded down
    assert int(refresh.done.sum()) == 6 + 11  # never a tail position again


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"every": 0, "tokens": 2}, ValueError, "every"),
        ({"tokens": 2, "fraction": 0.1}, ValueError, "exactly one budget"),
        ({}, ValueError, "exactly one budget"),
        ({"fraction": 1.5}, ValueError, "fraction=1.5"),
        ({"tokens": 2, "limit": 0}, ValueError, "limit=0"),
        ({"tokens": 2, "strategy": "draft_attention"}, ValueError, "reads the source"),
        ({"tokens": 2, "strategy": "nope"}, ValueError, "Unknown repair strategy"),
    ],
)
def test_bad_settings_are_refused(pair, tiny, kwargs, error, fragment):
    _, target, _ = pair
    cache = tiny.prefill(target, _prompt()[:, :-1])
    with pytest.raises(error, match=fragment):
        DecodeRefresh(target, cache, **kwargs)


def test_a_refresh_before_any_generated_token_is_refused(pair, tiny):
    _, target, _ = pair
    ids = _prompt()
    cache = tiny.prefill(target, ids[:, :-1])
    with pytest.raises(ValueError, match="after generated tokens"):
        DecodeRefresh(target, cache, tokens=2).refresh(ids[:, :-1])
