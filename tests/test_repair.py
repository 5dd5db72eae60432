"""Selective repair: recomputing every position is the target's own cache, the tail is a crop and a re-prefill, nothing
is the mapped cache, left-padded rows equal single rows, every registered strategy returns its budget, and bad input
is refused with a clear error."""

from __future__ import annotations

import math
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_kvmap import MappedCache, MapperModel, handoff
from hf_kvmap._compat import cache_kwargs
from hf_kvmap.delivery import read_provenance, save_cache
from hf_kvmap.drafting import Draft, greedy_draft
from hf_kvmap.repair import (
    STRATEGIES,
    RepairConfig,
    Strategy,
    apply_repair,
    repair_cache,
    strategy_from_dict,
)
from hf_kvmap.repair.attention import last_tokens_attention
from hf_kvmap.repair.base import budget_counts
from hf_kvmap.repair.draft_attention import DraftAttentionStrategy
from hf_kvmap.repair.draft_branches import DraftBranchesStrategy
from hf_kvmap.repair.draft_coverage import DraftCoverageStrategy
from hf_kvmap.repair.query_overlap import QueryOverlapStrategy, markup_ids, run_scores
from hf_kvmap.request_context import RequestContext
from hf_kvmap.rope import positions_from_attention_mask

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5


def _model(config, seed, implementation):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model


@pytest.fixture(scope="module", params=["eager", "sdpa"])
def pair(request, tiny):
    """`(source, target, identity mapper)`: two 3-layer models of one geometry with independent weights, so the mapped
    cache is far from the target's own."""
    config = tiny.config(layers=3)
    return _model(config, 1, request.param), _model(config, 0, request.param), MapperModel.identity(config)


def _prompt(tokens=24, seed=3, batch=1):
    return torch.randint(3, 128, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def _mapped(pair, tiny, ids, mask=None):
    source, _, mapper = pair
    source_cache = tiny.prefill(source, ids, mask)
    positions = None if mask is None else positions_from_attention_mask(mask, *ids.shape, ids.device)
    return MappedCache.from_source(
        source_cache, mapper, attention_mask=mask, source_position_ids=positions
    ), source_cache


def _max_diff(first, second, length=None):
    return max(
        (a[..., :length, :] - b[..., :length, :]).abs().max().item()
        for x, y in zip(first.layers, second.layers)
        for a, b in ((x.keys, y.keys), (x.values, y.values))
    )


def _settings(name):
    """Every registered strategy with small options (the attention strategies read 4 final tokens, the draft is 3)."""
    if name in ("draft_attention", "draft_coverage", "draft_branches"):
        return {"name": name, "draft_tokens": 3, "last_tokens": 4}
    if name == "query_overlap":  # the query is the last 6 tokens; a draft fills the rest of the budget
        return {"name": name, "last_tokens": 6, "before": 1, "after": 2, "fill": "draft_attention"}
    return {"name": name, "last_tokens": 4} if name in ("source_attention", "target_attention") else name


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_recomputing_every_position_is_the_targets_own_cache(pair, tiny, name):
    source, target, _ = pair
    ids = _prompt()
    cache, source_cache = _mapped(pair, tiny, ids)
    own = tiny.prefill(target, ids[:, :-1])
    assert _max_diff(cache, own) > 0.1  # the map alone is far from it
    repair_cache(
        target, cache, ids, RepairConfig(_settings(name), fraction=1.0), source=source, source_cache=source_cache
    )
    assert _max_diff(cache, own) < TOL
    assert cache.mapping_info["repair"]["exact"] and cache.mapping_info["approximate"] is False
    assert cache.mapping_info["repair"]["recomputed"] == [ids.shape[1] - 1]
    assert torch.equal(tiny.greedy(target, ids, cache=cache), tiny.greedy(target, ids))


@pytest.mark.parametrize("tail", [1, 5, 12])
def test_the_tail_is_a_crop_and_a_re_prefill(pair, tiny, tail):
    _, target, _ = pair
    ids = _prompt()
    cache, _ = _mapped(pair, tiny, ids)
    expected, _ = _mapped(pair, tiny, ids)
    expected.crop(-tail)
    length = ids.shape[1] - 1
    with torch.no_grad():
        target(input_ids=ids[:, length - tail : length], **cache_kwargs(expected), use_cache=True)
    repair_cache(target, cache, ids, RepairConfig("tail", tokens=tail))
    assert _max_diff(cache, expected) < TOL
    assert cache.mapping_info["repair"]["recomputed"] == [tail] and cache.mapping_info["approximate"] is True
    assert torch.equal(tiny.greedy(target, ids, cache=cache), tiny.greedy(target, ids, cache=expected))


def test_a_fraction_of_the_tail_rounds_down(pair, tiny):
    _, target, _ = pair
    ids = _prompt(tokens=21)  # 20 cached tokens: 0.33 of them is 6.6, so 6
    cache, _ = _mapped(pair, tiny, ids)
    repair_cache(target, cache, ids, RepairConfig("tail", fraction=0.33))
    info = cache.mapping_info["repair"]
    assert info["recomputed"] == [6] and info["candidates"] == [20] and info["recomputed_fraction"] == 0.3


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_recomputing_nothing_leaves_the_mapped_cache(pair, tiny, name):
    source, target, _ = pair
    ids = _prompt()
    cache, source_cache = _mapped(pair, tiny, ids)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    repair_cache(
        target, cache, ids, RepairConfig(_settings(name), fraction=0.0), source=source, source_cache=source_cache
    )
    assert all(
        torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        for layer, (keys, values) in zip(cache.layers, before)
    )
    assert cache.mapping_info["repair"]["recomputed"] == [0] and cache.mapping_info["approximate"] is True


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_left_padded_rows_equal_single_rows(pair, tiny, name):
    source, target, _ = pair
    lengths = (15, 24, 19)
    ids, mask = tiny.left_padded_batch(lengths=lengths, seed=5)
    repair = RepairConfig(_settings(name), fraction=0.3)
    batch, batch_source = _mapped(pair, tiny, ids, mask)
    positions = positions_from_attention_mask(mask, *ids.shape, ids.device)  # the source prefilled as generate does
    repair_cache(
        target,
        batch,
        ids,
        repair,
        attention_mask=mask,
        source=source,
        source_cache=batch_source,
        source_position_ids=positions,
    )
    width = ids.shape[1]
    for row, length in enumerate(lengths):
        single_ids = ids[row : row + 1, width - length :]
        single, single_source = _mapped(pair, tiny, single_ids)
        repair_cache(target, single, single_ids, repair, source=source, source_cache=single_source)
        for got, want in zip(batch.layers, single.layers):
            for a, b in ((got.keys, want.keys), (got.values, want.values)):
                assert (a[row, :, width - length : width - 1] - b[0]).abs().max().item() < 1e-4
    assert batch.mapping_info["repair"]["recomputed"] == [math.floor(0.3 * (n - 1) + 1e-9) for n in lengths]
    assert torch.equal(  # row 1 is the longest: unpadded on its own
        _greedy(target, ids, mask, batch)[1:2, width:],
        _greedy(target, ids[1:2], None, _single_repaired(pair, tiny, ids[1:2], repair))[:, width:],
    )


def _greedy(model, ids, mask, cache):
    return model.generate(
        ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=6, do_sample=False, eos_token_id=None
    )


def _single_repaired(pair, tiny, ids, repair):
    source, target, _ = pair
    cache, source_cache = _mapped(pair, tiny, ids)
    return repair_cache(target, cache, ids, repair, source=source, source_cache=source_cache)


def _context(pair, tiny, ids, mask):
    source, target, _ = pair
    cache, source_cache = _mapped(pair, tiny, ids, mask)
    length = cache.get_seq_length()
    return RequestContext(
        target=target,
        cache=cache,
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions_from_attention_mask(mask, *ids.shape, ids.device),
        candidates=mask[:, :length].bool(),
        source=source,
        source_cache=source_cache,
        source_position_ids=positions_from_attention_mask(mask, *ids.shape, ids.device),
    )


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("budget", [{"fraction": 0.25}, {"tokens": 7}, {"tokens": 100}])
def test_every_strategy_returns_its_budget_of_valid_positions(pair, tiny, name, budget):
    ids, mask = tiny.left_padded_batch(lengths=(10, 22, 16), seed=7)
    context = _context(pair, tiny, ids, mask)
    counts = budget_counts(context.candidates, budget.get("fraction"), budget.get("tokens"))
    positions, valid = strategy_from_dict(_settings(name)).select(context, counts)
    assert valid.sum(-1).tolist() == counts and positions.shape[1] == max(counts)
    for row in range(ids.shape[0]):
        chosen = positions[row][valid[row]]
        filler = positions[row][~valid[row]]
        assert chosen.unique().numel() == chosen.numel() and bool(context.candidates[row, chosen].all())
        assert filler.unique().numel() == filler.numel() and not bool(mask[row, filler].any())


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_round_trips_its_settings(name):
    selector = strategy_from_dict(_settings(name))
    assert isinstance(selector, Strategy) and strategy_from_dict(selector.settings()).settings() == selector.settings()
    assert RepairConfig.from_dict(RepairConfig(selector.settings(), tokens=3).to_dict()).to_dict()["strategy"] == (
        selector.settings()
    )


def test_query_overlap_finds_every_run_of_the_query_and_weighs_its_tokens():
    # context 1 2 3 9 9 1 2 4 ...: the query 1 2 3 8 holds the run 1 2 3 and, apart, 1 2
    weights = {1: 1.0, 2: 2.0, 3: 4.0, 4: 8.0}
    assert run_scores([1, 2, 3, 9, 9, 1, 2, 4], [1, 2, 3, 8], weights) == [(0, 3, 7.0), (5, 7, 3.0)]
    assert run_scores([5, 6], [1, 2], weights) == []
    # a context token the query holds twice takes the alignment that scores most: 2 3 after 1 is one run of three
    assert run_scores([1, 2, 3], [2, 3, 7, 1, 2, 3], weights) == [(0, 3, 7.0)]


def _overlap_context(ids, length=None):
    length = ids.shape[1] - 1 if length is None else length
    return RequestContext(
        target=None,
        cache=None,
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(ids.shape[1])[None],
        candidates=torch.ones(1, length, dtype=torch.bool),
    )


def test_query_overlap_marks_the_planted_span_and_its_window_first_then_the_fill():
    # a context of distinct tokens with the planted span 50 51 52 at positions 10-12; the query (the last 4 tokens)
    # repeats it after one token of its own
    context = list(range(100, 130))
    context[10:13] = [50, 51, 52]
    ids = torch.tensor([context + [60, 50, 51, 52]])
    selector = QueryOverlapStrategy(last_tokens=4, before=2, after=3, fill="tail")
    marks = selector.marks(_overlap_context(ids))
    n = 30  # context tokens before the query, each held once
    weight = math.log(n / 2)
    run = 3 * weight * (math.log(n / 1) / math.log(n)) ** 2  # the run occurs once: specificity 1
    want = torch.zeros(33)
    want[8:16] = run  # 2 before, the run 10-12, 3 after
    want[30:33] = run  # the query's own cached positions score as the best run
    assert torch.allclose(marks[0], want)
    # the marked positions come first (by score), then the fill's order (tail: the latest)
    context_ = _overlap_context(ids)
    positions, valid = selector.select(context_, [8 + 3 + 2])
    assert positions[0].tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 28, 29, 30, 31, 32]
    # a query that repeats nothing leaves the whole budget to the fill
    alone = torch.tensor([list(range(100, 130)) + [60, 61, 62, 63]])
    assert not QueryOverlapStrategy(last_tokens=4, fill="tail").marks(_overlap_context(alone)).any()
    positions, _ = QueryOverlapStrategy(last_tokens=4, fill="tail").select(_overlap_context(alone), [5])
    assert positions[0].tolist() == [28, 29, 30, 31, 32]


