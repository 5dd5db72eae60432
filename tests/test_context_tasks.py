"""The whole-context task families (`lab.real.context_tasks`, `ruler_tasks`, `code_tasks`), HumanEval's distinct
code contexts (`long_tasks.humaneval(contexts="distinct")`) and their registration in `benchmarks.switch.long_switch`, on a
byte-level tokenizer trained here and a fake machine's corpus: no real weights, no download."""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.switch import long_switch, long_switch_runner
from hf_kvmap.real import corpus
from lab.real import code_tasks, context_tasks, long_tasks, ruler_tasks
from lab.real.humaneval import passes
from lab.real.task_text import LENGTH_TOLERANCE, WORDS, TaskLengthError, string_match_all, words_of

TOKENS = 1200
FAMILIES = (
    "ruler_multikey",
    "ruler_multivalue",
    "ruler_vt",
    "ruler_cwe",
    "ruler_fwe",
    "chat_split",
    "followups",
    "code_defs",
)


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer of 2,000 tokens (every character round-trips; words and code take a token or a few,
    as a real tokenizer's do), with a chat template. It was trained once on the repository's own sources and is kept
    as `tests/data/context_tokenizer.json`: trained here on the sources of the day, its vocabulary moved with every file
    added, and the items' lengths with it (code_defs fell 3-4 % short of 1,200 tokens when one module came)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer.from_file(str(Path(__file__).parent / "data" / "context_tokenizer.json"))
    tok = PreTrainedTokenizerFast(tokenizer_object=trained, eos_token="<eos>", pad_token="<eos>")
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tok


@pytest.fixture(scope="module")
def documents(tmp_path_factory, tiny):
    root = tmp_path_factory.mktemp("machine")
    found = corpus.discover(*tiny.fake_machine(root, files=60))
    # split by the path under the fake machine (the library hashes absolute paths, which change from run to run)
    return [
        corpus.Document(d.path, d.kind, corpus._split_of(str(Path(d.path).relative_to(root))), d.sha256) for d in found
    ]


@pytest.fixture(scope="module")
def built(tokenizer, documents):
    """Two items of every family at `TOKENS` tokens, seed 5."""
    return {name: context_tasks.build_items(name, tokenizer, documents, 2, TOKENS, seed=5) for name in FAMILIES}


def _length(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _question(item) -> str:
    """The text after the context: the last user turn (and the answer's start), or a code item's stub."""
    if item.task == "code_defs":
        return item.meta["stub"]
    return item.prompt.rsplit("<user>", 1)[1].rsplit("\n\n", 1)[-1]


def test_the_registry_holds_every_family_with_its_floor():
    assert context_tasks.CONTEXT_TASK_NAMES == FAMILIES
    assert context_tasks.CHANCE == {
        "ruler_multikey": 1 / 4,
        "ruler_multivalue": 0.0,
        "ruler_vt": 0.0,
        "ruler_cwe": 0.0,
        "ruler_fwe": 3 / 49,  # three of the 49 coded words shown by name
        "chat_split": 1 / 4,
        "followups": 1 / 4,
        "code_defs": 0.0,
    }
    assert [name for name, task in context_tasks.CONTEXT_TASKS.items() if task.code] == ["code_defs"]
    with pytest.raises(context_tasks.UnknownTaskError, match="ruler_vt") as caught:
        context_tasks.build_items("ruler_niah", None, [], 1)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_fits_its_length_and_is_a_function_of_seed_and_index(name, built, tokenizer, documents):
    items = built[name]
    for item in items:
        length = _length(tokenizer, item.prompt)
        assert (1 - LENGTH_TOLERANCE) * TOKENS <= length <= TOKENS and item.meta["tokens"] == length
        assert item.task == name
    assert items[0].prompt != items[1].prompt
    again = context_tasks.build_items(name, tokenizer, documents, 1, TOKENS, seed=5)
    assert again == items[:1]  # the first item is the same whether one or two are built
    other = context_tasks.build_items(name, tokenizer, documents, 1, TOKENS, seed=6)
    assert other[0].prompt != items[0].prompt


@pytest.mark.parametrize("name", FAMILIES)
def test_no_question_gives_its_answer_away(name, built):
    for item in built[name]:
        question = _question(item)
        references = item.meta.get("references") or [item.answer] if item.task != "code_defs" else []
        assert all(reference not in question for reference in references)
        assert all(reference in item.prompt.replace(question, "") for reference in references)


@pytest.mark.parametrize("name", FAMILIES)
def test_planted_replies_score_as_they_should(name, built):
    item = built[name][0]
    if name == "code_defs":
        assert context_tasks.score(item, item.meta["reference"] + "\n\ndef later():\n    pass\n") == 1.0
        first = item.meta["reference"].split("\n")[2]  # `data = helper(args)`: its arguments swapped
        call = re.search(r"\((.*)\)", first).group(1).split(", ")
        wrong = item.meta["reference"].replace(first, first.replace(", ".join(call), ", ".join(call[::-1])))
        assert wrong != item.meta["reference"] and context_tasks.score(item, wrong) == 0.0
        return
    if name in ("chat_split", "followups"):
        assert context_tasks.score(item, f" {item.answer}\n") == 1.0
        assert context_tasks.score(item, f"{item.answer} is the name") == 0.0  # exact match, as long_chat
        return
    references = item.meta["references"]
    assert context_tasks.score(item, " " + ", ".join(r.upper() for r in references) + ".") == 1.0
    assert context_tasks.score(item, "I do not know.") == 0.0
    if len(references) > 1:
        assert context_tasks.score(item, f"only {references[-1]}") == 1 / len(references)


def test_string_match_all_is_rulers_share_of_references_found():
    assert string_match_all("They are ABCDE and fghij.", ["abcde", "FGHIJ", "klmno", "pqrst"]) == 0.5
    with pytest.raises(ValueError, match="at least one reference"):
        string_match_all("x", [])
    assert not [w for w in WORDS if any(w != other and w in other for other in WORDS)]  # no word hides in another


def test_similar_keys_differ_from_the_asked_key_in_one_word(built):
    for item in built["ruler_multikey"]:
        needles = re.findall(r"One of the special magic numbers for (\S+) is: (\d{7})\.", item.prompt)
        assert len(needles) == ruler_tasks.MULTIKEY_NEEDLES and len({v for _, v in needles}) == len(needles)
        asked = item.prompt.rsplit("magic number for ", 1)[1].split(" ")[0]
        assert dict(needles)[asked] == item.answer and item.meta["keys"][0] == asked
        for key, _ in needles:
            if key != asked:
                assert sum(a != b for a, b in zip(key.split("-"), asked.split("-"))) == 1
    for item in built["ruler_multivalue"]:
        needles = re.findall(r"One of the special magic numbers for (\S+) is: (\d{7})\.", item.prompt)
        assert [v for _, v in needles] == item.meta["references"] and {k for k, _ in needles} == {item.meta["key"]}


def _resolve(prompt: str) -> dict[str, int]:
    statements = re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", prompt.split("\n\n", 1)[1])
    values: dict[str, int] = {}
    for name, value in statements:  # each chain's statements come in order
        values[name] = values[value[4:]] if value.startswith("VAR") else int(value)
    return values


def test_variable_tracking_chains_resolve_to_the_asked_value(tokenizer, documents):
    items = ruler_tasks.ruler_vt(tokenizer, documents, 3, TOKENS, seed=5)
    assert [item.meta["hops"] for item in items] == list(ruler_tasks.VT_HOPS)
    for item in items:
        values = _resolve(item.prompt)
        holding = [name for name, value in values.items() if value == item.meta["value"]]
        assert sorted(holding) == sorted(item.meta["references"]) and len(holding) == item.meta["hops"] + 1
        assert len(item.meta["chains"]) == ruler_tasks.VT_CHAINS and len(values) == sum(map(len, item.meta["chains"]))
        assert f"{item.meta['hops'] + 1} variables hold the value {item.meta['value']}" in item.prompt
        hops = re.findall(r"VAR [A-Z]{5} = VAR [A-Z]{5}\.", item.prompt.split("\n\n", 1)[1])
        question = _question(item).split("<eos>")[0]
        assert all(words_of(question) & words_of(hop) == set() for hop in hops)  # "var" is not "variables"


def test_common_word_extraction_counts(tokenizer, documents, built):
    for item in built["ruler_cwe"]:
        listing = item.prompt.split("than others.\n\n")[1].split("\n\n")[0]
        entries = re.findall(r"(\d+)\. (\w+)", listing)
        assert [int(n) for n, _ in entries] == list(range(1, len(entries) + 1))
        counts = Counter(word for _, word in entries)
        assert {w for w, c in counts.items() if c == 6} == set(item.meta["references"]) and len(counts) > 100
        assert set(counts.values()) == {6, 1} and item.meta["repeats"] == [6, 1]
    (long,) = ruler_tasks.ruler_cwe(tokenizer, documents, 1, 4096, seed=5)
    counts = Counter(re.findall(r"\d+\. (\w+)", long.prompt))
    assert {w for w, c in counts.items() if c == 30} == set(long.meta["references"]) and set(counts.values()) == {
        30,
        3,
    }


def test_frequent_word_extraction_counts(built):
    for item in built["ruler_fwe"]:
        text = item.prompt.split("appears.\n\n")[1].split("\n\n")[0].split()
        counts = Counter(text)
        ranked = [word for word, _ in counts.most_common()]
        assert ranked[0] == "..." and ranked[1:4] == item.meta["references"]
        assert (
            sorted(counts.values(), reverse=True) == item.meta["counts"] == ruler_tasks.fwe_counts(item.meta["words"])
        )
        assert counts[ranked[3]] > counts[ranked[4]] and len(counts) == ruler_tasks.FWE_VOCABULARY


def test_chat_split_puts_the_two_facts_in_turns_far_apart_and_the_question_shares_no_word_with_the_second(built):
    for item in built["chat_split"]:
        turns = re.findall(r"<(user|assistant)>(.*?)<eos>", item.prompt, re.S)
        first, question = turns[0][1], turns[-1][1]
        (at,) = [i for i, (_, text) in enumerate(turns) if text.startswith("Quick update about pets:")]
        second, ack = turns[at][1], turns[at + 1][1]
        assert f"{item.meta['friend']} lives in {item.meta['town']}." in first and item.meta["friend"] in question
        assert f"settled in {item.meta['town']} keeps a puppy called {item.answer}" in second
        assert words_of(question) & (words_of(second) | words_of(ack)) == set()
        assert item.meta["friend"] not in second and "dog" not in second.lower()
        assert second.count("keeps a puppy called") == context_tasks.CHAT_SPLIT_FRIENDS  # four candidates
        share = item.prompt.index(second) / len(item.prompt)
        assert abs(share - item.meta["depth"]) < 0.15 and at >= 4  # prose turns lie between the two facts
    assert [item.meta["depth"] for item in built["chat_split"]] == list(context_tasks.SPLIT_DEPTHS[:2])


def test_followups_ask_about_three_turns_and_append_what_the_template_renders(built, tokenizer):
    for item in built["followups"]:
        questions = item.meta["questions"]
        assert sorted(q["turn"] for q in questions) == [0, 1, 2] and item.answer == questions[0]["answer"]
        assert item.prompt.endswith(f"<user>{questions[0]['question']}<eos><assistant>")
        facts = [t for t in re.findall(r"<user>(Let me tell you about my .*?)<eos>", item.prompt, re.S)]
        assert len(facts) == 3
        for question in questions:
            person = re.search(r"(?:friend|colleague|neighbour) (\w+)", question["question"]).group(1)
            holding = [fact for fact in facts if person in fact]
            assert holding == [facts[question["turn"]]] and question["answer"] in holding[0]
        conversation = item.prompt
        for previous, following in zip(questions, questions[1:]):
            conversation += previous["answer"] + following["append"]
            assert following["append"] == f"<eos><user>{following['question']}<eos><assistant>"
        assert conversation.endswith(f"<user>{questions[2]['question']}<eos><assistant>")
        shares = [item.prompt.index(fact) / len(item.prompt) for fact in facts]
        assert shares[0] < 0.05 and 0.3 < shares[1] < 0.6 and shares[2] > 0.75


def test_code_defs_need_the_helpers_defined_across_the_file(built):
    for item in built["code_defs"]:
        problem, stub = item.meta["problem"], item.meta["stub"]
        assert passes(problem, item.meta["reference"]) and not passes(problem, "    return 0\n")
        helpers = problem["prompt"].split("\n\n\n")[:-1]
        assert item.prompt.endswith(stub) and problem["prompt"].endswith(stub)
        names, told = item.meta["helpers"], words_of(stub.split('"""')[1])
        for helper in helpers:
            assert helper in item.prompt
            signature = helper.split('"""')[:2]
            assert told & words_of(" ".join(signature)) <= code_tasks.FUNCTION_WORDS
        assert all(name not in stub for name in names)
        shares = sorted(item.prompt.index(helper) / len(item.prompt) for helper in helpers)
        assert all(abs(share - depth) < 0.12 for share, depth in zip(shares, code_tasks.HELPER_DEPTHS))
        ast.parse(item.prompt + item.meta["reference"])  # whole statements of real code around the helpers


def test_an_item_that_cannot_reach_its_length_is_refused(tokenizer, documents):
    with pytest.raises(TaskLengthError, match="longer length"):
        context_tasks.build_items("ruler_vt", tokenizer, documents, 1, 60)
    with pytest.raises(TaskLengthError, match="fewer or shorter items"):
        context_tasks.build_items("chat_split", tokenizer, documents, 400, TOKENS)


PROBLEMS = [
    {"task_id": f"Demo/{i}", "prompt": f"def f{i}(x):\n", "entry_point": f"f{i}", "test": ""} for i in range(6)
]


def test_humaneval_distinct_contexts_depend_on_the_problem_not_on_the_split(tokenizer, documents):
    whole = long_tasks.humaneval(tokenizer, documents, PROBLEMS, tokens=600, seed=3, contexts="distinct")
    split = long_tasks.humaneval(tokenizer, documents, PROBLEMS[4:], tokens=600, seed=3, contexts="distinct")
    contexts = [item.prompt[: -len(problem["prompt"])] for item, problem in zip(whole, PROBLEMS)]
    assert len(set(contexts)) == len(PROBLEMS) and all(contexts)
    assert [item.prompt for item in split] == [item.prompt for item in whole[4:]]
    windows = long_tasks.code_contexts(tokenizer, documents, 600, seed=3)
    assert contexts[5] == windows[5] + "\n\n\n"
    old = long_tasks.humaneval(tokenizer, documents, PROBLEMS[4:], tokens=600, seed=3)  # as the old records were
    assert (
        old[0].prompt
        == long_tasks.humaneval(tokenizer, documents, PROBLEMS, tokens=600, seed=3)[0].prompt[
            : -len(PROBLEMS[0]["prompt"])
        ]
        + PROBLEMS[4]["prompt"]
    )  # problem 4 gets the first window when a process starts there
    far = [{**PROBLEMS[0], "task_id": f"Demo/{len(windows)}"}]
    with pytest.raises(long_tasks.TooFewContextsError, match=f"{len(windows)} distinct windows"):
        long_tasks.humaneval(tokenizer, documents, far, tokens=600, seed=3, contexts="distinct")
    with pytest.raises(ValueError, match="contexts="):
        long_tasks.humaneval(tokenizer, documents, PROBLEMS, tokens=600, contexts="shuffled")


def test_long_switch_builds_scores_and_writes_the_new_families(tokenizer, documents, tmp_path, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(corpus, "load_manifest", lambda path: documents)
    out = tmp_path / "items.jsonl"
    argv = ["--tasks", "ruler_vt,chat_split", "--tokens", str(TOKENS), "--items", "2", "--seed", "5"]
    long_switch.main([*argv, "--write-items", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected = context_tasks.build_items("ruler_vt", tokenizer, documents, 2, TOKENS, seed=5)
    written = [row for row in rows if row["task"] == f"ruler_vt@{TOKENS}"]
    assert [(r["prompt"], r["answer"], r["references"]) for r in written] == [
        (e.prompt, e.answer, e.meta["references"]) for e in expected
    ]
    assert len(rows) == 4 and {row["stop"] for row in rows} == {"<|im_end|>"}
    with pytest.raises(SystemExit, match="exact-match items"):
        long_switch.main(["--tasks", "code_defs", "--write-items", str(tmp_path / "code.jsonl")])

    args = long_switch.parse_args([*argv, "--tasks", "ruler_vt,code_defs"])
    items = long_switch.build_items(tokenizer, args)
    vt, code = items[0], items[1]
    assert (vt["task"], code["task"]) == ("ruler_vt", "code_defs")
    assert long_switch_runner.score(vt, " ".join(vt["references"][:1]), [], None) == {
        "score": 1 / len(vt["references"])
    }
    assert long_switch_runner.score(code, code["reference"], [], None) == {"score": 1.0}
    assert long_switch_runner.MAX_NEW["ruler_vt"] == 30 and long_switch_runner.MAX_NEW["code_defs"] == 320
    assert long_switch.key_of(args, vt) == f"0.5b:1.5b/ruler_vt/{TOKENS}/5/0"
    distinct = long_switch.parse_args(["--tasks", "humaneval", "--contexts", "distinct"])
    assert (
        long_switch.key_of(distinct, {"task": "humaneval", "index": 7}) == "0.5b:1.5b/humaneval/2048/4321/7/distinct"
    )
    assert long_switch.key_of(args, {"task": "humaneval", "index": 7}).endswith("/7")  # the old records' keys


def test_distinct_code_contexts_are_whole_lines_that_split_no_string(tokenizer, documents):
    import io
    import tokenize

    held_out = "".join(open(d.path).read() for d in documents if d.split == "heldout" and d.kind == "code")
    contexts = long_tasks.code_contexts(tokenizer, documents, 600, seed=3)
    assert len(contexts) > 6 and len(set(contexts)) == len(contexts)
    for context in contexts:
        assert all(line in held_out for line in context.splitlines()) and _length(tokenizer, context) >= 300
        list(tokenize.generate_tokens(io.StringIO(context + "\n").readline))  # no string left open
        assert not context.rstrip().endswith(":")


def test_exact_match_reads_the_answer_whatever_its_case_and_a_closing_full_stop():
    item = long_tasks.LongItem("followups", "prompt", "ochre")
    assert [
        context_tasks.exact_match(item, reply) for reply in ("Ochre", " ochre.", "OCHRE", "ochre red", "teal")
    ] == [
        1.0,
        1.0,
        1.0,
        0.0,
        0.0,
    ]


def test_a_reply_that_copies_every_candidate_scores_its_precision():
    from lab.real.task_text import string_match_all, string_match_listed

    references = ["velvet", "walnut", "badge"]
    dump = "attic, velvet, ladder, walnut, gopher, badge"  # the whole list: every reference, and three that are not
    assert string_match_all(dump, references) == 1.0 and string_match_listed(dump, references) == 0.5
    assert string_match_listed("velvet, walnut and badge.", references) == 1.0
    assert string_match_listed(" VAR VELVET, VAR cedar, and VAR badge.", references) == pytest.approx(2 / 3)
    assert string_match_listed("The number for the key is velvet.", ["velvet"]) == 1.0
    item = long_tasks.LongItem("ruler_cwe", "", "", {"references": references})
    assert context_tasks.score(item, dump) == 0.5
