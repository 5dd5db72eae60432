"""The read-back KL fine-tune at length (`hf_kvmap.long_kl`): the top-k teacher's KL against the full one, the cached
rows against the live computation, the identity at zero, gradients into the mapper only, a planted perturbation pulled
back, and a resumed run reaching the uninterrupted run's weights."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from hf_kvmap import MapperModel
from hf_kvmap._compat import cache_kwargs, output_cache
from hf_kvmap.finetune import frozen
from hf_kvmap.long_kl import RowStore, long_kl_finetune, row_kl, tail_start, teacher_topk, topk_kl
from hf_kvmap.objectives import mapped_kl

BOUNDARY = 3  # the tiny rows' "turn start" token


def _full_kl(teacher_logits, student_logits):
    p = torch.log_softmax(teacher_logits.float(), -1)
    q = torch.log_softmax(student_logits.float(), -1)
    return (p.exp() * (p - q)).sum(-1)


def _perturbed_identity(model, scale=0.05, seed=0):
    mapper = MapperModel.identity(model.config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in mapper.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return mapper


def _sequences(count=8, length=48, vocab=128, seed=0):
    """Random rows with a turn start planted at 36 (and at 10, too early to count)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(4, vocab, (count, length), generator=generator)
    rows[:, 36] = rows[:, 10] = BOUNDARY
    return rows.tolist()


def _store(tmp_path, model, top_k=128, count=8, tail=8, name="rows"):
    store = RowStore.create(tmp_path / name, _sequences(count), tail=tail, top_k=top_k, boundary=BOUNDARY)
    store.prepare(model, model, progress=False)
    return store


def _model_logits(tiny):
    """The tiny model's own next-token logits on a tail and its logits reading a perturbed map of the prefix."""
    model = tiny.model(seed=3)
    ids = torch.tensor(_sequences(2))
    with torch.no_grad():
        teacher = model(input_ids=ids).logits[:, 36:]
        source = output_cache(model(input_ids=ids[:, :36], use_cache=True))
        mapped = _perturbed_identity(model, scale=0.1)(
            [layer.keys for layer in source.layers], [layer.values for layer in source.layers]
        )
        student = model(input_ids=ids[:, 36:], **cache_kwargs(DynamicCache(ddp_cache_data=mapped))).logits
    return teacher, student


@pytest.mark.parametrize("logits", ["random", "tiny model"])
def test_topk_kl_is_the_coarsened_kl(tiny, logits):
    generator = torch.Generator().manual_seed(0)
    if logits == "random":
        teacher, student = (3 * torch.randn(5, 7, 128, generator=generator) for _ in range(2))
    else:
        teacher, student = _model_logits(tiny)
    full = _full_kl(teacher, student)
    # the whole vocabulary: the full KL
    assert torch.allclose(topk_kl(*teacher_topk(teacher, 128), student), full, atol=1e-5)
    previous = torch.zeros_like(full)
    for k in (1, 4, 16, 64):
        indices, logprobs, rest = teacher_topk(teacher, k)
        coarse = topk_kl(indices, logprobs, rest, student)
        # the chain rule: what is left out is the rest's mass times the KL of the two rests, renormalised
        p = torch.log_softmax(teacher.float(), -1).scatter(-1, indices, float("-inf"))
        q = torch.log_softmax(student.float(), -1).scatter(-1, indices, float("-inf"))
        p_rest, q_rest = p - p.logsumexp(-1, keepdim=True), q - q.logsumexp(-1, keepdim=True)
        within = torch.where(p_rest.isinf(), 0.0, p_rest.exp() * (p_rest - q_rest)).sum(-1)
        assert torch.allclose(full - coarse, rest.exp() * within, atol=1e-5)
        # never above the full KL, and a finer partition (more tokens kept) never gives less
        assert bool((coarse <= full + 1e-6).all()) and bool((coarse >= previous - 1e-6).all())
        previous = coarse
    with pytest.raises(ValueError, match="top_k"):
        teacher_topk(teacher, 129)
    with pytest.raises(ValueError, match="same tail"):
        topk_kl(indices, logprobs, rest, student[:, :3])


def test_tail_starts_at_the_last_turn_that_leaves_a_tail(tmp_path):
    ids = _sequences(1)[0]
    assert tail_start(ids, 8, BOUNDARY) == 36 and tail_start(ids, 8) == 40
    with pytest.raises(ValueError, match="No turn starts"):
        tail_start(ids, 13, BOUNDARY)  # 36 leaves only 12; 10 is before half the sequence
    with pytest.raises(ValueError, match="tail"):
        tail_start(ids, 24)