def test_query_overlap_weighs_a_run_by_how_often_the_context_repeats_it():
    # the pair 70 71 occurs four times in the context; the query repeats it and the once-held 80
    context = list(range(100, 140))
    for start in (3, 13, 23, 33):
        context[start : start + 2] = [70, 71]
    context[18] = 80
    ids = torch.tensor([context + [70, 71, 80]])
    n = 40
    marks = QueryOverlapStrategy(last_tokens=3, before=0, after=0, min_share=0.01).marks(_overlap_context(ids))[0]
    pair = 2 * math.log(n / 5) * (math.log(n / 4) / math.log(n)) ** 2
    single = math.log(n / 2)
    assert marks[3].item() == pytest.approx(pair) and marks[18].item() == pytest.approx(single)
    assert single > pair  # a name held once outweighs a phrase repeated throughout
    # runs under min_share of the best are dropped
    strict = QueryOverlapStrategy(last_tokens=3, before=0, after=0, min_share=0.9).marks(_overlap_context(ids))[0]
    assert strict[18] > 0 and strict[3] == 0


def test_query_overlap_skips_markup_so_the_fact_the_question_names_comes_first():
    # the turn marker 7 8 6 9 (7 and 6: special tokens) opens two turns and the question; the fact 50 51 is held once
    # (51 is common). Matched, the marker run outscores the fact; skipped, the specials end every run and match
    # nothing, and the fact is the best run
    context = list(range(100, 130))
    for start in (2, 20):
        context[start : start + 4] = [7, 8, 6, 9]
    context[10:12] = [50, 51]
    context[15] = context[25] = 51
    ids = torch.tensor([context + [7, 8, 6, 9, 50, 51]])
    n = 30
    twice, specific_twice = math.log(n / 3), (math.log(n / 2) / math.log(n)) ** 2
    marker = 4 * twice * specific_twice
    fact = math.log(n / 2) + math.log(n / 4)  # held once: specificity 1
    assert marker > fact > 0.8 * marker
    plain = QueryOverlapStrategy(last_tokens=6, before=0, after=0, min_share=0.9).marks(_overlap_context(ids))[0]
    assert plain[2:6].tolist() == pytest.approx([marker] * 4) and plain[20:24].tolist() == pytest.approx([marker] * 4)
    assert plain[10] == 0  # under 0.9 of the marker run: not kept
    skipping = QueryOverlapStrategy(last_tokens=6, before=0, after=0, min_share=0.9, skip=[7, 6])
    marks = skipping.marks(_overlap_context(ids))[0]
    assert marks[10:12].tolist() == pytest.approx([fact] * 2)
    assert marks[:10].eq(0).all() and marks[12:30].eq(0).all()  # 8 and 9 alone are far under the share
    assert marks[30:].tolist() == pytest.approx([fact] * 5)  # the query's own cached positions
    assert skipping.settings()["skip"] == [6, 7] and "skip" not in QueryOverlapStrategy().settings()
    assert strategy_from_dict(skipping.settings()).settings() == skipping.settings()
    for bad in ("markup", [7, "8"], [True], 7):
        with pytest.raises(ValueError, match="markup_ids"):
            QueryOverlapStrategy(skip=bad)


def test_markup_ids_are_the_tokenizers_special_tokens():
    special = types.SimpleNamespace(special=True)
    plain = types.SimpleNamespace(special=False)
    tokenizer = types.SimpleNamespace(all_special_ids=[5, 3], added_tokens_decoder={3: special, 9: special, 11: plain})
    assert markup_ids(tokenizer) == [3, 5, 9]


