"""The shipped tiny family: corpus, tokenizer, weights and geometry (CPU, fast)."""

from __future__ import annotations

import pytest

from hf_kvmap import zoo
from hf_kvmap.zoo import corpus

# --------------------------------------------------------------------------------------------- corpus


def test_corpus_deterministic():
    assert corpus.training_documents(20, seed=3) == corpus.training_documents(20, seed=3)
    assert corpus.training_documents(20, seed=3) != corpus.training_documents(20, seed=4)
    # any slice of the stream equals the same slice of the full stream (resumable training)
    assert corpus.training_documents(5, seed=3, start=10) == corpus.training_documents(15, seed=3)[10:]
    assert corpus.training_text(10, seed=1) == corpus.training_text(10, seed=1)
    assert corpus.calibration_text(4, seed=2) == corpus.calibration_text(4, seed=2)
    for task in corpus.TASKS:
        assert corpus.make_eval_set(task, 8, seed=5) == corpus.make_eval_set(task, 8, seed=5)
        assert corpus.make_eval_set(task, 8, seed=5) != corpus.make_eval_set(task, 8, seed=6)
    assert corpus.make_conversation(6, seed=1) == corpus.make_conversation(6, seed=1)


def test_corpus_alphabet_and_streams():
    text = corpus.training_text(300, seed=0) + "".join(corpus.calibration_text(8))
    for marker in corpus.CHAT_MARKERS:
        text = text.replace(marker, "")
    assert set(text) <= set(corpus.ALPHABET)
    # eval items are not drawn from the training stream
    train = corpus.training_text(300, seed=0)
    contexts = [it.context for it in corpus.make_eval_set("recall", 20, seed=0)]
    assert not any(c in train for c in contexts)


def test_eval_items_well_formed():
    for it in corpus.make_eval_set("recall", 50, seed=0):
        assert isinstance(it, corpus.RecallItem)
        assert it.context.endswith(f"?{it.key}")
        assert f"\n{it.key}{it.answer}" in "\n" + it.context  # the fact is stated in the context
        assert len(it.answer) == 3 and it.answer.isdigit()
    for it in corpus.make_eval_set("arithmetic", 50, seed=0):
        a, b = it.prompt.rsplit("\n", 1)[-1].rstrip("=").split("+")
        assert int(it.answer) == int(a) + int(b)
    for it in corpus.make_eval_set("choice", 50, seed=0):
        assert len(it.choices) == 4 and len(set(it.choices)) == 4
        assert 0 <= it.label < 4
        assert it.choices[it.label].strip(" .") in it.context
    for it in corpus.make_eval_set("chat", 20, seed=0):
        assert it.context.startswith(corpus.USER) and it.context.endswith(corpus.ASSISTANT)
        assert corpus.format_chat(it.turns, add_generation_prompt=True) == it.context
    for it in corpus.make_eval_set("text", 5, seed=0):
        assert len(it.text) > 100
    with pytest.raises(ValueError):
        corpus.make_eval_set("nope", 1)


# ------------------------------------------------------------------------------------------ tokenizer


def test_tokenizer_round_trip_and_padding():
    tok = zoo.load_tokenizer()
    texts = corpus.training_documents(40, seed=0) + corpus.calibration_text(4)
    texts += [it.context for it in corpus.make_eval_set("chat", 5)]
    for t in texts:
        ids = tok(t)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == t
    # chat markers are single tokens
    for m in corpus.CHAT_MARKERS:
        assert len(tok(m, add_special_tokens=False)["input_ids"]) == 1
    # characters are single tokens
    assert len(tok("ab=123", add_special_tokens=False)["input_ids"]) == 6
    left = zoo.load_tokenizer(padding_side="left")
    batch = left(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0][0] == left.pad_token_id and batch["attention_mask"][0][:2] == [0, 0]
    assert (
        tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=False)
        == "<|user|>1+2=<|assistant|>"
    )


# ---------------------------------------------------------------------------------------------- family


def test_family_metadata():
    assert set(zoo.MATCHED) | set(zoo.MISMATCHED) == set(zoo.FAMILY)
    ref = zoo.FAMILY[zoo.MATCHED[0]]
    for n in zoo.MATCHED:
        g = zoo.FAMILY[n]
        assert (g["num_key_value_heads"], g["head_dim"]) == (ref["num_key_value_heads"], ref["head_dim"])
    for n in zoo.MISMATCHED:
        g = zoo.FAMILY[n]
        assert (g["num_key_value_heads"], g["head_dim"]) != (ref["num_key_value_heads"], ref["head_dim"])
    depths = [zoo.FAMILY[n]["num_hidden_layers"] for n in zoo.MATCHED]
    widths = [zoo.FAMILY[n]["hidden_size"] for n in zoo.MATCHED]
    assert depths == sorted(depths) and len(set(widths)) == len(widths)
    with pytest.raises(KeyError):
        zoo.model_path("tiny-zz")


