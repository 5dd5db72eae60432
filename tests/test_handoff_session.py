"""HandoffSession: only new tokens are mapped at each switch, windows read their earlier positions, and an exact
mapping reproduces each model's own prefill over many switches."""

from __future__ import annotations

import pytest
import torch

from hf_kvmap import HandoffSession, MappedCache, MapperModel, zoo
from hf_kvmap._compat import output_cache
from hf_kvmap.repair import RepairConfig
from hf_kvmap.serving.ladder import GuardLadder, LadderRung
from hf_kvmap.zoo import corpus


def _turns(tokenizer, exchanges: int, seed: int = 0):
    conversation = corpus.make_conversation(exchanges, seed=seed)
    for index in range(exchanges):
        text = corpus.format_chat([conversation[2 * index]], add_generation_prompt=True)
        yield tokenizer(text, add_special_tokens=index == 0)["input_ids"]


@pytest.mark.parametrize("window", [0, 3])
def test_exact_mapping_session_equals_own_prefill_over_switches(window, one_thread):
    """Two names for one model with (windowed) identity mappers: every turn equals the model's own generation."""
    tokenizer = zoo.load_tokenizer()
    model = zoo.load_model("tiny-m")
    identity = MapperModel.identity(model.config, context_window=window, input_kinds="both" if window else "same")
    session = HandoffSession({"a": model, "b": model}, {("a", "b"): identity, ("b", "a"): identity})
    end = tokenizer.convert_tokens_to_ids(corpus.END)
    for index, user in enumerate(_turns(tokenizer, 6)):
        session.append(user)
        before = session.input_ids.clone()
        turn = session.respond("ab"[index % 2], 12, eos_token_id=end, pad_token_id=0)
        own = model.generate(before, max_new_tokens=12, do_sample=False, eos_token_id=end, pad_token_id=0)
        assert turn.tokens == own[0, before.shape[1] :].tolist()
        if index:
            # only the tokens the other model processed since this one's last turn are mapped
            assert turn.mapped_from == "ba"[index % 2]
            previous = session.turns[index - 1]
            assert turn.mapped_tokens == previous.prefilled_tokens + len(previous.tokens)
            assert turn.window_tokens == (0 if index == 1 else window)
        for name in "ab":
            assert session.covered(name) < session.input_ids.shape[1]
    assert len(session.turns) == 6  # 5 switches


def test_incremental_window_mapping_equals_whole_prompt_mapping(one_thread):
    """The shipped windowed s->l mapper applied to the new tokens only (with its window read along) gives the same
    keys/values as mapping the whole transcript at once."""
    source, target = zoo.load_model("tiny-s"), zoo.load_model("tiny-l")
    mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-s", "tiny-l")).float()
    assert mapper.config.context_window == 0 and mapper.config.max_context_window == 3  # a window on one map only
    session = HandoffSession({"s": source, "l": target}, {("s", "l"): mapper})
    tokenizer = zoo.load_tokenizer()
    end = tokenizer.convert_tokens_to_ids(corpus.END)
    turns = list(_turns(tokenizer, 3, seed=4))
    session.append(turns[0])
    session.respond("s", 8, eos_token_id=end, pad_token_id=0)
    session.append(turns[1])
    session.respond("l", 8, eos_token_id=end, pad_token_id=0)  # maps s's first turn
    session.append(turns[2])
    session.respond("s", 8, eos_token_id=end, pad_token_id=0)
    session.append(turns[0])
    session.sync("l")  # maps s's second turn onto l's own tokens
    first_start = 0
    first_end = session.turns[1].mapped_tokens
    second_start = session.turns[1].mapped_tokens + session.turns[1].prefilled_tokens + len(session.turns[1].tokens)
    source_cache = session.caches["s"]
    whole = MappedCache.from_source(source_cache, mapper, hold_back=1)
    target_cache = session.caches["l"]
    second_end = source_cache.get_seq_length() - 1
    assert second_end > second_start
    for mine, reference in zip(target_cache.layers, whole.layers):
        for span in ((first_start, first_end), (second_start, second_end)):
            torch.testing.assert_close(
                mine.keys[:, :, span[0] : span[1]], reference.keys[:, :, span[0] : span[1]], rtol=1e-4, atol=1e-4
            )
            torch.testing.assert_close(
                mine.values[:, :, span[0] : span[1]], reference.values[:, :, span[0] : span[1]], rtol=1e-4, atol=1e-4
            )