def test_skip_markup_reads_as_the_tokenizers_special_tokens_on_every_command_line():
    import argparse

    from benchmarks.switch import long_switch
    from hf_kvmap.commands import _args
    from hf_kvmap.repair import resolve_markup

    special = types.SimpleNamespace(special=True)
    tokenizer = types.SimpleNamespace(all_special_ids=[5], added_tokens_decoder={4: special})
    _, settings, _, _ = long_switch.parse_rung("query_overlap:fill=draft_branches,skip=markup@0.1")
    want = {"name": "query_overlap", "fill": "draft_branches", "skip": [4, 5]}
    assert resolve_markup(settings, tokenizer) == want
    nested = {"name": "mix", "first": {"name": "query_overlap", "skip": "markup"}}
    assert resolve_markup(nested, tokenizer)["first"]["skip"] == [4, 5]
    assert resolve_markup(nested, None)["first"]["skip"] == []  # before a tokenizer is loaded: no ids
    assert resolve_markup("tail", tokenizer) == "tail" and resolve_markup({"name": "tail"}, tokenizer) == {
        "name": "tail"
    }
    # calibrate-ladder's --strategies: checked at parse time, the markup kept for the command to read
    parsed = _args.strategies('[{"name": "query_overlap", "skip": "markup"}, "tail"]')
    assert parsed == [{"name": "query_overlap", "skip": "markup"}, {"name": "tail"}]
    assert strategy_from_dict(resolve_markup(parsed[0], tokenizer)).settings()["skip"] == [4, 5]
    with pytest.raises(argparse.ArgumentTypeError, match="min_share"):
        _args.strategies('[{"name": "query_overlap", "skip": "markup", "min_share": 2}]')


def test_query_overlap_needs_the_source_only_where_its_fill_does():
    assert not QueryOverlapStrategy().needs_source and QueryOverlapStrategy(fill="draft_branches").needs_source
    nested = {"name": "draft_attention", "draft_tokens": 3}
    assert QueryOverlapStrategy(fill=nested).settings()["fill"] == {**nested, "last_tokens": 0, "stop_at_eos": True}
    assert QueryOverlapStrategy(fill="tail").settings()["fill"] == "tail"


def test_attention_from_hooks_equals_the_models_own_attention_weights(tiny):
    """The queries rebuilt from each layer's input meet the cache keys exactly as the eager forward's softmax does."""
    model = _model(tiny.config(layers=3), 2, "eager")
    ids = _prompt(tokens=20)
    cache = tiny.prefill(model, ids)
    mask = torch.ones_like(ids)
    mass = last_tokens_attention(model, cache, ids, mask, positions_from_attention_mask(None, 1, 20, "cpu"), 5)
    head = tiny.prefill(model, ids[:, :15])
    with torch.no_grad():
        out = model(ids[:, 15:], **cache_kwargs(head), output_attentions=True, use_cache=True)
    expected = sum(weights.sum((1, 2)) for weights in out.attentions)
    assert torch.allclose(mass, expected, atol=1e-4) and cache.get_seq_length() == 20


def test_the_draft_is_what_generate_decodes_and_leaves_the_cache_alone(pair, tiny):
    source = pair[0]
    ids, mask = tiny.left_padded_batch(lengths=(15, 24, 19), seed=5)
    positions = positions_from_attention_mask(mask, *ids.shape, ids.device)
    cache = tiny.prefill(source, ids, mask)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    draft = greedy_draft(source, cache, ids, mask, positions, 5)
    expected = _greedy(source, ids, mask, None)[:, ids.shape[1] : ids.shape[1] + 5]
    assert torch.equal(draft, expected)
    assert cache.get_seq_length() == ids.shape[1] and all(
        torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        for layer, (keys, values) in zip(cache.layers, before)
    )


def test_the_draft_stops_once_every_row_has_ended(pair, tiny):
    source = pair[0]
    ids, mask = tiny.left_padded_batch(lengths=(15, 24), seed=5)
    positions = positions_from_attention_mask(mask, *ids.shape, ids.device)
    cache = tiny.prefill(source, ids, mask)
    full = greedy_draft(source, cache, ids, mask, positions, 6)
    ends = [int(full[0, 1]), int(full[1, 3])]  # row 0 ends at step 1, row 1 at step 3 (or earlier)
    draft = greedy_draft(source, cache, ids, mask, positions, 6, eos=ends)
    ended = torch.isin(full, torch.tensor(ends))
    last = int(max(row.nonzero()[0, 0] for row in ended))  # the step at which the last row ends
    assert last <= 3 and torch.equal(draft, full[:, : last + 1])
    assert torch.equal(greedy_draft(source, cache, ids, mask, positions, 6, eos=[-1]), full)


def test_a_draft_read_in_steps_is_the_draft_read_at_once(pair, tiny):
    """A probe reads the first tokens of a `Draft`, the repair continues it: the tokens are the ones one reader would
    decode, the top probability is `generate`'s, and the rows of a draft continue as those rows alone would."""
    source = pair[0]
    ids, mask = tiny.left_padded_batch(lengths=(15, 24, 19), seed=5)
    positions = positions_from_attention_mask(mask, *ids.shape, ids.device)
    cache = tiny.prefill(source, ids, mask)
    full = greedy_draft(source, cache, ids, mask, positions, 6)
    draft = Draft(source, cache, ids, mask, positions)
    assert torch.equal(draft.tokens(2), full[:, :2]) and draft.steps == 2
    ends = [int(full[0, 2]), int(full[1, 3]), int(full[2, 1])]
    assert torch.equal(draft.tokens(6, eos=ends), greedy_draft(source, cache, ids, mask, positions, 6, eos=ends))
    assert torch.equal(draft.tokens(6), full) and draft.steps == 6
    top = tiny.greedy_probabilities(source, ids, mask, new=3).amax(-1)
    torch.testing.assert_close(draft.top2(3)[..., 0], top, rtol=0, atol=1e-6)
    assert (draft.top2(3)[..., 0] >= draft.top2(3)[..., 1]).all()
    part = Draft(source, cache, ids, mask, positions)
    part.tokens(2)
    rows = part.rows(torch.tensor([2, 0]))
    assert torch.equal(rows.tokens(6), full[[2, 0]]) and part.steps == 2
    with pytest.raises(ValueError, match="needs a cache of its first 23 tokens"):
        cache.crop(-3)
        Draft(source, cache, ids, mask, positions)


def _self_context(model, cache, ids):
    """A repair context where `model` is both the source and the target of its own cache of `ids` (one row)."""
    mask = torch.ones_like(ids)
    return RequestContext(
        target=model,
        cache=cache,
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions_from_attention_mask(None, *ids.shape, "cpu"),
        candidates=mask[:, : ids.shape[1] - 1].bool(),
        source=model,
        source_cache=cache,
    )


@pytest.mark.parametrize("last_tokens", [0, 4])
@pytest.mark.parametrize("eos_at", [None, 1])
def test_draft_attention_is_the_models_own_attention_over_prompt_and_draft(tiny, last_tokens, eos_at):
    """The scores equal the eager forward's softmax weights of the drafted tokens' (and the last prompt tokens')
    queries, read from one forward of the prompt followed by the draft; with an end-of-sequence token drafted at step
    `eos_at`, the draft's queries after it are not read."""
    model = _model(tiny.config(layers=3), 2, "eager")
    ids = _prompt(tokens=20)
    full = _greedy(model, ids, None, None)[:, :23]
    model.generation_config.eos_token_id = None if eos_at is None else int(full[0, 20 + eos_at])
    context = _self_context(model, tiny.prefill(model, ids), ids)
    scores = DraftAttentionStrategy(draft_tokens=3, last_tokens=last_tokens).score(context)
    with torch.no_grad():
        out = model(full, output_attentions=True)
    read = 23 if eos_at is None else 20 + eos_at + 1  # queries up to and including the first end token
    expected = sum(weights[:, :, 20 - last_tokens : read].sum((1, 2)) for weights in out.attentions)[:, :19]
    assert scores.shape == (1, 19) and torch.allclose(scores, expected, atol=1e-4)


