"""Scoring of the corpus tasks on a causal LM (used for the learning curves and the family report).

* recall / arithmetic / chat: exact match. Scored teacher-forced in one forward pass: an item counts
  as correct iff the argmax at every answer position (plus the stop token for arithmetic and chat) is
  the gold token, which is exactly "greedy generation reproduces the answer". :func:`generate_answers`
  does the same by real ``generate()`` with left padding.
* choice: log-likelihood of each continuation (sum over its tokens), argmax vs label.
* text: per-character perplexity of plain text.
"""

from __future__ import annotations

import math

import torch

from hf_kvmap.zoo import corpus


def _pad_right(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


@torch.no_grad()
def _logprobs(model, seqs: list[list[int]], pad: int, batch_size: int = 32) -> list[torch.Tensor]:
    """Per sequence: log p(token t | tokens < t) for t = 1 .. len-1, and the argmax there."""
    out = []
    for b in range(0, len(seqs), batch_size):
        chunk = seqs[b : b + batch_size]
        ids, mask = _pad_right(chunk, pad)
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        lp = torch.log_softmax(logits[:, :-1], dim=-1)
        tgt = ids[:, 1:]
        tok_lp = lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        hit = lp.argmax(-1) == tgt
        for i, s in enumerate(chunk):
            n = len(s) - 1
            out.append(torch.stack([tok_lp[i, :n], hit[i, :n].float()]))
    return out


def _exact_match(model, tok, pairs: list[tuple[str, str]]) -> float:
    seqs, starts = [], []
    for ctx, ans in pairs:
        c = tok(ctx)["input_ids"]
        f = tok(ctx + ans)["input_ids"]
        seqs.append(f)
        starts.append(len(c))
    res = _logprobs(model, seqs, tok.pad_token_id)
    ok = [bool(r[1, s - 1 :].all()) for r, s in zip(res, starts)]
    return sum(ok) / len(ok)


def score_recall(model, tok, items: list[corpus.RecallItem]) -> float:
    return _exact_match(model, tok, [(it.context, it.answer) for it in items])


def score_arithmetic(model, tok, items: list[corpus.ArithmeticItem]) -> float:
    return _exact_match(model, tok, [(it.prompt, it.answer + it.stop) for it in items])


def score_chat(model, tok, items: list[corpus.ChatItem]) -> float:
    return _exact_match(model, tok, [(it.context, it.answer + corpus.END) for it in items])


def score_choice(model, tok, items: list[corpus.ChoiceItem]) -> float:
    seqs, starts = [], []
    for it in items:
        c = tok(it.context)["input_ids"]
        for ch in it.choices:
            seqs.append(tok(it.context + ch)["input_ids"])
            starts.append(len(c))
    res = _logprobs(model, seqs, tok.pad_token_id)
    lls = [float(r[0, s - 1 :].sum()) for r, s in zip(res, starts)]
    correct, k = 0, 0
    for it in items:
        scores = lls[k : k + len(it.choices)]
        k += len(it.choices)
        correct += int(max(range(len(scores)), key=scores.__getitem__) == it.label)
    return correct / len(items)


def score_text(model, tok, items: list[corpus.TextItem]) -> float:
    """Per-token (= per-character) perplexity."""
    res = _logprobs(model, [tok(it.text)["input_ids"] for it in items], tok.pad_token_id)
    nll = -sum(float(r[0].sum()) for r in res)
    n = sum(r.shape[1] for r in res)
    return math.exp(nll / n)


def eval_sets(n: int = 64, seed: int = 0) -> dict[str, list]:
    return {t: corpus.make_eval_set(t, n, seed) for t in corpus.TASKS}


@torch.no_grad()
def evaluate_model(model, tok, n: int = 64, seed: int = 0, sets: dict | None = None) -> dict[str, float]:
    """Accuracy on recall / arithmetic / choice / chat and perplexity on text (fixed eval sets)."""
    sets = sets or eval_sets(n, seed)
    was_training = model.training
    model.eval()
    out = {
        "recall": score_recall(model, tok, sets["recall"]),
        "arithmetic": score_arithmetic(model, tok, sets["arithmetic"]),
        "choice": score_choice(model, tok, sets["choice"]),
        "chat": score_chat(model, tok, sets["chat"]),
        "text_ppl": score_text(model, tok, sets["text"]),
    }
    model.train(was_training)
    return out


@torch.no_grad()
def generate_answers(model, tok, prompts: list[str], max_new_tokens: int, batch_size: int = 32) -> list[str]:
    """Greedy answers by stock ``generate()`` with left padding (decoded, special tokens removed)."""
    side = tok.padding_side
    tok.padding_side = "left"
    outs = []
    try:
        for b in range(0, len(prompts), batch_size):
            enc = tok(prompts[b : b + batch_size], return_tensors="pt", padding=True)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            outs += tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=False)
    finally:
        tok.padding_side = side
    return outs