def test_cached_rows_reproduce_the_live_kl_and_the_identity_reads_at_zero(tiny, tmp_path):
    model = tiny.model(seed=4)
    store = _store(tmp_path, model)
    mapper = _perturbed_identity(model)
    with torch.no_grad():
        for index, ids in enumerate(store.sequences):
            row = store.row(index)
            assert row["prefix"] == 36 and row["input_ids"].tolist() == ids[:44]
            live = mapped_kl(mapper, model, model, torch.tensor([ids[:44]]), 36)
            assert row_kl(mapper, model, row).item() == pytest.approx(live.item(), rel=1e-5, abs=1e-7)
            assert abs(row_kl(MapperModel.identity(model.config), model, row).item()) < 1e-6
    # the same folder reopens with the same settings and is refused with others
    assert RowStore.create(store.folder, store.sequences, tail=8, top_k=128, boundary=BOUNDARY).missing() == []
    with pytest.raises(ValueError, match=r"other settings.*top_k"):
        RowStore.create(store.folder, store.sequences, tail=8, top_k=64, boundary=BOUNDARY)


def test_gradients_reach_only_the_mapper(tiny, tmp_path):
    model = tiny.model(seed=5)
    store = _store(tmp_path, model, count=2)
    mapper = _perturbed_identity(model)
    with frozen(model):
        row_kl(mapper, model, store.row(0)).backward()
        assert all(p.grad is None for p in model.parameters())
    grads = [p.grad for p in mapper.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    assert all(p.requires_grad for p in model.parameters())  # given back


def test_a_perturbed_map_is_pulled_back_and_saved_with_its_record(tiny, tmp_path):
    model = tiny.model(seed=6)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    store = _store(tmp_path, model, top_k=16)
    mapper = _perturbed_identity(model)
    result = long_kl_finetune(
        mapper, model, store, steps=30, lr=3e-3, eval_every=10, patience=None, val_rows=2, progress=False
    )
    assert result.finished and result.steps_run == 30 and result.best_step > 0
    assert result.best_val_kl < 0.5 * result.initial_val_kl  # measured: 0.64 -> 0.16 nats a token
    train = [r["train_kl"] for r in result.history[1:]]
    assert sum(train[-10:]) < 0.5 * sum(train[:10])  # the training rows' KL falls too
    assert [r["step"] for r in result.history if "val_kl" in r] == [0, 10, 20, 30]
    assert len(result.rows["train"]) == 6 and len(result.rows["val"]) == 2 and result.rows["top_k"] == 16
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
    # the best state is the one kept, and what the mapper's folder records
    with torch.no_grad():
        held = sum(row_kl(mapper, model, store.row(i)).item() for i in result.rows["val"]) / 2
    assert held == pytest.approx(result.best_val_kl, rel=1e-6)
    mapper.save_pretrained(tmp_path / "tuned")
    loaded = MapperModel.from_pretrained(tmp_path / "tuned")
    record = loaded.config.calibration["long_kl_finetune"]
    assert record["best_val_kl"] == result.best_val_kl and record["settings"]["lr"] == 3e-3
    card = (tmp_path / "tuned" / "README.md").read_text()
    assert "KL at length" in card and "tail of 8 tokens" in card


def test_resuming_a_checkpoint_reaches_the_uninterrupted_weights(tiny, tmp_path):
    model = tiny.model(seed=7)
    store = _store(tmp_path, model)
    options = dict(steps=6, lr=3e-3, eval_every=2, patience=None, val_rows=2, progress=False)
    whole = _perturbed_identity(model)
    straight = long_kl_finetune(whole, model, store, checkpoint=tmp_path / "a", **options)
    parts, resumed = [], None
    for limit in (0.0, 0.0, None):  # a fresh mapper each time, as a new process would load the base map
        resumed = _perturbed_identity(model)
        result = long_kl_finetune(resumed, model, store, checkpoint=tmp_path / "b", max_minutes=limit, **options)
        parts.append((result.steps_run, result.finished))
    assert parts == [(1, False), (2, False), (6, True)]
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), resumed.parameters()))
    assert [r.get("val_kl") for r in result.history] == [r.get("val_kl") for r in straight.history]
    state = json.loads((tmp_path / "b" / "state.json").read_text())
    assert state["step"] == 6 and not list(tmp_path.glob(".b.*"))
    # a finished checkpoint gives the same result again; another fine-tune's is refused
    again = _perturbed_identity(model)
    assert (
        long_kl_finetune(again, model, store, checkpoint=tmp_path / "b", **options).best_val_kl == result.best_val_kl
    )
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), again.parameters()))
    with pytest.raises(ValueError, match=r"another fine-tune.*settings"):
        long_kl_finetune(again, model, store, checkpoint=tmp_path / "b", **(options | {"lr": 1e-3}))
    with pytest.raises(ValueError, match="checkpoint"):
        long_kl_finetune(again, model, store, max_minutes=1.0, **options)
    with pytest.raises(ValueError, match="val_rows"):
        long_kl_finetune(again, model, store, **(options | {"val_rows": 8}))


def test_the_command_takes_the_pair_from_the_maps_config(tiny):
    from benchmarks.real.long_finetune import pair_of

    mapper = MapperModel.identity(tiny.model().config)
    with pytest.raises(SystemExit, match="real pair"):
        pair_of(mapper)
    mapper.config.source_model_id = "hf-kvmap-real:qwen2.5-coder-0.5b-instruct"
    mapper.config.target_model_id = "hf-kvmap-real:qwen2.5-coder-1.5b-instruct"
    assert pair_of(mapper) == ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