@pytest.mark.parametrize("eos_at", [None, 1])
def test_draft_coverage_is_the_largest_read_of_one_drafted_token(tiny, eos_at):
    """`draft_coverage` scores each position by the eager forward's softmax weights of one drafted token's query,
    summed over heads and layers, at the drafted token that reads it most (none after a drafted end token); its
    per-query masses add up to `draft_attention`'s sum."""
    model = _model(tiny.config(layers=3), 2, "eager")
    ids = _prompt(tokens=20)
    full = _greedy(model, ids, None, None)[:, :24]
    model.generation_config.eos_token_id = None if eos_at is None else int(full[0, 20 + eos_at])
    context = _self_context(model, tiny.prefill(model, ids), ids)
    scores = DraftCoverageStrategy(draft_tokens=4).score(context)
    with torch.no_grad():
        out = model(full, output_attentions=True)
    read = 24 if eos_at is None else 20 + eos_at + 1
    per_query = sum(weights[:, :, 20:read].sum(1) for weights in out.attentions)  # (batch, queries, T)
    expected = per_query.amax(1)[:, :19]
    assert scores.shape == (1, 19) and torch.allclose(scores, expected, atol=1e-4)
    assert not torch.allclose(scores, per_query.sum(1)[:, :19], atol=1e-3)  # a max, not the sum
    summed = DraftAttentionStrategy(draft_tokens=4).score(context)
    assert torch.allclose(summed, per_query.sum(1)[:, :19], atol=1e-4)


def test_one_draft_branch_is_draft_attention(tiny):
    model = _model(tiny.config(layers=3), 2, "eager")
    ids = _prompt(tokens=20)
    context = _self_context(model, tiny.prefill(model, ids), ids)
    for last_tokens in (0, 3):
        one = DraftBranchesStrategy(branches=1, draft_tokens=4, last_tokens=last_tokens).score(context)
        assert torch.allclose(one, DraftAttentionStrategy(draft_tokens=4, last_tokens=last_tokens).score(context))


def test_draft_branches_sum_the_models_own_attention_over_each_branch(tiny):
    """Each branch starts with one of the model's top-3 first tokens and continues greedily; the scores are the eager
    forward's softmax weights of every branch's queries (summed over heads, queries and layers), added up."""
    model = _model(tiny.config(layers=3), 2, "eager")
    model.generation_config.eos_token_id = None
    ids = _prompt(tokens=20)
    context = _self_context(model, tiny.prefill(model, ids), ids)
    scores = DraftBranchesStrategy(branches=3, draft_tokens=3).score(context)
    with torch.no_grad():
        firsts = model(ids).logits[0, -1].topk(3).indices
    expected = torch.zeros(1, 19)
    for first in firsts:
        start = torch.cat([ids, first.view(1, 1)], dim=1)
        branch = _greedy(model, start, None, None)[:, :23]  # the forced token + 2 greedy ones
        with torch.no_grad():
            out = model(branch, output_attentions=True)
        expected += sum(weights[:, :, 20:23].sum((1, 2)) for weights in out.attentions)[:, :19]
    assert scores.shape == (1, 19) and torch.allclose(scores, expected, atol=1e-4)
    greedy_only = DraftAttentionStrategy(draft_tokens=3).score(context)
    assert not torch.allclose(scores, greedy_only, atol=1e-3)


def test_draft_branches_that_end_early_score_as_each_branch_drafted_alone(tiny):
    """The branches draft side by side as rows of one batch; a branch that drafts the end token first reads no token
    after it while the others go on, so the sum equals each branch drafted alone (as `draft_attention` of the prompt
    and its forced first token) and added up."""
    model = _model(tiny.config(layers=3), 2, "eager")
    model.generation_config.eos_token_id = None
    ids = _prompt(tokens=20)
    with torch.no_grad():
        firsts = model(ids).logits[0, -1].topk(3).indices
    drafts = [_greedy(model, torch.cat([ids, f.view(1, 1)], dim=1), None, None)[0, 21:24] for f in firsts]
    end = int(drafts[1][0])  # the second branch drafts it right after its forced token
    ends = [next((i for i, t in enumerate(d.tolist()) if t == end), None) for d in drafts]
    assert ends[1] == 0 and ends != [0, 0, 0]  # at least one branch goes on past it
    model.generation_config.eos_token_id = end
    context = _self_context(model, tiny.prefill(model, ids), ids)
    scores = DraftBranchesStrategy(branches=3, draft_tokens=4).score(context)
    expected = torch.zeros(1, 19)
    for first in firsts:
        alone = torch.cat([ids, first.view(1, 1)], dim=1)
        branch = _self_context(model, tiny.prefill(model, alone), alone)
        branch.candidates = branch.candidates[:, :19]
        expected += DraftAttentionStrategy(draft_tokens=3, last_tokens=1).score(branch)
    assert torch.allclose(scores, expected, atol=1e-4)
    read_on = DraftBranchesStrategy(branches=3, draft_tokens=4, stop_at_eos=False).score(context)
    assert not torch.allclose(read_on, scores, atol=1e-3)  # the end token did stop the second branch


def test_per_query_attention_adds_up_to_the_summed_attention(tiny):
    model = _model(tiny.config(layers=3), 2, "eager")
    ids = _prompt(tokens=20)
    cache = tiny.prefill(model, ids)
    mask, positions = torch.ones_like(ids), positions_from_attention_mask(None, 1, 20, "cpu")
    summed = last_tokens_attention(model, cache, ids, mask, positions, 5)
    apart = last_tokens_attention(model, cache, ids, mask, positions, 5, per_query=True)
    assert apart.shape == (1, 5, 20) and torch.allclose(apart.sum(1), summed, atol=1e-5)
    padded = torch.ones(2, 20, dtype=torch.long)
    padded[1, :17] = 0  # a row of 3 tokens reads 2 final tokens, not 5
    with pytest.raises(ValueError, match="per_query=True needs every row to read the same 5 final tokens"):
        last_tokens_attention(
            model,
            tiny.prefill(model, ids.repeat(2, 1)),
            ids.repeat(2, 1),
            padded,
            positions.repeat(2, 1),
            5,
            per_query=True,
        )


def test_a_query_mask_counts_only_the_queries_it_marks(tiny):
    model = _model(tiny.config(layers=3), 2, "eager")
    ids = _prompt(tokens=20)
    cache = tiny.prefill(model, ids)
    mask, positions = torch.ones_like(ids), positions_from_attention_mask(None, 1, 20, "cpu")
    marked = torch.zeros_like(ids, dtype=torch.bool)
    marked[:, [16, 18]] = True
    every = last_tokens_attention(model, cache, ids, mask, positions, 5)
    assert torch.equal(every, last_tokens_attention(model, cache, ids, mask, positions, 5, query_mask=mask.bool()))
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    expected = sum(weights[:, :, [16, 18]].sum((1, 2)) for weights in out.attentions)
    got = last_tokens_attention(model, cache, ids, mask, positions, 5, query_mask=marked)
    assert torch.allclose(got, expected, atol=1e-4)


def test_early_deviation_at_an_exact_layer_is_zero(tiny):
    config = tiny.config(layers=3)
    model = _model(config, 0, "eager")
    ids = _prompt()
    cache = MappedCache.from_source(tiny.prefill(model, ids), MapperModel.identity(config))
    context = RequestContext(
        target=model,
        cache=cache,
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=positions_from_attention_mask(None, *ids.shape, "cpu"),
        candidates=torch.ones(1, ids.shape[1] - 1, dtype=torch.bool),
    )
    for layer in (0, 1, 2):
        assert strategy_from_dict({"name": "early_deviation", "layer": layer}).score(context).abs().max() < 1e-5


def test_the_repair_is_recorded_in_a_saved_cache(pair, tiny, tmp_path):
    _, target, _ = pair
    ids = _prompt()
    cache, _ = _mapped(pair, tiny, ids)
    repair_cache(target, cache, ids, RepairConfig("tail", fraction=0.5))
    save_cache(cache, tmp_path / "cache.safetensors", input_ids=ids)
    record = read_provenance(tmp_path / "cache.safetensors")["mapping_info"]
    assert record["approximate"] is True and record["repair"]["strategy"] == {"name": "tail"}
    assert record["repair"]["recomputed"] == [11]


