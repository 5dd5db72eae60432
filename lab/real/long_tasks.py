"""Tasks at serving lengths (2K-4K tokens) where the larger model of a pair should answer better than the smaller,
built from the held-out split of the real corpus (`hf_kvmap.real.corpus`) and HumanEval (`lab.real.humaneval`).

- `long_chat` (exact match, chat template, multi-turn): the first user turn introduces four friends, each with a
  home town and a dog; turns of real prose (a passage the user shares, a passage the assistant answers with) follow
  until the conversation reaches `tokens`; the last turn asks for the dog of the friend from one town (two facts
  combined, among similar facts).
- `long_doc` (exact match, chat template): a long document of real prose with six planted registration numbers of
  similarly named subjects at evenly spaced depths; the question asks for the number at one of `DEPTHS` (recorded
  per item as `depth`).
- `humaneval` (pass@1 by the problem's tests): a HumanEval prompt, bare (`tokens=0`) or behind `tokens` tokens of
  real held-out Python code (whole lines), as a long coding session would have it; with `contexts="distinct"` each
  problem's code is its own window, chosen by the seed and the problem's index alone.
- `continuation` (agreement and NLL): `tokens` tokens of held-out code or prose, and the `new_tokens` real tokens
  that follow; scored by the agreement of a greedy continuation with the target's own and by the NLL of the real
  text.

Everything but the planted facts, questions and names is real text; a seed fixes what is generated.
"""

from __future__ import annotations

import io
import random
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass, field

from hf_kvmap.real.corpus import Document, code_texts, prose_texts

from .tasks import _ADJECTIVES, _FACTS, _NOUNS, _chat, _whole_lines