@pytest.mark.parametrize("name", zoo.list_models())
def test_member_loads_with_declared_geometry(name):
    import torch

    model = zoo.load_model(name)
    cfg = model.config
    g = zoo.FAMILY[name]
    for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert getattr(cfg, k) == g[k], k
    assert not cfg.use_sliding_window and set(cfg.layer_types) == {"full_attention"}
    assert cfg.max_position_embeddings >= 1024
    assert cfg.rope_parameters["rope_type"] == "default"
    assert next(model.parameters()).dtype == torch.float32
    tok = zoo.load_tokenizer()
    assert cfg.vocab_size >= len(tok)
    # the cache it builds has the declared geometry
    ids = tok(["ab=123\n?ab="], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    k = out.past_key_values.layers[0].keys
    assert len(out.past_key_values.layers) == g["num_hidden_layers"]
    assert tuple(k.shape) == (1, g["num_key_value_heads"], ids.shape[1], g["head_dim"])
    assert torch.isfinite(out.logits).all()


def test_matched_members_share_kv_geometry_mismatched_differs():
    cfgs = {n: zoo.load_model(n).config for n in zoo.list_models()}
    kv = {n: (c.num_key_value_heads, c.head_dim) for n, c in cfgs.items()}
    assert len({kv[n] for n in zoo.MATCHED}) == 1
    assert all(kv[n] != kv[zoo.MATCHED[0]] for n in zoo.MISMATCHED)
    assert len({cfgs[n].num_hidden_layers for n in zoo.MATCHED}) == len(zoo.MATCHED)


@pytest.mark.slow
def test_family_is_trained_and_larger_is_better():
    """Quality floor, measured now (not read from the committed eval.json): the larger member recalls facts from
    the context, the smaller one does not, and every member predicts text far better than a uniform guess (~50)."""
    from lab.zoo.tasks import evaluate_model

    tok = zoo.load_tokenizer()
    sets = {name: items[:32] for name, items in evaluate_sets().items()}
    scores = {n: evaluate_model(zoo.load_model(n), tok, sets=sets) for n in (zoo.MATCHED[0], zoo.MATCHED[-1])}
    small, large = scores[zoo.MATCHED[0]], scores[zoo.MATCHED[-1]]
    assert large["recall"] >= 0.8 and large["recall"] > small["recall"] + 0.5, scores
    assert large["chat"] > small["chat"] + 0.2, scores
    assert large["text_ppl"] < small["text_ppl"] < 2.0, scores


def evaluate_sets() -> dict:
    from lab.zoo.tasks import eval_sets

    return eval_sets(32, seed=0)


@pytest.mark.slow
def test_recall_generation_large_member():
    from lab.zoo.tasks import generate_answers

    model = zoo.load_model(zoo.MATCHED[-1])
    tok = zoo.load_tokenizer()
    items = corpus.make_eval_set("recall", 16, seed=0)
    answers = generate_answers(model, tok, [it.context for it in items], max_new_tokens=3)
    assert sum(a == it.answer for a, it in zip(answers, items)) >= 13


def test_generate_left_padded_batch():
    from lab.zoo.tasks import generate_answers

    model = zoo.load_model(zoo.MATCHED[0])
    tok = zoo.load_tokenizer()
    items = corpus.make_eval_set("arithmetic", 4, seed=0)
    prompts = [it.prompt for it in items]
    batched = generate_answers(model, tok, prompts, max_new_tokens=4)
    single = [generate_answers(model, tok, [p], max_new_tokens=4)[0] for p in prompts]
    assert batched == single
    assert tok.padding_side == "right" and all(isinstance(b, str) for b in batched)


def test_checkpoint_round_trip(tmp_path):
    """Training checkpoints (model + AdamW state, safetensors only) restore exactly (resumable runs)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from hf_kvmap.zoo.family import make_config
    from hf_kvmap.zoo.tokenizer import build_tokenizer
    from lab.zoo.train import _batch, _load_ckpt, _save_ckpt

    tok = build_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(make_config("tiny-s"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, mask, labels = _batch(tok, 0, 2, 32, seed=0)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    opt.step()
    _save_ckpt(tmp_path, model, opt, 1, 1.0)
    fresh = Qwen3ForCausalLM(make_config("tiny-s"))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    assert _load_ckpt(tmp_path, fresh, fresh_opt) == (1, 1.0)
    _save_ckpt(tmp_path, model, opt, 1, 1.0, recipe={"steps": 10})
    with pytest.raises(ValueError, match="different recipe"):
        _load_ckpt(tmp_path, fresh, fresh_opt, recipe={"steps": 20})
    assert _load_ckpt(tmp_path, fresh, fresh_opt, recipe={"steps": 10}) == (1, 1.0)
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    sa = [opt.state[p]["exp_avg"] for p in model.parameters()]
    sb = [fresh_opt.state[p]["exp_avg"] for p in fresh.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(sa, sb))
    # the batch for a step depends only on the step (resumed runs see the same data)
    assert torch.equal(_batch(tok, 5, 2, 32, seed=0)[0], _batch(tok, 5, 2, 32, seed=0)[0])


def test_a_mapper_missing_from_the_installation_names_the_way_to_get_it(tmp_path, monkeypatch):
    (tmp_path / "tiny-s-to-tiny-l").mkdir()
    (tmp_path / "tiny-s-to-tiny-l" / "config.json").write_text("{}")
    monkeypatch.setattr(zoo, "MAPPERS_DIR", tmp_path)
    assert zoo.mapper_path("tiny-s", "tiny-l") == tmp_path / "tiny-s-to-tiny-l"
    with pytest.raises(FileNotFoundError, match="has tiny-s-to-tiny-l.*--pairs tiny-m:tiny-l"):
        zoo.mapper_path("tiny-m", "tiny-l")