def test_a_mapped_cache_is_repaired_by_the_next_step(pair, tiny):
    """The cache stores, the repair is the step after it (`apply_repair`); `from_source(repair=)`, that one call, is
    deprecated: it warns (naming the caller) and gives the very same cache."""
    source, target, mapper = pair
    ids = _prompt()
    source_cache = tiny.prefill(source, ids)
    repair = RepairConfig({"name": "source_attention", "last_tokens": 4}, fraction=1.0)
    mapping = dict(first_layer="target", target_model=target, input_ids=ids, source_model=source)
    repaired = MappedCache.from_source(source_cache, mapper, **mapping)
    apply_repair(target, repaired, ids, repair, source=source, source_cache=source_cache)
    assert _max_diff(repaired, tiny.prefill(target, ids[:, :-1])) < TOL
    assert repaired.mapping_info["first_layer"] == "target" and repaired.mapping_info["approximate"] is False
    with pytest.warns(DeprecationWarning, match=r"from_source\(repair=\) is deprecated .* 0\.2") as caught:
        legacy = MappedCache.from_source(source_cache, mapper, **mapping, repair=repair)
    assert caught[0].filename == __file__ and legacy.mapping_info == repaired.mapping_info
    assert torch.equal(legacy.recomputed, repaired.recomputed)
    for a, b in zip(legacy.layers, repaired.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    partial = MappedCache.from_source(source_cache, mapper, first_layer="target", target_model=target, input_ids=ids)
    apply_repair(target, partial, ids, {"strategy": "tail", "tokens": 4})
    assert partial.mapping_info["repair"]["recomputed"] == [4] and partial.mapping_info["approximate"] is True


def test_the_three_contexts_are_one_request_context_and_their_old_names_still_build_it():
    """`Request`, `ProbeContext` and `RepairContext` carried the same fields: one `RequestContext` now, the old names
    resolving (with a deprecation) to subclasses that still take their old positional order and `source_draft=`."""
    import hf_kvmap.serving as serving
    import hf_kvmap.serving.pipeline as pipeline
    import hf_kvmap.serving.probes as probes

    ids, mask = torch.ones(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.long)
    draft = object()
    with pytest.warns(DeprecationWarning, match="RepairContext is deprecated .* use hf_kvmap.request_context"):
        from hf_kvmap.repair import RepairContext
    old = RepairContext(None, None, ids, mask, None, mask[:, :5].bool(), source_draft=draft)
    assert isinstance(old, RequestContext) and old.length == old.cached_length == 5 and old.source_draft is draft
    for module in (probes, serving):
        with pytest.warns(DeprecationWarning, match="ProbeContext is deprecated"):
            probe_context = module.ProbeContext(None, None, ids, mask, None, None, None, 3)
        assert probe_context.hold_back == 3 and probe_context.length == probe_context.prompt_length == 6
    with pytest.warns(DeprecationWarning, match="Request is deprecated"):
        request = pipeline.Request("s", "t", "m", ids, mask, tokenizer="tok")
    assert (request.mapper, request.tokenizer, request.same_weights) == ("m", "tok", False)
    with pytest.raises(TypeError, match="multiple values for argument 'target'"):
        RepairContext(None, target=None)
    with pytest.raises(TypeError):
        RequestContext(None)  # keywords only


def test_the_names_that_said_selector_still_resolve_with_a_deprecation():
    """ "Strategy" is the one word; each old public name is the same object for one release, and warns."""
    import hf_kvmap.repair as repair
    import hf_kvmap.repair.base as base

    old = {"SELECTORS": "STRATEGIES", "Selector": "Strategy", "TailSelector": "TailStrategy"}
    old.update(register_selector="register_strategy", selector_from_dict="strategy_from_dict")
    for module in (repair, base):
        for name, new in old.items():
            if hasattr(module, new):
                with pytest.warns(DeprecationWarning, match=f"{name} is deprecated .* 0.2: use .*{new}"):
                    assert getattr(module, name) is getattr(module, new)
    config = RepairConfig("tail", fraction=0.5)
    with pytest.warns(DeprecationWarning, match="RepairConfig.selector"):
        assert config.selector is config.strategy == STRATEGIES["tail"]()
    with pytest.raises(AttributeError, match="no attribute 'Selectors'"):
        repair.Selectors  # noqa: B018


def test_what_a_repair_did_is_the_mapped_caches_own_state_and_no_other_caches(pair, tiny):
    """A repair records itself on a `MappedCache` through its methods (read back as properties that cannot be set
    from outside); a plain cache is recomputed in place and given no attribute."""
    from transformers import DynamicCache

    source, target, mapper = pair
    ids = _prompt()
    cache = MappedCache.from_source(tiny.prefill(source, ids), mapper)
    assert cache.recomputed is None and cache.approximate is True
    counts = apply_repair(target, cache, ids, {"strategy": "tail", "tokens": 3})
    length = ids.shape[1] - 1
    assert cache.recomputed.nonzero()[:, 1].tolist() == list(range(length - 3, length)) and counts == [3]
    assert cache.mapping_info["repair"]["recomputed"] == [3] and cache.approximate is True
    for name in ("approximate", "recomputed", "mapping_info"):
        with pytest.raises(AttributeError):
            setattr(cache, name, None)
    with pytest.raises(ValueError, match="kept by the cache itself"):
        cache.record_step("repair", {})
    with pytest.raises(TypeError, match="bool tensor"):
        cache.record_recomputed(torch.ones(1, length))
    plain = DynamicCache()
    own = tiny.prefill(target, ids[:, :-1])
    for idx, layer in enumerate(own.layers):
        plain.update(layer.keys.clone(), layer.values.clone(), idx)
    apply_repair(target, plain, ids, {"strategy": "tail", "tokens": 3})
    assert not hasattr(plain, "recomputed") and not hasattr(plain, "mapping_info")
    assert _max_diff(plain, own) < TOL  # the target's own cache recomputed: the same keys and values


def test_handoff_repairs_and_reports_it(pair, tiny):
    source, target, mapper = pair
    ids = _prompt()
    cache, report = handoff(
        source, target, mapper, ids, probe="prefix_audit", threshold=1e9, repair=RepairConfig("tail", fraction=1.0)
    )
    assert report.accepted and report.reason.startswith("exact mapping") and report.repair["exact"]
    assert "repair" in report.timings
    assert torch.equal(tiny.greedy(target, ids, cache=cache), tiny.greedy(target, ids))
    _, report = handoff(
        source, target, mapper, ids, probe="prefix_audit", threshold=1e9, repair={"strategy": "tail", "tokens": 3}
    )
    assert report.repair["recomputed"] == [3] and not report.repair["exact"]
    with pytest.raises(ValueError, match="fraction=1.5"):  # never a silent fallback
        handoff(source, target, mapper, ids, probe="prefix_audit", threshold=1e9, repair={"fraction": 1.5})


@pytest.mark.parametrize(
    "kwargs,error,fragment",
    [
        ({"fraction": 1.5}, ValueError, "must be in \\[0, 1\\]"),
        ({"fraction": -0.1}, ValueError, "must be in \\[0, 1\\]"),
        ({"fraction": float("nan")}, ValueError, "must be in \\[0, 1\\]"),
        ({"fraction": True}, TypeError, "must be a number"),
        ({"fraction": "0.2"}, TypeError, "must be a number"),
        ({"tokens": -1}, ValueError, "non-negative integer"),
        ({}, ValueError, "exactly one budget"),
        ({"fraction": 0.1, "tokens": 3}, ValueError, "exactly one budget"),
        ({"strategy": "best", "fraction": 0.1}, ValueError, "Unknown repair strategy 'best'"),
        ({"strategy": {"name": "tail", "depth": 2}, "fraction": 0.1}, TypeError, "does not take these options"),
        ({"strategy": {"name": "mix", "components": {"mix": 1.0}}, "fraction": 0.1}, ValueError, "cannot contain"),
        ({"strategy": {"name": "mix", "components": {"tail": -1}}, "fraction": 0.1}, ValueError, "non-negative"),
        ({"strategy": {"name": "early_deviation", "layer": -1}, "fraction": 0.1}, ValueError, "layer=-1"),
        ({"strategy": {"name": "source_attention", "last_tokens": 0}, "fraction": 0.1}, ValueError, "last_tokens=0"),
        ({"strategy": {"name": "draft_attention", "draft_tokens": 0}, "fraction": 0.1}, ValueError, "draft_tokens=0"),
        ({"strategy": {"name": "draft_attention", "stop_at_eos": "yes"}, "fraction": 0.1}, ValueError, "stop_at_eos"),
        ({"strategy": {"name": "query_overlap", "min_share": 0}, "fraction": 0.1}, ValueError, "min_share=0"),
        ({"strategy": {"name": "query_overlap", "fill": "query_overlap"}, "fraction": 0.1}, ValueError, "itself"),
        ({"strategy": {"name": "query_overlap", "fill": "best"}, "fraction": 0.1}, ValueError, "Unknown repair"),
    ],
)
def test_bad_settings_are_refused(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        RepairConfig(**kwargs)


def test_bad_calls_are_refused(pair, tiny):
    source, target, mapper = pair
    ids = _prompt()
    cache, source_cache = _mapped(pair, tiny, ids)
    with pytest.raises(ValueError, match="needs the target model"):
        repair_cache(None, cache, ids, RepairConfig("tail", fraction=0.1))
    with pytest.raises(ValueError, match="reads the source model and its cache"):
        repair_cache(target, cache, ids, RepairConfig("source_attention", fraction=0.1))
    with pytest.raises(ValueError, match="pass the prompt the cache was built from"):
        repair_cache(target, cache, ids[:, :10], RepairConfig("tail", fraction=0.1))
    with pytest.raises(ValueError, match="left-padded 0/1 mask"):
        repair_cache(target, cache, ids, RepairConfig("tail", fraction=0.1), attention_mask=torch.full_like(ids, 2))
    with pytest.raises(ValueError, match="Unknown repair settings"):
        repair_cache(target, cache, ids, {"strategy": "tail", "share": 0.1})
    with pytest.raises(ValueError, match="layers but the target has"):
        repair_cache(_model(tiny.config(layers=2), 0, "eager"), cache, ids, RepairConfig("tail", fraction=0.1))
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="repair= needs the target"):
        MappedCache.from_source(source_cache, mapper, repair=RepairConfig("tail", fraction=0.1))


def test_an_attention_implementation_without_custom_masks_is_refused(pair, tiny):
    _, target, _ = pair
    ids = _prompt()
    cache, _ = _mapped(pair, tiny, ids)
    implementation = target.config._attn_implementation
    target.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            repair_cache(target, cache, ids, RepairConfig("tail", fraction=0.5))
    finally:
        target.config._attn_implementation = implementation


def test_a_session_repairs_what_it_maps(pair, tiny):
    from hf_kvmap import HandoffSession

    source, target, mapper = pair
    models, mappers = {"small": source, "large": target}, {("small", "large"): mapper}
    transcript = _prompt(tokens=14)
    session = HandoffSession(models, mappers, input_ids=transcript, repair=RepairConfig("tail", fraction=1.0))
    session.sync("small")  # the small model prefills the transcript; the large one maps it from there
    turn = session.sync("large")
    assert turn.mapped_tokens == turn.repaired_tokens == 13 and "repair" in turn.timings
    assert _max_diff(session.caches["large"], tiny.prefill(target, transcript[:, :-1])) < TOL
    partial = HandoffSession(models, mappers, input_ids=transcript, repair={"strategy": "tail", "tokens": 3})
    partial.sync("small")
    assert partial.sync("large").repaired_tokens == 3
    plain = HandoffSession(models, mappers, input_ids=transcript)
    plain.sync("small")
    plain.sync("large")
    expected = plain.caches["large"]
    expected.crop(-3)
    with torch.no_grad():
        target(input_ids=transcript[:, 10:13], **cache_kwargs(expected), use_cache=True)
    assert _max_diff(partial.caches["large"], expected) < TOL


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_repairs_a_session_turn_after_turn(pair, tiny, name):
    """Recomputing every newly mapped position, turn after turn, leaves the target's own cache of the transcript."""
    from hf_kvmap import HandoffSession

    source, target, mapper = pair
    transcript = _prompt(tokens=14)
    session = HandoffSession(
        {"small": source, "large": target},
        {("small", "large"): mapper},
        input_ids=transcript,
        repair=RepairConfig(_settings(name), fraction=1.0),
    )
    session.sync("small")
    assert session.sync("large").repaired_tokens == 13
    more = _prompt(tokens=6, seed=9)
    session.append(more)
    session.sync("small")
    assert session.sync("large").repaired_tokens == 6
    whole = torch.cat([transcript, more], dim=1)
    assert _max_diff(session.caches["large"], tiny.prefill(target, whole[:, :-1])) < TOL


def test_the_flop_bound_of_recomputing_everything_is_a_prefill(tiny):
    import importlib.util
    from pathlib import Path

    from hf_kvmap.flops import attention_flops, prefill_flops

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "repair" / "repair_cost.py"
    spec = importlib.util.spec_from_file_location("repair_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = tiny.config(layers=3)
    # causal attention with each position reading itself too: one extra key per query over prefill_flops' T**2 / 2
    extra = attention_flops(config, 1) * 40
    assert module.repair_flops(config, list(range(40))) == prefill_flops(config, 40) + extra
    assert module.repair_flops(config, []) == 0


def test_the_frontier_chooses_on_one_set_and_reports_on_the_other():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "repair" / "repair_frontier.py"
    spec = importlib.util.spec_from_file_location("repair_frontier", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def curve(**points):
        return {name: [{"fraction": f, "retention": r} for f, r in values] for name, values in points.items()}

    selection = {"repair": curve(tail=[(0.05, 0.9), (0.1, 0.97)], mix=[(0.05, 0.96), (0.1, 0.99)])}
    report = {"repair": curve(tail=[(0.05, 0.5), (0.1, 0.6)], mix=[(0.05, 0.93), (0.1, 0.98)])}
    chosen = module.choose(selection, report, goal=0.95, budget=0.1)
    assert chosen["cheapest_reaching_goal"] == {
        "strategy": "mix",
        "fraction": 0.05,
        "selection_retention": 0.96,
        "report_retention": 0.93,
    }
    assert chosen["best_within_budget"]["strategy"] == "mix" and chosen["best_within_budget"]["fraction"] == 0.1
    assert chosen["best_within_budget"]["report_meets_goal"] is True


def _real_task(task_type, chance, target, mapped, rows, items=8):
    """One task of a `benchmarks.repair.real_repair` result: `rows` maps a strategy to its `(fraction, value)` points."""
    import importlib

    real_repair = importlib.import_module("benchmarks.repair.real_repair")
    judged = "gap_closed" if task_type == "perplexity" else "retention"
    data = {"items": items, "task_type": task_type, "chance": chance, "target": target, "mapped": mapped}
    data["repair"] = {
        name: [{"fraction": f, "score": 0.0, judged: v, "seconds": 1.0} for f, v in points]
        for name, points in rows.items()
    }
    if task_type != "perplexity":
        data["mapped_retention"] = real_repair._retention(mapped, target, chance) if target > chance else None
    return data


def test_the_real_frontier_chooses_by_the_tasks_with_a_retention_and_renders_a_cut_run():
    """`benchmarks.repair.real_repair`: floor-normalized retention (none where the target does not beat chance), the share
    of the perplexity gap closed, a choice that reads only the tasks with a retention, and a page of a run cut before
    its report set was done."""
    import importlib

    real_repair = importlib.import_module("benchmarks.repair.real_repair")
    report = importlib.import_module("benchmarks.repair.repair_report")
    assert real_repair._retention(0.625, 1.0, 0.25) == 0.5 and real_repair._retention(0.3, 0.25, 0.25) is None
    assert real_repair._gap_closed(5.0, 4.0, 8.0) == 0.75 and real_repair._gap_closed(5.0, 4.0, 3.0) is None
    mix = RepairConfig(real_repair._strategy("mix:draft_attention+tail"), fraction=0.2).strategy
    assert [(type(c).__name__, w) for c, w in mix.components] == [
        ("DraftAttentionStrategy", 1.0),
        ("TailStrategy", 1.0),
    ]
    with pytest.raises(SystemExit, match="unknown repair strategy 'tale'"):
        real_repair._strategy("mix:draft_attention+tale")

    task = _real_task

    selection = {
        "retrieval": task(
            "exact_match", 0.0, 1.0, 0.0, {"draft": [(0.1, 0.8), (0.2, 1.0)], "tail": [(0.1, 0.9), (0.2, 0.9)]}
        ),
        "choice": task(
            "choice", 0.25, 0.2, 0.3, {"draft": [(0.1, None), (0.2, None)], "tail": [(0.1, None), (0.2, None)]}
        ),
        "ppl": task(
            "perplexity", None, 4.0, 6.0, {"draft": [(0.1, 0.1), (0.2, 0.2)], "tail": [(0.1, 0.0), (0.2, 0.0)]}
        ),
    }
    chosen = real_repair.choose(selection, goal=0.9)
    assert (chosen["strategy"], chosen["fraction"], chosen["reaches_goal"]) == ("tail", 0.1, True)
    result = {
        "run": {
            "direction": "0.5b:1.5b",
            "mapper": "/x/0.5b-to-1.5b/ridge-k8",
            "dtype": "float32",
            "goal": 0.9,
            "selection": {"seed": 1, "items": 8, "items_other": 8},
            "report": {"seed": 2, "items": 8, "items_other": 8, "fractions": [0.1]},
            "command": "python -m benchmarks.repair.real_repair --mapper /x/0.5b-to-1.5b/ridge-k8 --out /tmp/x.json",
        },
        "sets": {
            "selection": selection,
            "report": {"retrieval": task("exact_match", 0.0, 1.0, 0.0, {"tail": [(0.1, 0.95)]})},
        },
        "chosen_on_selection": chosen,
    }
    page = report.real_repair_markdown(result)
    assert "| retrieval (exact match) | 8 | 8/8 | 0/8 (0.00) | **0.95 (0/8)** |" in page
    assert "Not yet measured on the report set (the run resumes from its points): choice, ppl." in page
    assert "--out" not in page and "ppl (perplexity: gap closed)" in page


def test_two_maps_are_compared_on_the_same_items_only(tmp_path):
    """`benchmarks.repair.real_repair_maps`: each map's frontier for the strategy both runs measured, its chosen point and
    its report row; runs on other items are refused, not compared."""
    import importlib

    maps = importlib.import_module("benchmarks.repair.real_repair_maps")

    def run(mapper, fine_tunes, mapped, values, chosen, report_value):
        selection = {
            "retrieval": _real_task("exact_match", 0.0, 1.0, mapped, {"draft_attention": values, "tail": values}),
            "ppl": _real_task("perplexity", None, 4.0, 6.0, {"draft_attention": [(0.1, 0.5)], "tail": [(0.1, 0.4)]}),
        }
        report = {"retrieval": _real_task("exact_match", 0.0, 1.0, 0.0, {"draft_attention": [report_value]}, 200)}
        return {
            "run": {
                "direction": "0.5b:1.5b",
                "dtype": "float32",
                "goal": 0.9,
                "mapper": f"/w/0.5b-to-1.5b/{mapper}",
                "mapper_config": {"objective": "mse", "fine_tunes": fine_tunes, "calibration_positions": 8192},
                "selection": {"seed": 1, "items": 8, "items_other": 4},
                "report": {"seed": 2, "items": 200, "items_other": 4, "fractions": [chosen]},
            },
            "sets": {"selection": selection, "report": report},
            "chosen_on_selection": {
                "strategy": "draft_attention",
                "fraction": chosen,
                "selection_worst_retention": 0.95,
                "reaches_goal": True,
            },
            "chosen_reported": {"retrieval": report["retrieval"]["repair"]["draft_attention"][0]},
        }

    ridge = run("ridge-k8", [], 0.0, [(0.1, 0.5), (0.2, 1.0)], 0.2, (0.2, 0.99))
    tuned = run("ridge-k8-kl", ["kl"], 0.25, [(0.05, 0.9), (0.1, 1.0)], 0.05, (0.05, 0.97))
    page = maps.maps_markdown([ridge, tuned], ["a.json", "b.json"])
    assert maps.common_strategy([ridge, tuned]) == "draft_attention"
    assert "| map | mapped | 5 % | 10 % | 20 % |" in page
    assert (
        "| retrieval (exact match) | `0.5b-to-1.5b/ridge-k8` (8,192 calibration positions) | 0.00 | - | 0.50 | 1.00 |"
        in page
    )
    assert (
        "|  | `0.5b-to-1.5b/ridge-k8-kl` (fine-tuned: kl, 8,192 calibration positions) | 0.25 | 0.90 | 1.00 | - |"
        in page
    )
    assert (
        "- `0.5b-to-1.5b/ridge-k8-kl` (fine-tuned: kl, 8,192 calibration positions): `draft_attention` at 5 %" in page
    )
    assert (
        "| ppl (perplexity; the target: 4.000) | `0.5b-to-1.5b/ridge-k8` (8,192 calibration positions) | 6.000 | - |"
        in page
    )
    assert maps.map_label({"mapper": "/w/a/b", "mapper_config": {"objective": "kl"}}) == "`a/b` (fine-tuned: kl)"
    assert "| `ridge-k8` mapped | `ridge-k8` repaired | `ridge-k8-kl` mapped | `ridge-k8-kl` repaired |" in page
    assert "| 200 | 200/200 | 0/200 | 0.99 (0/200) at 20 % | 0/200 | 0.97 (0/200) at 5 % |" in page
    other = run("ridge-k8-kl", ["kl"], 0.25, [(0.05, 0.9)], 0.05, (0.05, 0.97))
    other["run"]["selection"]["items"] = 16
    with pytest.raises(ValueError, match="differ .*selection"):
        maps.maps_markdown([ridge, other], ["a.json", "b.json"])
    pytest.importorskip("matplotlib")
    maps.plot([ridge, tuned], str(tmp_path / "maps.png"))
    assert (tmp_path / "maps.png").stat().st_size > 0


def test_real_repair_records_the_fine_tunes_a_mapper_went_through():
    """A fine-tune leaves the mapper's `objective` as fitted and records itself in `config.calibration`
    (`<objective>_finetune`); the run reads the fine-tunes from there, in order, and a map label shows them."""
    import importlib
    import types

    real_repair = importlib.import_module("benchmarks.repair.real_repair")
    maps = importlib.import_module("benchmarks.repair.real_repair_maps")
    config = types.SimpleNamespace(calibration={"positions": 8192, "kl_finetune": {}, "attention_finetune": {}})
    assert real_repair.fine_tunes(config) == ["kl", "attention"]
    assert real_repair.fine_tunes(types.SimpleNamespace(calibration=None)) == []
    run = {"mapper": "/w/a/b", "mapper_config": {"objective": "mse", "fine_tunes": ["kl"], "calibration_positions": 8}}
    assert maps.map_label(run) == "`a/b` (fine-tuned: kl, 8 calibration positions)"


def test_real_repair_points_resume_only_under_their_setup_and_share_only_the_target(tmp_path):
    """A points file resumes only under the setup it was measured with (its keys do not say how many items or
    which mapper), and another mapper's run hands over its target-alone points and nothing else."""
    import importlib
    import json

    real_repair = importlib.import_module("benchmarks.repair.real_repair")
    setup = {
        "direction": "0.5b:1.5b",
        "mapper": "sha256:a",
        "dtype": "float32",
        "manifest": "m",
        "selection": [1, 8, 4],
    }
    first = real_repair.Points(tmp_path / "a.json", setup)
    measured = []

    def score(value):
        return lambda key: measured.append(key) or value  # a point is measured under its own key

    first.get("selection/chat/target", score(0.75))
    first.get("selection/chat/mapped", score(0.25))
    first.get("selection/chat/tail/0.1", score(0.5))
    first.get("selection/chat/target", score(0.0))  # kept: not measured again
    assert measured == ["selection/chat/target", "selection/chat/mapped", "selection/chat/tail/0.1"]
    assert first.data["selection/chat/target"]["score"] == 0.75
    assert real_repair.Points(tmp_path / "a.json", setup).data == first.data  # resumes: nothing measured again

    with pytest.raises(SystemExit, match=r"selection: \[1, 8, 4\] there, \[1, 16, 4\] here"):
        real_repair.Points(tmp_path / "a.json", {**setup, "selection": [1, 16, 4]})
    (tmp_path / "legacy.json").write_text(json.dumps({"selection/chat/target": {"score": 1.0, "seconds": 1.0}}))
    with pytest.raises(SystemExit, match="records no setup"):
        real_repair.Points(tmp_path / "legacy.json", setup)

    other = real_repair.Points(tmp_path / "b.json", {**setup, "mapper": "sha256:b"})
    assert other.adopt_targets(tmp_path / "a.json") == 1
    assert set(other.data) == {"selection/chat/target"} and other.data["selection/chat/target"]["score"] == 0.75
    assert json.loads((tmp_path / "b.json").read_text())["points"] == other.data  # written, so a resume keeps it
    with pytest.raises(SystemExit, match="dtype: 'float32' there, 'bfloat16' here"):
        real_repair.Points(tmp_path / "c.json", {**setup, "dtype": "bfloat16"}).adopt_targets(tmp_path / "a.json")


@pytest.mark.parametrize("script", ["repair_cost", "repair_frontier"])
def test_every_benchmarks_readme_repair_command_parses(script):
    """Each `repair_*.py` command in benchmarks/README.md is one the script accepts (the docs match the code)."""
    import importlib.util
    import re
    import shlex
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    spec = importlib.util.spec_from_file_location(script, benchmarks / "repair" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = (benchmarks / "README.md").read_text().replace("\\\n", " ")
    commands = re.findall(rf"^python benchmarks/repair/{script}\.py(.*)$", text, re.MULTILINE)
    assert len(commands) >= 2
    for command in commands:
        module.build_parser().parse_args(shlex.split(command, comments=True))


@pytest.mark.parametrize("module", ["repair.real_repair", "repair.real_repair_maps"])
def test_every_benchmarks_readme_real_repair_command_parses(module):
    """Each `python -m benchmarks.<module>` command in benchmarks/README.md is one the module accepts, strategies
    included (a `mix:a+b` too)."""
    import importlib
    import re
    import shlex
    from pathlib import Path

    script = importlib.import_module(f"benchmarks.{module}")
    text = (Path(__file__).resolve().parents[1] / "benchmarks" / "README.md").read_text().replace("\\\n", " ")
    commands = re.findall(rf"python -m benchmarks\.{module} (.*?)(?:`|$)", text, re.MULTILINE)
    assert commands
    for command in commands:
        args = script.build_parser().parse_args(shlex.split(command, comments=True))
        for name in getattr(args, "strategies", "").split(",") if module == "repair.real_repair" else []:
            RepairConfig(script._strategy(name), fraction=0.1)


def test_a_float32_mapped_cache_is_repaired_in_the_targets_dtype(tiny):
    config = tiny.config(layers=3)
    source, target = _model(config, 1, "sdpa"), _model(config, 0, "sdpa").to(torch.bfloat16)
    ids = _prompt()
    cache = MappedCache.from_source(tiny.prefill(source, ids), MapperModel.identity(config))
    assert cache.layers[0].keys.dtype == torch.float32
    repair_cache(target, cache, ids, RepairConfig("tail", fraction=1.0))
    own = tiny.prefill(target, ids[:, :-1])
    assert all(layer.keys.dtype == layer.values.dtype == torch.bfloat16 for layer in cache.layers)
    assert _max_diff(cache, own) == 0.0


def test_repair_attention_reads_the_own_cache_when_everything_is_recomputed(one_thread):
    """`benchmarks.repair.repair_attention`: recomputing every position gives the target's own reading of the continuation
    (the same NLL and the same attention on those positions), and the positions it reports repaired are the budget's;
    its summary splits the items by whether the repair raised the NLL."""
    import importlib

    from hf_kvmap import MapperModel, zoo
    from hf_kvmap.zoo import corpus

    bench = importlib.import_module("benchmarks.repair.repair_attention")
    source = zoo.load_model("tiny-m")
    target = zoo.load_model("tiny-l", attn_implementation="eager")
    mapper, tokenizer = MapperModel.from_pretrained(zoo.mapper_path("tiny-m", "tiny-l")), zoo.load_tokenizer()
    text = corpus.make_eval_set("text", 1, seed=4321, n_chars=120)[0].text
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    full = bench.measure_item(source, target, mapper, ids, RepairConfig("draft_attention", fraction=1.0))
    assert full["repaired"] == full["context"] == ids.shape[1] // 2 - 1
    assert full["nll_repaired"] == pytest.approx(full["nll_own"], abs=1e-4)
    assert full["mass_repaired"] == pytest.approx(full["mass_own"], abs=1e-4)
    assert 0 < full["mass_own"] < 1 and full["nll_mapped"] != pytest.approx(full["nll_own"], abs=1e-4)
    part = bench.measure_item(source, target, mapper, ids, RepairConfig("tail", fraction=0.2))
    assert part["repaired"] == math.floor(0.2 * part["context"]) > 0  # the budget: never more than asked
    rows = [
        {"fraction": 0.1, "nll_own": 1.0, "nll_mapped": 2.0, "nll_repaired": 3.0, **{f"mass_{c}": m for c, m in
         zip(bench.CACHES, (0.1, 0.3, 0.1))}},
        {"fraction": 0.1, "nll_own": 1.0, "nll_mapped": 2.0, "nll_repaired": 1.5, **{f"mass_{c}": 0.3 for c in
         bench.CACHES}},
    ]  # fmt: skip
    summary = bench.summary(rows)["0.1"]
    assert summary["items"] == 2 and summary["hurts"]["items"] == summary["helps"]["items"] == 1
    assert (summary["hurts"]["mass_mapped"], summary["hurts"]["mass_repaired"]) == (0.3, 0.1)
    run = {"command": "c", "direction": "d", "mapper": "m", "strategy": "s", "items": 2, "task": "t", "seed": 1,
           "dtype": "float32"}  # fmt: skip
    page = bench.markdown({"run": run, "summary": bench.summary(rows)})
    assert "| 10 % | 1.000 / 2.000 / 2.250 | 0.10 / 0.30 / 0.10 (1 items) | 0.30 / 0.30 / 0.30 (1 items) |" in page


def test_a_strategy_reads_from_its_text_the_one_way_every_front_end_writes_it():
    from hf_kvmap.repair.base import strategy_from_text
    from hf_kvmap.serving.rungs import parse_rung

    text = "query_overlap:fill=draft_branches,after=24"
    assert strategy_from_text(text) == {"name": "query_overlap", "fill": "draft_branches", "after": 24}
    assert strategy_from_dict(text).settings() == strategy_from_dict(strategy_from_text(text)).settings()
    assert long_switch_parse(text) == strategy_from_text(text)
    assert (
        parse_rung(f"repaired:{text}@0.1").handoff_kwargs["repair"].strategy.settings()["fill"]["name"]
        == "draft_branches"
    )
    with pytest.raises(ValueError, match="option 'after' is not key=value"):
        strategy_from_text("query_overlap:after")


def long_switch_parse(text):
    from benchmarks.switch.long_switch_args import parse_strategy

    return parse_strategy(text)