LONG_TASK_NAMES = ("long_chat", "long_doc", "humaneval", "continuation")
#: where in a long document the asked-for fact sits (its share of the document before it)
DEPTHS = (0.1, 0.5, 0.9)
#: how many friends a conversation introduces, and a document's subjects (adjectives x nouns): the candidates the
#: question picks one of
CHAT_FRIENDS, DOC_SUBJECTS = 4, (2, 3)
#: each task's floor: the share of items a reply gets right by guessing. A reply that names one of the prompt's
#: candidates at random (one of its dogs, one of its registration numbers) is right once in that many; a completion
#: that passes its tests or a continuation that agrees with the target's is not guessed.
CHANCE = {
    "long_chat": 1 / CHAT_FRIENDS,
    "long_doc": 1 / (DOC_SUBJECTS[0] * DOC_SUBJECTS[1]),
    "humaneval": 0.0,
    "continuation": 0.0,
}
_FRIENDS = ("Anna", "Ben", "Carla", "David", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas")


@dataclass(frozen=True)
class LongItem:
    """One item of a long task.

    Args:
        task (`str`): the task's name.
        prompt (`str`): the text the models read (already rendered with the chat template where the task has one).
        answer (`str`): what an exact-match task expects (empty for the others).
        meta (`dict`): what else the item records (`depth`, `task_id`, `continuation_ids`, ...).
    """

    task: str
    prompt: str
    answer: str = ""
    meta: dict = field(default_factory=dict)


def _token_windows(tokenizer, texts, tokens: int, split_long: bool = True):
    """Consecutive windows of `tokens` token ids from `texts`, in order (a text shorter than a window is skipped)."""
    for text in texts:
        ids = tokenizer(text.strip(), add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - tokens + 1, tokens if split_long else len(ids)):
            yield ids[start : start + tokens]


class _Prose:
    """A stream of real prose passages of about `tokens` tokens from the held-out split, in a fixed order."""

    def __init__(self, tokenizer, documents: Sequence[Document], tokens: int, seed: int):
        self._windows = _token_windows(tokenizer, prose_texts(documents, "heldout", seed), tokens)
        self._tokenizer = tokenizer

    def next(self) -> str:
        try:
            return self._tokenizer.decode(next(self._windows)).strip()
        except StopIteration:
            raise ValueError("The held-out prose ran out; build fewer or shorter items.") from None


def _length(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def long_chat(tokenizer, documents, items: int, tokens: int = 2048, seed: int = 1234) -> list[LongItem]:
    """Long multi-turn conversations whose last question combines two facts of the first turn (module docstring)."""
    rng = random.Random(f"{seed}-long-chat-{tokens}")
    prose = _Prose(tokenizer, documents, 180, seed + 17)
    towns, dogs = list(_FACTS["home town"]), list(_FACTS["dog's name"])
    out = []
    for _ in range(items):
        friends = rng.sample(_FRIENDS, CHAT_FRIENDS)
        places, names = rng.sample(towns, CHAT_FRIENDS), rng.sample(dogs, CHAT_FRIENDS)
        facts = " ".join(f"{f} lives in {t} and has a dog called {d}." for f, t, d in zip(friends, places, names))
        asked = rng.randrange(CHAT_FRIENDS)
        messages = [
            {"role": "user", "content": f"Some facts about my friends, please remember them. {facts}"},
            {"role": "assistant", "content": "Got it, I will remember your friends, their towns and their dogs."},
        ]
        question = {
            "role": "user",
            "content": f"Which dog belongs to my friend who lives in {places[asked]}? Reply with the dog's name only.",
        }
        while _length(tokenizer, _chat(tokenizer, [*messages, question])) < tokens - 200:
            messages.append({"role": "user", "content": f"Here is a passage I am reading:\n\n{prose.next()}"})
            messages.append({"role": "assistant", "content": prose.next()})
        prompt = _chat(tokenizer, [*messages, question])
        out.append(
            LongItem("long_chat", prompt, names[asked], {"tokens": _length(tokenizer, prompt), "turns": len(messages)})
        )
    return out


def long_doc(tokenizer, documents, items: int, tokens: int = 2048, seed: int = 1234) -> list[LongItem]:
    """Long documents with six similar planted facts; the question's fact sits at one of `DEPTHS` (in turn)."""
    rng = random.Random(f"{seed}-long-doc-{tokens}")
    prose = _Prose(tokenizer, documents, 120, seed + 29)
    out = []
    for index in range(items):
        adjectives, nouns = rng.sample(_ADJECTIVES, DOC_SUBJECTS[0]), rng.sample(_NOUNS, DOC_SUBJECTS[1])
        subjects = [f"{a} {n}" for a in adjectives for n in nouns]
        rng.shuffle(subjects)
        numbers = [str(n) for n in rng.sample(range(10000, 99999), len(subjects))]
        passages = []
        while _length(tokenizer, "\n\n".join(passages)) < tokens - 250:
            passages.append(prose.next())
        slots = [round(share * (len(passages) - 1)) for share in (0.05, 0.25, 0.45, 0.6, 0.75, 0.9)]
        depth = DEPTHS[index % len(DEPTHS)]
        asked = min(range(len(slots)), key=lambda i: abs(slots[i] / max(1, len(passages) - 1) - depth))
        for slot, subject, number in sorted(zip(slots, subjects, numbers), reverse=True):
            passages.insert(slot + 1, f"The registration number of the {subject} is {number}.")
        question = (
            "\n\n".join(passages) + f"\n\nWhat is the registration number of the {subjects[asked]}? "
            "Reply with the number only."
        )
        prompt = _chat(tokenizer, [{"role": "user", "content": question}])
        out.append(
            LongItem("long_doc", prompt, numbers[asked], {"tokens": _length(tokenizer, prompt), "depth": depth})
        )
    return out


#: how `humaneval` gives each problem its code: "sequential" (the windows in turn, in the order of the problems
#: passed: the records before distinct contexts were built so) or "distinct" (a function of the seed and the problem's
#: index only)
HUMANEVAL_CONTEXTS = ("sequential", "distinct")


class TooFewContextsError(ValueError):
    """The held-out code holds fewer distinct windows of the length asked than the problems need."""


def problem_index(problem: dict) -> int:
    """A HumanEval problem's index, the number its `task_id` ends with (`"HumanEval/17"` -> 17)."""
    head, _, number = str(problem.get("task_id", "")).rpartition("/")
    if not head or not number.isdigit():
        raise ValueError(f"task_id {problem.get('task_id')!r} does not end with a problem number ('HumanEval/17').")
    return int(number)


def _string_lines(source: str) -> set[int] | None:
    """The (0-based) lines of `source` that continue a string begun on an earlier line (a cut before them would split
    it); `None` where Python cannot tokenize the source."""
    inside: set[int] = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.STRING and token.end[0] > token.start[0]:
                inside.update(
                    range(token.start[0], token.end[0])
                )  # rows are 1-based: these are the 0-based lines after
    except (tokenize.TokenError, SyntaxError):
        return None
    return inside


def code_contexts(tokenizer, documents, tokens: int, seed: int = 1234) -> list[str]:
    """Every window of `tokens` token ids the held-out code holds (consecutive, none overlapping another, a file
    shorter than one left out) as whole lines of its file that split no string (nor end on a line opening a block),
    those left with at least half their tokens, in an order fixed by `seed`: context `i` is HumanEval problem `i`'s under `contexts="distinct"`."""
    contexts = []
    for text in code_texts(documents, "heldout", seed + 41):
        source = text.strip()
        inside = _string_lines(source)
        if inside is None:
            continue
        offsets, lines = (
            tokenizer(source, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"],
            source.split("\n"),
        )
        starts = [0]
        for line in lines:
            starts.append(starts[-1] + len(line) + 1)
        for start in range(0, len(offsets) - tokens + 1, tokens):
            begin, end = offsets[start][0], offsets[start + tokens - 1][1]
            first = next(i for i in range(len(lines) + 1) if starts[i] >= begin)  # the first line that starts within
            last = max((i for i in range(len(lines)) if starts[i + 1] - 1 <= end), default=-1)  # the last that ends
            while first <= last and first in inside:
                first += 1
            while last >= first and (
                last + 1 in inside or lines[last].rstrip().endswith(":") or lines[last].lstrip().startswith("@")
            ):
                last -= 1
            context = "\n".join(lines[first : last + 1]).strip("\n")
            if _length(tokenizer, context) >= tokens // 2:  # not a window that is mostly one long string
                contexts.append(context)
    random.Random(f"{seed}-humaneval-contexts-{tokens}").shuffle(contexts)
    return contexts


def humaneval(
    tokenizer,
    documents,
    problems: Sequence[dict],
    tokens: int = 0,
    seed: int = 1234,
    items: int | None = None,
    contexts: str = "sequential",
) -> list[LongItem]:
    """HumanEval prompts, bare (`tokens=0`) or each behind its own `tokens`-token window of held-out code (whole
    lines, then two blank lines). `problems` from `humaneval.humaneval_problems()`; `items` takes the first ones.

    Args:
        contexts (`str`, *optional*, defaults to `"sequential"`): `"distinct"` gives problem `i` (its `task_id`'s
            number) context `i` of `code_contexts(tokenizer, documents, tokens, seed)`: one distinct context per
            problem, whichever problems are built together; `"sequential"` gives the problems passed the windows in
            turn (so a problem's context depends on the problems before it in the list: what the records made before
            `"distinct"` were built with).

    Raises:
        `TooFewContextsError`: under `"distinct"`, a problem's index is past the windows the held-out code holds.
    """
    if contexts not in HUMANEVAL_CONTEXTS:
        raise ValueError(f"contexts={contexts!r} must be one of {HUMANEVAL_CONTEXTS}.")
    chosen = list(problems)[:items] if items is not None else list(problems)
    sequential = tokens and contexts == "sequential"
    windows = _token_windows(tokenizer, code_texts(documents, "heldout", seed + 41), tokens) if sequential else None
    distinct = code_contexts(tokenizer, documents, tokens, seed) if tokens and contexts == "distinct" else None
    out = []
    for problem in chosen:
        context = ""
        if distinct is not None:
            index = problem_index(problem)
            if index >= len(distinct):
                raise TooFewContextsError(
                    f"The held-out code holds {len(distinct)} distinct windows of {tokens} tokens, too few for problem "
                    f"{problem['task_id']} (index {index}); ask for a shorter length (tokens) or fewer problems."
                )
            context = distinct[index] + "\n\n\n"
        elif windows is not None:
            try:
                context = _whole_lines(tokenizer.decode(next(windows))).rstrip() + "\n\n\n"
            except StopIteration:
                raise ValueError("The held-out code ran out; build fewer or shorter items.") from None
        prompt = context + problem["prompt"]
        meta = {"task_id": problem["task_id"], "tokens": _length(tokenizer, prompt), "context_tokens": tokens}
        if distinct is not None:
            meta["contexts"] = contexts
        out.append(LongItem("humaneval", prompt, "", meta))
    return out


def continuation(
    tokenizer, documents, items: int, tokens: int = 2048, new_tokens: int = 128, kind: str = "code", seed: int = 1234
) -> list[LongItem]:
    """`tokens` tokens of held-out `kind` text ("code" or "prose") and the `new_tokens` real tokens after them
    (`meta["context_ids"]`, `meta["continuation_ids"]`: token ids, so nothing is re-tokenized)."""
    if kind not in ("code", "prose"):
        raise ValueError(f"kind={kind!r} must be 'code' or 'prose'.")
    texts = (code_texts if kind == "code" else prose_texts)(documents, "heldout", seed + 53)
    out = []
    for ids in _token_windows(tokenizer, texts, tokens + new_tokens, split_long=False):
        if len(out) == items:
            break
        context = ids[:tokens]
        out.append(
            LongItem(
                "continuation",
                tokenizer.decode(context),
                "",
                {"tokens": tokens, "kind": kind, "context_ids": context, "continuation_ids": ids[tokens:]},
            )
        )
    if len(out) < items:
        raise ValueError(f"The held-out {kind} holds only {len(out)} texts of {tokens + new_tokens} tokens.")
    return out


__all__ = [
    "CHANCE",
    "DEPTHS",
    "HUMANEVAL_CONTEXTS",
    "LONG_TASK_NAMES",
    "LongItem",
    "TooFewContextsError",
    "code_contexts",
    "continuation",
    "humaneval",
    "long_chat",
    "long_doc",
    "problem_index",
]