def test_direction_without_mapper_prefills_and_matches_own(tiny, one_thread):
    config = tiny.config()
    small, large = tiny.model(config, seed=0), tiny.model(config, seed=1)
    session = HandoffSession({"small": small, "large": large})
    session.append(torch.randint(3, 128, (10,), generator=torch.Generator().manual_seed(0)))
    session.respond("small", 4, pad_token_id=0)
    session.append([5, 6, 7])
    before = session.input_ids.clone()
    turn = session.respond("large", 4, pad_token_id=0)
    assert turn.mapped_from is None and turn.mapped_tokens == 0
    assert turn.prefilled_tokens == before.shape[1] - 1
    own = large.generate(before, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert turn.tokens == own[0, before.shape[1] :].tolist()


def test_bad_session_input_is_refused(tiny):
    config = tiny.config()
    model = tiny.model(config)
    with pytest.raises(ValueError, match="at least one model"):
        HandoffSession({})
    with pytest.raises(ValueError, match="not one of"):
        HandoffSession({"a": model}, {("a", "b"): MapperModel.identity(config)})
    session = HandoffSession({"a": model})
    with pytest.raises(ValueError, match="empty"):
        session.respond("a", 2)
    with pytest.raises(ValueError, match="Unknown model"):
        session.sync("z")


def _ladder_session(tiny, seed=0, **kwargs):
    """small answers a first turn, a user turn follows, and large takes over: it maps small's tokens."""
    config = tiny.config()
    small, large = tiny.model(config, seed=0), tiny.model(config, seed=1)
    session = HandoffSession(
        {"small": small, "large": large}, {("small", "large"): MapperModel.identity(config)}, **kwargs
    )
    session.append(torch.randint(3, 128, (14,), generator=torch.Generator().manual_seed(seed)))
    session.respond("small", 4, pad_token_id=0)
    session.append([5, 6, 7])
    return session, large


def _caches_close(first, second, atol=1e-5):
    for a, b in zip(first.layers, second.layers):
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=atol)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=atol)


LOOKAHEAD = {"name": "lookahead_margin", "tokens": 2}


