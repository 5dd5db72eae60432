"""The sparse prefill (the map-free rung): prefilling every position is the target's own cache; a subset equals a full
forward that masks the unselected positions out, at the original positions, through `generate` too; a repair and a
sparse prefill given one selection recompute the same positions; bad input is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_kvmap import MappedCache, MapperModel
from hf_kvmap._compat import cache_kwargs, output_cache
from hf_kvmap.repair import RepairConfig, SparseCache, repair_cache, select_repair, sparse_prefill

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["eager", "sdpa"])
def models(request, tiny):
    config = tiny.config(layers=3)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config, attn_implementation=request.param).eval()
    torch.manual_seed(1)
    source = AutoModelForCausalLM.from_config(config, attn_implementation=request.param).eval()
    with torch.no_grad():
        for model in (source, target):
            model.get_output_embeddings().weight.mul_(20.0)
    return source, target, MapperModel.identity(config)


def _prompt(tokens=24, seed=3):
    return torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _masked_logits(target, ids, keep: torch.Tensor) -> torch.Tensor:
    """The target's logits of the last token when every position outside `keep` (bool over the prompt) is invisible to
    every query: a full forward at the original positions with a 4-D boolean mask (the sparse prefill's definition)."""
    length = ids.shape[1]
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    allowed = causal & keep[None, :]
    allowed |= torch.eye(length, dtype=torch.bool)  # a dropped query reads itself only; nothing reads it
    mask = allowed[None, None]
    if target.config._attn_implementation == "eager":
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    return target(input_ids=ids, attention_mask=mask, position_ids=torch.arange(length)[None]).logits[0, -1]


def test_prefilling_every_position_is_the_targets_own_cache(models):
    _, target, _ = models
    ids = _prompt()
    cache = sparse_prefill(target, ids, torch.arange(ids.shape[1] - 1), length=ids.shape[1] - 1)
    own = output_cache(target(input_ids=ids[:, :-1], use_cache=True))
    assert isinstance(cache, SparseCache) and cache.approximate
    assert cache.get_seq_length() == ids.shape[1] - 1
    for mine, theirs in zip(cache.layers, own.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=1e-5)
    served = target.generate(ids, **cache_kwargs(cache), max_new_tokens=6, do_sample=False)
    plain = target.generate(ids, max_new_tokens=6, do_sample=False)
    assert served.tolist() == plain.tolist()


@pytest.mark.parametrize("picked", [[0, 3, 4, 9, 15, 20], [5, 6, 7], [22]])
def test_a_subset_equals_a_forward_that_masks_the_rest_out(models, picked):
    _, target, _ = models
    ids = _prompt()
    length = ids.shape[1] - 1
    cache = sparse_prefill(target, ids, torch.tensor(picked), length=length)
    assert cache.get_seq_length() == length and cache.layers[0].keys.shape[2] == len(picked)
    logits = target(input_ids=ids[:, length:], use_cache=True, **cache_kwargs(cache)).logits[0, -1]
    keep = torch.zeros(ids.shape[1], dtype=torch.bool)
    keep[picked] = True
    keep[length:] = True
    torch.testing.assert_close(logits, _masked_logits(target, ids, keep), rtol=0, atol=1e-4)
    assert cache.get_seq_length() == ids.shape[1]  # the held-back token appended after the prompt's positions


def test_generate_reads_the_sparse_cache_at_the_original_positions(models):
    """Every greedy step equals the masked full forward of the prompt plus the tokens generated so far."""
    _, target, _ = models
    ids = _prompt(tokens=20, seed=5)
    picked = torch.tensor([1, 2, 8, 12, 13, 17])
    cache = sparse_prefill(target, ids, picked, length=ids.shape[1] - 1)
    out = target.generate(ids, **cache_kwargs(cache), max_new_tokens=5, do_sample=False)
    sequence = ids
    for _ in range(5):
        keep = torch.zeros(sequence.shape[1], dtype=torch.bool)
        keep[picked] = True
        keep[ids.shape[1] - 1 :] = True
        token = _masked_logits(target, sequence, keep).argmax()
        sequence = torch.cat([sequence, token.view(1, 1)], dim=1)
    assert out.tolist() == sequence.tolist()


@pytest.mark.parametrize("strategy", ["tail", {"name": "draft_attention", "draft_tokens": 4}])
def test_a_repair_and_a_sparse_prefill_share_one_selection(models, strategy):
    source, target, mapper = models
    ids = _prompt()
    length = ids.shape[1] - 1
    source_cache = output_cache(source(input_ids=ids, use_cache=True))
    repair = RepairConfig(strategy, fraction=0.25)
    positions, valid = select_repair(target, ids, repair, length=length, source=source, source_cache=source_cache)
    assert valid.all() and positions.shape == (1, length // 4)
    repaired = repair_cache(
        target,
        MappedCache.from_source(source_cache, mapper),
        ids,
        repair,
        source=source,
        source_cache=source_cache,
    )
    again = repair_cache(
        target,
        MappedCache.from_source(source_cache, mapper),
        ids,
        repair,
        selection=(positions, valid),
    )
    assert repaired.recomputed.nonzero()[:, 1].tolist() == positions[0].tolist()
    for first, second in zip(repaired.layers, again.layers):
        assert torch.equal(first.keys, second.keys) and torch.equal(first.values, second.values)
    sparse = sparse_prefill(target, ids, positions[0], length=length)
    assert sparse.sparse_info == {
        "length": length,
        "selected": length // 4,
        "fraction": (length // 4) / length,
        "positions": positions[0].tolist(),
    }


def test_a_sparse_cache_refuses_a_crop_into_the_positions_it_never_computed(models):
    _, target, _ = models
    ids = _prompt()
    cache = sparse_prefill(target, ids, torch.tensor([2, 5]), length=ids.shape[1] - 1)
    cache.crop(-1)
    assert cache.get_seq_length() == ids.shape[1] - 2
    with pytest.raises(ValueError, match="never computed"):
        cache.crop(-5)


@pytest.mark.parametrize(
    "positions, length, match",
    [
        (torch.tensor([3, 2]), 10, "ascending"),
        (torch.tensor([1, 1]), 10, "ascending"),
        (torch.tensor([0, 10]), 10, r"\[0, 10\)"),
        (torch.tensor([], dtype=torch.long), 10, "at least one"),
        (torch.tensor([1.0]), 10, "integer tensor"),
        (torch.tensor([1]), 0, "length=0"),
    ],
)
def test_bad_selections_are_refused(models, positions, length, match):
    _, target, _ = models
    with pytest.raises((ValueError, TypeError), match=match):
        sparse_prefill(target, _prompt(), positions, length=length)


def test_a_batch_is_refused_with_the_fix(models):
    _, target, _ = models
    with pytest.raises(ValueError, match="one row"):
        sparse_prefill(target, torch.randint(3, 100, (2, 12)), torch.tensor([1, 2]), length=11)


# ------------------------------------------------------------------------------------------ the ladder's sparse rung
def _single(pair_models, tokens=22, seed=7, hold_back=1):
    from hf_kvmap.serving.pipeline import prepare_context

    source, target, mapper = pair_models
    ids = _prompt(tokens, seed)
    return prepare_context(source, target, mapper, ids, torch.ones_like(ids), None, hold_back)


@pytest.mark.parametrize("hold_back", [1, 3])
def test_a_one_row_request_on_a_sparse_rung_is_served_the_sparse_prefill(models, hold_back):
    from hf_kvmap.serving.pipeline import serve_rows

    source, target, _ = models
    context = _single(models, hold_back=hold_back)
    ids = context.input_ids
    rows = serve_rows(context, [0.25], "tail", [True])
    mapped = ids.shape[1] - hold_back
    count = int(0.25 * mapped)
    assert rows == [{"rung": "sparse:0.25", "fraction": 0.25, "recomputed": count}]
    assert isinstance(context.cache, SparseCache) and context.cache.get_seq_length() == ids.shape[1] - 1
    alone = sparse_prefill(target, ids, torch.arange(mapped - count, mapped), length=mapped)
    served = target.generate(ids, **cache_kwargs(context.cache), max_new_tokens=5, do_sample=False)
    if hold_back > 1:  # the held-back tokens but the last run on the sparse prefill before the last one
        target(input_ids=ids[:, mapped:-1], use_cache=True, **cache_kwargs(alone))
    assert served.tolist() == target.generate(ids, **cache_kwargs(alone), max_new_tokens=5, do_sample=False).tolist()


def test_a_batch_serves_its_sparse_rows_as_repairs_and_says_so(models, tiny):
    from hf_kvmap.serving.pipeline import prepare_context, serve_rows

    source, target, mapper = models
    ids, mask = tiny.left_padded_batch((20, 24), seed=5)
    context = prepare_context(source, target, mapper, ids, mask, None, 1)
    rows = serve_rows(context, [0.25, 0.0], "tail", [True, False])
    assert [row["rung"] for row in rows] == ["repair:0.25", "mapped"]
    assert rows[0]["sparse_as_repair"] is True and "sparse_as_repair" not in rows[1]
    again = prepare_context(source, target, mapper, ids, mask, None, 1)
    serve_rows(again, [0.25, 0.0], "tail")
    for mine, theirs in zip(context.cache.layers, again.cache.layers):
        assert torch.equal(mine.keys, theirs.keys)


def test_the_ladder_takes_sparse_rungs_below_a_repair_of_their_fraction():
    from hf_kvmap.serving.ladder import GuardLadder, LadderRung

    probe = {"name": "prefix_audit", "tokens": 8}
    ladder = GuardLadder(probe, "tail", [{"max_risk": 0.1, "fraction": 0.1, "sparse": True}, LadderRung(0.5, 0.1)])
    assert [ladder.rung_for(r).sparse for r in (0.05, 0.3)] == [True, False] and ladder.rung_for(0.9) is None
    assert ladder.sparse_plan([0.05, 0.3, 0.9]) == [True, False, False]
    assert GuardLadder.from_dict(ladder.to_dict()) == ladder
    assert "sparse" not in GuardLadder(probe, "tail", [LadderRung(0.5, 0.1)]).to_dict()["rungs"][0]  # hashes hold
    with pytest.raises(ValueError, match="a sparse rung may come before a repair"):
        GuardLadder(probe, "tail", [LadderRung(0.1, 0.1), LadderRung(0.5, 0.1, sparse=True)])
    with pytest.raises(ValueError, match="fraction in \\(0, 1\\)"):
        LadderRung(0.1, 0.0, sparse=True)
    with pytest.raises(TypeError, match="True or False"):
        LadderRung(0.1, 0.1, sparse="yes")


def test_handoff_serves_a_sparse_rung_and_falls_back_whole_when_its_check_refuses(models):
    from hf_kvmap import handoff
    from hf_kvmap.serving.ladder import GuardLadder, LadderRung

    source, target, mapper = models
    ids = _prompt(22, 7)
    probe = {"name": "prefix_audit", "tokens": 8}
    ladder = GuardLadder(probe, "tail", [LadderRung(1e9, 0.25, sparse=True)])
    cache, report = handoff(source, target, mapper, ids, ladder=ladder, audit_tokens=0)
    assert report.accepted and isinstance(cache, SparseCache)
    assert report.ladder["rows"][0]["rung"] == "sparse:0.25"
    checked = GuardLadder(probe, "tail", [LadderRung(1e9, 0.25, sparse=True)], min_margin=1.0)  # refuses any row
    cache, report = handoff(source, target, mapper, ids, ladder=checked, audit_tokens=0)
    row = report.ladder["rows"][0]
    assert (row["rung"], row["checked"]) == ("fallback", "sparse:0.25") and not isinstance(cache, SparseCache)
    plain = target.generate(ids, max_new_tokens=5, do_sample=False)
    assert target.generate(ids, **cache_kwargs(cache), max_new_tokens=5, do_sample=False).tolist() == plain.tolist()


def test_the_sparse_rung_named_in_one_word_serves_the_sparse_prefill(models):
    from hf_kvmap.serving.rungs import parse_rung

    source, target, mapper = models
    ids = _prompt(22, 7)
    cache, report = parse_rung("sparse:tail@0.25").serve(source, target, mapper, ids)
    assert isinstance(cache, SparseCache) and report["ladder"]["rows"][0]["rung"] == "sparse:0.25"
    length = ids.shape[1] - 1
    alone = sparse_prefill(target, ids, torch.arange(length - length // 4, length), length=length)
    expected = target.generate(ids, **cache_kwargs(alone), max_new_tokens=4, do_sample=False)
    assert target.generate(ids, **cache_kwargs(cache), max_new_tokens=4, do_sample=False).tolist() == expected.tolist()
