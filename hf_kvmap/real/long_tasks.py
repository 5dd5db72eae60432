"""Tasks at serving lengths (2K-4K tokens) where the larger model of a pair should answer better than the smaller,
built from the held-out split of the real corpus (`hf_kvmap.real.corpus`) and HumanEval (`hf_kvmap.real.humaneval`).

- `long_chat` (exact match, chat template, multi-turn): the first user turn introduces four friends, each with a
  home town and a dog; turns of real prose (a passage the user shares, a passage the assistant answers with) follow
  until the conversation reaches `tokens`; the last turn asks for the dog of the friend from one town (two facts
  combined, among similar facts).
- `long_doc` (exact match, chat template): a long document of real prose with six planted registration numbers of
  similarly named subjects at evenly spaced depths; the question asks for the number at one of `DEPTHS` (recorded
  per item as `depth`).
- `humaneval` (pass@1 by the problem's tests): a HumanEval prompt, bare (`tokens=0`) or behind `tokens` tokens of
  real held-out Python code (whole lines), as a long coding session would have it.
- `continuation` (agreement and NLL): `tokens` tokens of held-out code or prose, and the `new_tokens` real tokens
  that follow; scored by the agreement of a greedy continuation with the target's own and by the NLL of the real
  text.

Everything but the planted facts, questions and names is real text; a seed fixes what is generated.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from .corpus import Document, code_texts, prose_texts
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


def humaneval(
    tokenizer, documents, problems: Sequence[dict], tokens: int = 0, seed: int = 1234, items: int | None = None
) -> list[LongItem]:
    """HumanEval prompts, bare (`tokens=0`) or each behind its own `tokens`-token window of held-out code (whole
    lines, then two blank lines). `problems` from `humaneval.humaneval_problems()`; `items` takes the first ones."""
    chosen = list(problems)[:items] if items is not None else list(problems)
    windows = _token_windows(tokenizer, code_texts(documents, "heldout", seed + 41), tokens) if tokens else None
    out = []
    for problem in chosen:
        context = ""
        if windows is not None:
            try:
                context = _whole_lines(tokenizer.decode(next(windows))).rstrip() + "\n\n\n"
            except StopIteration:
                raise ValueError("The held-out code ran out; build fewer or shorter items.") from None
        prompt = context + problem["prompt"]
        meta = {"task_id": problem["task_id"], "tokens": _length(tokenizer, prompt), "context_tokens": tokens}
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


__all__ = ["CHANCE", "DEPTHS", "LONG_TASK_NAMES", "LongItem", "continuation", "humaneval", "long_chat", "long_doc"]