def test_a_session_ladder_falls_back_to_the_models_own_prefill(tiny, one_thread):
    """Risk above every rung: large prefills what it would have mapped, and answers as it would alone."""
    session, large = _ladder_session(tiny, ladder=GuardLadder(LOOKAHEAD, "tail", []))
    before = session.input_ids.clone()
    turn = session.respond("large", 4, pad_token_id=0)
    own = large.generate(before, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert turn.rung == "fallback" and 0.0 <= turn.risk <= 1.0 and "fallback" in turn.timings
    assert turn.tokens == own[0, before.shape[1] :].tolist()
    assert turn.prefilled_tokens == before.shape[1] - 1
    assert session.caches["large"].approximate is False
    assert session.caches["large"].mapping_info["mapped_positions"] == []


def test_a_session_ladder_keeps_or_repairs_as_the_fixed_settings_do(tiny, one_thread):
    """The mapped rung is the session without a ladder; a repairing rung is the session with that fixed repair."""
    for rungs, fixed in (([LadderRung(2.0, 0.0)], None), ([LadderRung(2.0, 0.5)], RepairConfig("tail", fraction=0.5))):
        laddered, _ = _ladder_session(tiny, ladder=GuardLadder(LOOKAHEAD, "tail", rungs))
        plain, _ = _ladder_session(tiny, repair=fixed)
        turn = laddered.respond("large", 4, pad_token_id=0)
        reference = plain.respond("large", 4, pad_token_id=0)
        assert turn.rung == ("mapped" if fixed is None else "repair:0.5")
        assert turn.tokens == reference.tokens and turn.repaired_tokens == reference.repaired_tokens
        assert turn.mapped_tokens == reference.mapped_tokens > 0
        _caches_close(laddered.caches["large"], plain.caches["large"])
        assert laddered.caches["large"].approximate is True


def test_a_session_ladder_checks_the_cache_its_rung_served(tiny, one_thread):
    """With `min_margin` 0 the rung stands (the session without a check), and the switch records the answering
    model's margin on its first answer token; a `min_margin` above that margin sends the switch back: large prefills
    what it had mapped and answers as it would alone."""
    rungs = [LadderRung(2.0, 0.5)]
    plain, _ = _ladder_session(tiny, ladder=GuardLadder(LOOKAHEAD, "tail", rungs))
    kept, _ = _ladder_session(tiny, ladder=GuardLadder(LOOKAHEAD, "tail", rungs, min_margin=0.0))
    reference, turn = plain.respond("large", 4, pad_token_id=0), kept.respond("large", 4, pad_token_id=0)
    assert turn.rung == "repair:0.5" and turn.checked is None and "check" in turn.timings
    assert turn.tokens == reference.tokens and reference.margin is None
    top = torch.softmax(turn.first_logits, -1).topk(2).values
    assert turn.margin == pytest.approx(float(top[0] - top[1]), abs=1e-5) and turn.margin < 1.0
    _caches_close(kept.caches["large"], plain.caches["large"])
    sent, large = _ladder_session(tiny, ladder=GuardLadder(LOOKAHEAD, "tail", rungs, min_margin=turn.margin + 1e-4))
    before = sent.input_ids.clone()
    turn = sent.respond("large", 4, pad_token_id=0)
    own = large.generate(before, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert turn.rung == "fallback" and turn.checked == "repair:0.5" and "fallback" in turn.timings
    assert turn.tokens == own[0, before.shape[1] :].tolist()
    assert turn.prefilled_tokens == before.shape[1] - 1
    assert sent.caches["large"].approximate is False and sent.caches["large"].mapping_info["mapped_positions"] == []


def test_a_session_ladder_checks_as_many_answer_tokens_as_it_is_told(tiny, one_thread):
    """`check_tokens=4`: the switch's margin is the smallest over the first four answer tokens (never above the first
    token's), and a `min_margin` between the two sends back the switch that a first-token check would keep."""
    rungs = [LadderRung(2.0, 0.5)]
    one, _ = _ladder_session(tiny, seed=1, ladder=GuardLadder(LOOKAHEAD, "tail", rungs, min_margin=0.0))
    four, _ = _ladder_session(
        tiny, seed=1, ladder=GuardLadder(LOOKAHEAD, "tail", rungs, min_margin=0.0, check_tokens=4)
    )
    first, over = one.respond("large", 4, pad_token_id=0), four.respond("large", 4, pad_token_id=0)
    assert over.tokens == first.tokens and over.rung == first.rung == "repair:0.5"
    assert over.margin < first.margin  # on this session a later answer token is taken less surely than the first
    between = (over.margin + first.margin) / 2
    for tokens, sent_back in ((1, False), (4, True)):
        session, _ = _ladder_session(
            tiny, seed=1, ladder=GuardLadder(LOOKAHEAD, "tail", rungs, min_margin=between, check_tokens=tokens)
        )
        turn = session.respond("large", 4, pad_token_id=0)
        assert (turn.rung == "fallback") == sent_back and (turn.checked == "repair:0.5") == sent_back


def test_a_session_ladder_is_refused_where_it_cannot_run(tiny):
    config = tiny.config()
    model = tiny.model(config)
    with pytest.raises(ValueError, match="not both"):
        HandoffSession(
            {"a": model}, ladder=GuardLadder(LOOKAHEAD, "tail", []), repair=RepairConfig("tail", fraction=0.1)
        )
    with pytest.raises(ValueError, match="cannot use probe 'draft_agreement'"):
        HandoffSession({"a": model}, ladder=GuardLadder({"name": "draft_agreement", "tokens": 2}, "tail", []))


def test_a_session_refreshes_only_the_mapped_positions_while_it_decodes(tiny, one_thread):
    """`respond(refresh=...)`: the model recomputes mapped positions of its cache while it decodes, never one it
    computed itself; on its own cache (nothing mapped) there is nothing to refresh and it answers as without."""
    plain, _ = _ladder_session(tiny, seed=1)
    fresh, _ = _ladder_session(tiny, seed=1)
    first, refreshed = (
        plain.respond("large", 6, pad_token_id=0),
        fresh.respond("large", 6, pad_token_id=0, refresh={"every": 2, "tokens": 3}),
    )
    assert first.refresh is None and refreshed.mapped_tokens == first.mapped_tokens > 0
    spans = fresh.caches["large"].mapping_info["mapped_positions"]
    mapped = torch.zeros(fresh.input_ids.shape[1], dtype=torch.bool)
    for start, end in spans:
        mapped[start:end] = True
    assert refreshed.refresh["refreshes"] == 3 and refreshed.refresh["recomputed"] == [min(9, int(mapped.sum()))]
    assert "refresh" in refreshed.timings
    # the tokens large computed itself hold the keys/values of the session without refreshes; of the mapped ones,
    # exactly those the refreshes recomputed changed
    upto = mapped.shape[0] - len(refreshed.tokens)  # the prompt large took over, before its answer
    changed = torch.zeros(upto, dtype=torch.bool)
    for a, b in zip(fresh.caches["large"].layers, plain.caches["large"].layers):
        differs = (a.keys[0, :, :upto] - b.keys[0, :, :upto]).abs().amax(dim=(0, 2)) > 0
        changed |= differs
    assert not changed[~mapped[:upto]].any()
    assert int(changed.sum()) == refreshed.refresh["recomputed"][0]
    # with nothing mapped (a model answering on its own cache) the refresh has nothing to do
    alone = HandoffSession({"large": plain.models["large"]}, input_ids=plain.input_ids.clone())
    again = HandoffSession({"large": plain.models["large"]}, input_ids=plain.input_ids.clone())
    mine = alone.respond("large", 4, pad_token_id=0, refresh={"every": 1, "tokens": 2})
    assert mine.refresh is None and mine.tokens == again.respond("large", 4, pad_token_id=0).tokens
    with pytest.raises(TypeError, match="refresh= takes the settings of a DecodeRefresh"):
        fresh.respond("large", 2, pad_token_id=0, refresh=16)


def test_a_span_is_checked_and_recorded_as_from_source_is(tiny, one_thread):
    """`MappedCache.from_source_span`: the span equals the same positions of a whole-prompt mapping (windowed identity
    mapper), appended after the target's own positions; the provenance records the span and its window; a bad span,
    a target cache of another length and a source holding NaN in the positions read are refused by name."""
    config = tiny.config()
    model = tiny.model(config, seed=0)
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    source = output_cache(model(ids, use_cache=True))
    identity = MapperModel.identity(config, context_window=3, input_kinds="both")
    own = output_cache(model(ids[:, :9], use_cache=True))
    cache = MappedCache.from_source_span(source, identity, 9, 14, onto=own, label="a")
    whole = MappedCache.from_source(source, identity, hold_back=2)
    assert isinstance(cache, MappedCache) and cache.get_seq_length() == 14
    for mine, reference, theirs in zip(cache.layers, whole.layers, own.layers):
        torch.testing.assert_close(mine.keys[:, :, 9:14], reference.keys[:, :, 9:14], rtol=0, atol=1e-5)
        assert torch.equal(mine.keys[:, :, :9], theirs.keys)  # the own positions, as they were
    info = cache.mapping_info
    assert info["mapped_positions"] == [[9, 14]] and info["mapped_tokens"] == 5 and cache.approximate is True
    assert info["mappers"][0]["from"] == "a" and info["mappers"][0]["window"] == 3
    cache.crop(-5)
    cache.drop_last_span()
    assert cache.approximate is False and info["mapped_tokens"] == 0
    with pytest.raises(ValueError, match=r"0 <= start < end <= 16"):
        MappedCache.from_source_span(source, identity, 9, 17, onto=own)
    with pytest.raises(ValueError, match="holds 9 positions but the span starts at 8"):
        MappedCache.from_source_span(source, identity, 8, 12, onto=own)
    poisoned = [(layer.keys.clone(), layer.values.clone()) for layer in source.layers]
    poisoned[1][0][0, 0, 7, 0] = float("nan")  # inside the window read along before position 9
    with pytest.raises(ValueError, match="(?i)nan|finite"):
        MappedCache.from_source_span(poisoned, identity, 9, 12, onto=own)
    poisoned[1][0][0, 0, 7, 0] = 0.0
    poisoned[1][0][0, 0, 2, 0] = float("inf")  # before the window: never read
    assert MappedCache.from_source_span(poisoned, identity, 9, 12, onto=own).get_seq_length() == 12


def test_a_span_is_served_from_the_one_request_context_of_one_row_with_its_span(tiny):
    """`serving.spans.serve_span` takes the pipeline's `RequestContext` (no request record of its own): one row with
    `span_start` set, and refuses anything else by name before any model runs."""
    from hf_kvmap.request_context import RequestContext
    from hf_kvmap.serving.spans import serve_span

    ids = torch.tensor([[5, 6, 7, 8]])
    for context in (
        RequestContext(input_ids=ids),  # no span
        RequestContext(input_ids=ids.repeat(2, 1), span_start=0),  # two rows
        RequestContext(span_start=0),  # no transcript
    ):
        with pytest.raises(ValueError, match="one row with its span_start set"):
            serve_span(context)
