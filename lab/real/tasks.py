"""Real-family tasks built from the held-out split of the real corpus (`hf_kvmap.real.corpus`).

Five tasks, scored three ways by `hf_kvmap.evaluation` (source alone, target alone, handoff):

- `prose_retrieval` (exact match, chat template): a held-out prose passage with one planted sentence that gives a
  registration number; the user asks for the number.
- `chat_recall` (exact match, chat template, multi-turn): the user states a fact in the first turn, two turns of
  real prose follow, then the user asks for the fact.
- `code_recall` (choice among 4, chance 0.25): a held-out Python chunk that defines a function; the continuation
  calls one of four names, only one of which was defined above.
- `code_nll` and `prose_ppl` (perplexity): the first half of a held-out chunk is the context, the second is scored.

The text is real; only the planted fact, the questions and the distractor choice are generated, from a seed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from hf_kvmap.evaluation import TaskSpec
from hf_kvmap.real.corpus import Document, code_texts, prose_texts

TASK_NAMES = ("prose_retrieval", "chat_recall", "code_recall", "code_nll", "prose_ppl")

_ADJECTIVES = ("amber", "silent", "northern", "copper", "hollow", "bright", "quiet", "velvet", "frozen", "golden")
_NOUNS = ("harbor", "lantern", "orchard", "compass", "glacier", "meadow", "violin", "beacon", "canyon", "falcon")
_FACTS = {
    "favorite color": ("teal", "crimson", "olive", "maroon", "indigo", "beige", "scarlet", "turquoise"),
    "home town": ("Lisbon", "Oslo", "Nairobi", "Kyoto", "Denver", "Krakow", "Lima", "Dublin"),
    "dog's name": ("Biscuit", "Pepper", "Rocket", "Mango", "Ziggy", "Waffles", "Juniper", "Pickle"),
}


@dataclass(frozen=True)
class PromptItem:
    """An exact-match item: a prompt (already rendered with the chat template) and its answer."""

    prompt: str
    answer: str


@dataclass(frozen=True)
class ChoiceItem:
    context: str
    choices: tuple
    label: int


@dataclass(frozen=True)
class TextItem:
    text: str


def _passages(
    tokenizer, documents, tokens: int, seed: int, kind: str, per_file: int = 1, split: str = "heldout"
) -> list[str]:
    """Passages of `tokens` tokens of one split (up to `per_file` consecutive windows per file), in a fixed order."""
    texts = prose_texts(documents, split, seed) if kind == "prose" else code_texts(documents, split, seed)
    found = []
    for text in texts:
        ids = tokenizer(text.strip(), add_special_tokens=False)["input_ids"]
        for start in range(0, min(len(ids) - tokens + 1, per_file * tokens), tokens):
            found.append(tokenizer.decode(ids[start : start + tokens]))
    return found


def _whole_lines(code: str) -> str:
    """Cut a clipped code chunk back to whole lines outside any triple-quoted string."""
    lines = code.split("\n")[:-1]  # the last line may be cut mid-token
    while lines and any("\n".join(lines).count(quote) % 2 for quote in ('"""', "'''")):
        lines.pop()
    return "\n".join(lines)


def _chat(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prose_retrieval(
    tokenizer, documents, items: int, tokens: int = 150, seed: int = 1234, split: str = "heldout"
) -> list[PromptItem]:
    """Retrieval items (see the module docstring); `split="calibration"` builds training items from the other files."""
    rng = random.Random(f"{seed}-retrieval")
    passages = _passages(tokenizer, documents, tokens, seed, "prose", split=split)
    out = []
    for index in range(items):
        passage = passages[index % len(passages)]
        subject = f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
        number = str(rng.randint(10000, 99999))
        sentences = re.split(r"(?<=[.!?])\s+", passage)
        at = rng.randint(1, max(1, len(sentences) - 1))
        planted = f"The registration number of the {subject} is {number}."
        text = " ".join(sentences[:at] + [planted] + sentences[at:])
        question = f"{text}\n\nWhat is the registration number of the {subject}? Reply with the number only."
        out.append(PromptItem(_chat(tokenizer, [{"role": "user", "content": question}]), number))
    return out


def chat_recall(
    tokenizer, documents, items: int, tokens: int = 45, seed: int = 1234, split: str = "heldout"
) -> list[PromptItem]:
    """Chat-recall items (see the module docstring); `split` as for `prose_retrieval`."""
    rng = random.Random(f"{seed}-chat")
    passages = _passages(tokenizer, documents, tokens, seed + 7, "prose", split=split)
    out = []
    for index in range(items):
        fact = rng.choice(sorted(_FACTS))
        value = rng.choice(_FACTS[fact])
        a, b, c, d = (passages[(4 * index + j) % len(passages)] for j in range(4))
        messages = [
            {"role": "user", "content": f"Please remember this: my {fact} is {value}."},
            {"role": "assistant", "content": f"Understood, your {fact} is {value}."},
            {"role": "user", "content": f"Here is a passage I am reading:\n\n{a}"},
            {"role": "assistant", "content": b},
            {"role": "user", "content": f"And another one:\n\n{c}"},
            {"role": "assistant", "content": d},
            {"role": "user", "content": f"What is my {fact}? Reply with the answer only."},
        ]
        out.append(PromptItem(_chat(tokenizer, messages), value))
    return out


_DEF = re.compile(r"^\s*def ([A-Za-z][A-Za-z0-9_]{5,})\(", re.M)  # no dunder or private names


def code_recall(tokenizer, documents, items: int, tokens: int = 160, seed: int = 1234) -> list[ChoiceItem]:
    rng = random.Random(f"{seed}-code-recall")
    chunks = [_whole_lines(chunk) for chunk in _passages(tokenizer, documents, tokens, seed, "code", per_file=8)]
    names = [sorted(set(_DEF.findall(chunk))) for chunk in chunks]
    pool = sorted({name for found in names for name in found})
    out = []
    for chunk, defined in zip(chunks, names):
        if len(out) == items:
            break
        if not defined:
            continue
        name = rng.choice(defined)
        others = [n for n in pool if n not in chunk]
        if len(others) < 3:
            raise ValueError("The held-out code defines too few distinct function names for 3 distractors.")
        distractors = rng.sample(others, 3)
        choices = [name, *distractors]
        rng.shuffle(choices)
        context = chunk.rstrip() + "\n\n\n# the function defined above, once more:\nresult = "
        out.append(ChoiceItem(context, tuple(c + "(" for c in choices), choices.index(name)))
    return out


def texts(tokenizer, documents, items: int, kind: str, tokens: int = 192, seed: int = 1234) -> list[TextItem]:
    passages = _passages(tokenizer, documents, tokens, seed + 11, kind)
    return [TextItem(p) for p in passages[:items]]


def real_family_tasks(
    tokenizer, documents: Sequence[Document], items: int = 20, seed: int = 1234, names: Sequence[str] = TASK_NAMES
) -> list[TaskSpec]:
    """The five tasks as `hf_kvmap.evaluation.TaskSpec`s (exact-match ones stop at the chat end-of-turn token).

    Args:
        tokenizer: the family's tokenizer (with a chat template).
        documents (`list[Document]`): the corpus manifest (`load_manifest`); only its held-out split is used.
        items (`int`, *optional*, defaults to 20): items per task (fewer where the held-out split runs out).
        seed (`int`, *optional*, defaults to 1234): fixes the planted facts and distractors.
        names (`list[str]`, *optional*): a subset of `TASK_NAMES`.
    """
    stop = tokenizer.eos_token or ""
    build = {
        "prose_retrieval": lambda: TaskSpec(
            "prose_retrieval", "exact_match", prose_retrieval(tokenizer, documents, items, seed=seed), stop=stop
        ),
        "chat_recall": lambda: TaskSpec(
            "chat_recall", "exact_match", chat_recall(tokenizer, documents, items, seed=seed), stop=stop
        ),
        "code_recall": lambda: TaskSpec(
            "code_recall", "choice", code_recall(tokenizer, documents, items, seed=seed), chance=0.25
        ),
        "code_nll": lambda: TaskSpec("code_nll", "perplexity", texts(tokenizer, documents, items, "code", seed=seed)),
        "prose_ppl": lambda: TaskSpec(
            "prose_ppl", "perplexity", texts(tokenizer, documents, items, "prose", seed=seed)
        ),
    }
    unknown = [name for name in names if name not in build]
    if unknown:
        raise ValueError(f"Unknown real-family tasks {unknown}; known: {TASK_NAMES}.")
    return [build[name]() for name in names]


# How each task is scored and its chance level (the fields `hf_kvmap.evaluation.evaluate_tasks` records per task).
TASK_META = {
    "prose_retrieval": {"task_type": "exact_match", "chance": 0.0},
    "chat_recall": {"task_type": "exact_match", "chance": 0.0},
    "code_recall": {"task_type": "choice", "chance": 0.25},
    "code_nll": {"task_type": "perplexity", "chance": None},
    "prose_ppl": {"task_type": "perplexity", "chance": None},
}
