"""Tasks that need the whole context, and the one registry of every such family (`CONTEXT_TASKS`): RULER's families
(`lab.real.ruler_tasks`), code completed with names defined across a file (`lab.real.code_tasks`), and two
conversation forms defined here. Each item is a `long_tasks.LongItem` whose prompt is at most `tokens` tokens of the
tokenizer given and within `task_text.LENGTH_TOLERANCE` of it (the filler of real held-out prose binary-searched), a
function of the seed and the item's index only.

- `chat_split` (exact match, chat template): the first turn says where `CHAT_SPLIT_FRIENDS` friends live ("Anna lives
  in Lisbon."); turns of real prose follow; at a depth of the conversation (`meta["depth"]`, 0.4, 0.6 or 0.8 in turn)
  a user turn says which puppy lives in each town ("whoever settled in Lisbon keeps a puppy called Rocket"), in
  another order; more prose, then: "What is the name of Anna's dog?". The question shares no word with that turn.
  Why a sparse prefill of the question's spans fails: the spans the question points at hold the first fact (Anna's
  town) and not the second, which repeats none of the question's words; the answer needs the town read in the first
  turn to find the puppy in the later one, and any of the other three puppies is as likely to a reader of one turn.
- `followups` (exact match, chat template): three user turns at three depths of a long conversation (0, 0.45 and
  0.9 of its prose turns) each name four people of one kind (friends and their towns, colleagues and their colours,
  neighbours and their dogs); the prompt ends with a question about one of them, and `meta["questions"]` holds all
  three (the prompt's first, then two about the other two turns, each with the text to append after the previous
  reply). What it measures is served elsewhere: question 1 through a switch, questions 2 and 3 from the cache that
  switch left. Why a sparse prefill fails there: a prefill of question 1's spans computed one of the three turns;
  questions 2 and 3 ask about the other two, at positions it never computed.
- `code_defs` (pass@1 by executed tests): see `lab.real.code_tasks`.
- `ruler_multikey`, `ruler_multivalue`, `ruler_vt`, `ruler_cwe`, `ruler_fwe` (RULER's `string_match_all`, held to
  the length of the list asked for): see `lab.real.ruler_tasks` (the needle families are its control: there the question's spans hold the answer).

```python
from lab.real.context_tasks import CONTEXT_TASKS, build_items, score

items = build_items("ruler_vt", tokenizer, documents, items=4, tokens=2048, seed=4321)
score(items[0], "They are: " + items[0].answer)   # 1.0
CONTEXT_TASKS["ruler_vt"].max_new                 # 30 tokens to decode
```
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hf_kvmap.real.corpus import Document

from . import code_tasks, ruler_tasks
from .long_tasks import LongItem
from .task_text import COLORS, NAMES, PETS, TOWNS, TextStream, fit_to_length, string_match_listed, token_length

#: friends of a `chat_split` item (the candidates a guess picks from), people of each `followups` turn
CHAT_SPLIT_FRIENDS, FOLLOWUP_PEOPLE = 4, 4
#: where the second fact of `chat_split` sits (item `i` takes `SPLIT_DEPTHS[i % 3]`), the turns of `followups`
SPLIT_DEPTHS, FOLLOWUP_DEPTHS = (0.4, 0.6, 0.8), (0.0, 0.45, 0.9)
#: tokens of held-out prose per filler turn
PASSAGE_TOKENS = 160
CHAT_SPLIT_QUESTION = "What is the name of {name}'s dog? Reply with the name only."
_PASSAGE_TURN = "Here is a passage I am reading:\n\n"


class UnknownTaskError(ValueError):
    """A task name that `CONTEXT_TASKS` does not hold."""


def exact_match(item: LongItem, reply: str) -> float:
    """1.0 where the reply is the item's answer, whatever its case and a closing full stop (`Ochre.` for `ochre`: the
    candidates of an item differ in more than case), else 0.0."""
    return float(reply.strip().rstrip(".").strip().lower() == item.answer.strip().lower())


def references_found(item: LongItem, reply: str) -> float:
    """RULER's `string_match_all` of the reply against `item.meta["references"]`, held to the length of the list asked
    for (`task_text.string_match_listed`: a reply that copies every candidate scores its precision)."""
    return string_match_listed(reply, item.meta["references"])


def _filler_turns(stream: TextStream, start: int, count: int) -> list[dict]:
    """`count` tokens of held-out prose from `start` as pairs of turns (a passage the user shares, then a passage the
    assistant answers with), `PASSAGE_TOKENS` per turn; the last pair splits what is left in two."""
    turns = []
    for at in range(0, count, 2 * PASSAGE_TOKENS):
        size = min(2 * PASSAGE_TOKENS, count - at)
        half = max(1, size // 2)
        turns.append({"role": "user", "content": _PASSAGE_TURN + stream.text(start + at, half)})
        turns.append({"role": "assistant", "content": stream.text(start + at + half, size - half) or "I see."})
    return turns


def _with_turns(filler: list[dict], planted: Sequence[tuple[float, list[dict]]]) -> list[dict]:
    """`filler` (pairs of turns) with each `(share, turns)` inserted between pairs, near that share of them."""
    pairs = [filler[i : i + 2] for i in range(0, len(filler), 2)]
    out: list[dict] = []
    slots = sorted((round(share * len(pairs)), order) for order, (share, _) in enumerate(planted))
    taken = 0
    for slot, order in slots:
        out += [turn for pair in pairs[taken:slot] for turn in pair] + planted[order][1]
        taken = max(taken, slot)
    return out + [turn for pair in pairs[taken:] for turn in pair]


def _chat(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def chat_split(tokenizer, documents: Sequence[Document], items: int, tokens: int = 2048, seed: int = 1234):
    """Conversations whose question needs two facts from two turns far apart (module docstring).

    Args:
        tokenizer: the tokenizer lengths are counted in (with a chat template).
        documents (`list[Document]`): the corpus manifest (`hf_kvmap.real.corpus.load_manifest`); its held-out prose
            fills the turns between the facts.
        items (`int`): how many items.
        tokens (`int`, *optional*, defaults to 2048): the prompt length (at most, within `LENGTH_TOLERANCE`).
        seed (`int`, *optional*, defaults to 1234): fixes the names, towns, pets and the prose read.

    Returns:
        `list[LongItem]`: `answer` the asked friend's puppy; `meta`: `tokens`, `depth`, `friend`, `town`,
        `second_fact` (the text of the turn the answer is in).
    """
    stream = TextStream(tokenizer, documents, "prose", seed + 109)
    return [_chat_split_item(tokenizer, stream, tokens, seed, index) for index in range(items)]


def _chat_split_item(tokenizer, stream: TextStream, tokens: int, seed: int, index: int) -> LongItem:
    rng = random.Random(f"{seed}-chat-split-{tokens}-{index}")
    friends = rng.sample(NAMES, CHAT_SPLIT_FRIENDS)
    towns, pets = rng.sample(TOWNS, CHAT_SPLIT_FRIENDS), rng.sample(PETS, CHAT_SPLIT_FRIENDS)
    asked, depth = rng.randrange(CHAT_SPLIT_FRIENDS), SPLIT_DEPTHS[index % len(SPLIT_DEPTHS)]
    first = " ".join(f"{friend} lives in {town}." for friend, town in zip(friends, towns))
    order = rng.sample(range(CHAT_SPLIT_FRIENDS), CHAT_SPLIT_FRIENDS)
    second = "Quick update about pets: " + "; ".join(
        f"whoever settled in {towns[i]} keeps a puppy called {pets[i]}" for i in order
    )
    opening = [
        {"role": "user", "content": f"Some news about my friends, please remember it. {first}"},
        {"role": "assistant", "content": "Thanks, I will remember where your friends live."},
    ]
    planted = [(depth, [{"role": "user", "content": second + "."}, _SECOND_ACK])]
    question = {"role": "user", "content": CHAT_SPLIT_QUESTION.format(name=friends[asked])}

    def make(n: int) -> str:
        return _chat(tokenizer, opening + _with_turns(_filler_turns(stream, index * tokens, n), planted) + [question])

    prompt, _ = fit_to_length(make, tokenizer, tokens, tokens)
    meta = {"tokens": token_length(tokenizer, prompt), "depth": depth, "friend": friends[asked]}
    meta.update(town=towns[asked], second_fact=second + ".")
    return LongItem("chat_split", prompt, pets[asked], meta)


_SECOND_ACK = {"role": "assistant", "content": "Lovely, puppies make every home brighter."}
#: the three kinds of `followups` turn: (who, statement, question, the values)
_FOLLOWUP_KINDS = (
    ("friends", "My friend {name} lives in {value}.", "In which town does my friend {name} live? Reply with the town "
     "only.", TOWNS),
    ("colleagues", "My colleague {name} likes the colour {value} best.", "Which colour does my colleague {name} like "
     "best? Reply with the colour only.", COLORS),
    ("neighbours", "My neighbour {name} has a dog called {value}.", "What is the name of the dog of my neighbour "
     "{name}? Reply with the name only.", PETS),
)  # fmt: skip


def _appended(tokenizer, history: list[dict], reply: str, question: dict) -> str:
    """The text a conversation rendered up to `history`'s next reply gets after `reply`: the end of the assistant's
    turn and `question`'s user turn, ready for the next reply (what the chat template renders there)."""
    before = _chat(tokenizer, history) + reply
    after = _chat(tokenizer, [*history, {"role": "assistant", "content": reply}, question])
    if not after.startswith(before):
        raise ValueError(
            "This tokenizer's chat template renders a conversation's earlier turns differently once it goes on, so no "
            "text can be appended to serve a follow-up question from the cache; use a template that keeps them."
        )
    return after[len(before) :]


def followups(tokenizer, documents: Sequence[Document], items: int, tokens: int = 2048, seed: int = 1234):
    """Long conversations with three fact turns at `FOLLOWUP_DEPTHS` and three questions, one about each (module
    docstring). Arguments as for `chat_split`; `tokens` counts the prompt (up to question 1).

    Returns:
        `list[LongItem]`: `answer` question 1's; `meta["questions"]`: three dicts, question 1 first, each with
        `question`, `answer`, `turn` (which fact turn, 0-2 in the conversation's order), `depth` and, for questions 2
        and 3, `append` (the text to append after the previous reply to ask it, ready for the next reply).
    """
    stream = TextStream(tokenizer, documents, "prose", seed + 113)
    return [_followups_item(tokenizer, stream, tokens, seed, index) for index in range(items)]


def _followups_item(tokenizer, stream: TextStream, tokens: int, seed: int, index: int) -> LongItem:
    rng = random.Random(f"{seed}-followups-{tokens}-{index}")
    names = iter(rng.sample(NAMES, FOLLOWUP_PEOPLE * len(_FOLLOWUP_KINDS)))
    kinds = rng.sample(_FOLLOWUP_KINDS, len(_FOLLOWUP_KINDS))  # which kind of turn sits at which depth
    planted, asked = [], []
    for turn, ((who, statement, question, values), depth) in enumerate(zip(kinds, FOLLOWUP_DEPTHS)):
        people = [next(names) for _ in range(FOLLOWUP_PEOPLE)]
        chosen = rng.sample(values, FOLLOWUP_PEOPLE)
        text = f"Let me tell you about my {who}. " + " ".join(
            statement.format(name=name, value=value) for name, value in zip(people, chosen)
        )
        reply = {"role": "assistant", "content": f"Thanks, I will remember your {who}."}
        planted.append((depth, [{"role": "user", "content": text}, reply]))
        one = rng.randrange(FOLLOWUP_PEOPLE)
        asked.append({"question": question.format(name=people[one]), "answer": chosen[one], "turn": turn})
        asked[-1]["depth"] = depth
    asked = rng.sample(asked, len(asked))
    first = {"role": "user", "content": asked[0]["question"]}

    def conversation(n: int) -> list[dict]:
        turns = _with_turns(_filler_turns(stream, index * tokens, n), planted[1:])
        return [*planted[0][1], *turns, first]  # the first fact turn opens the conversation

    prompt, n = fit_to_length(lambda n: _chat(tokenizer, conversation(n)), tokenizer, tokens, tokens)
    history = conversation(n)
    for previous, following in zip(asked, asked[1:]):
        turn = {"role": "user", "content": following["question"]}
        following["append"] = _appended(tokenizer, history, previous["answer"], turn)
        history += [{"role": "assistant", "content": previous["answer"]}, turn]
    meta = {"tokens": token_length(tokenizer, prompt), "questions": asked}
    return LongItem("followups", prompt, asked[0]["answer"], meta)


@dataclass(frozen=True)
class ContextTask:
    """One family of whole-context tasks, as a benchmark serves it.

    Args:
        name (`str`): the family's name (what `--tasks` takes).
        build (`Callable`): `(tokenizer, documents, items, tokens, seed) -> list[LongItem]`.
        score (`Callable`): `(item, reply) -> float` in [0, 1].
        chance (`float`): the score of a guess (the floor that retention is normalized at).
        max_new (`int`): tokens a reply may take.
        code (`bool`, *optional*, defaults to `False`): the prompt is code that the model continues (a reply ends at
            `humaneval.STOP_SEQUENCES`), not a chat turn (ends at the end of the assistant's turn).
    """

    name: str
    build: Callable[..., list[LongItem]]
    score: Callable[[LongItem, str], float]
    chance: float
    max_new: int
    code: bool = False


CONTEXT_TASKS = {
    task.name: task
    for task in (
        ContextTask("ruler_multikey", ruler_tasks.ruler_multikey, references_found, ruler_tasks.CHANCE["ruler_multikey"], 16),
        ContextTask("ruler_multivalue", ruler_tasks.ruler_multivalue, references_found, 0.0, 48),
        ContextTask("ruler_vt", ruler_tasks.ruler_vt, references_found, 0.0, 30),
        ContextTask("ruler_cwe", ruler_tasks.ruler_cwe, references_found, 0.0, 120),
        ContextTask("ruler_fwe", ruler_tasks.ruler_fwe, references_found, ruler_tasks.CHANCE["ruler_fwe"], 50),
        ContextTask("chat_split", chat_split, exact_match, 1 / CHAT_SPLIT_FRIENDS, 12),
        ContextTask("followups", followups, exact_match, 1 / FOLLOWUP_PEOPLE, 12),
        ContextTask("code_defs", code_tasks.code_defs, code_tasks.passes_tests, 0.0, 320, code=True),
    )
}  # fmt: skip
CONTEXT_TASK_NAMES = tuple(CONTEXT_TASKS)
#: each family's floor (`ContextTask.chance`), as `long_tasks.CHANCE` gives the long tasks'
CHANCE = {name: task.chance for name, task in CONTEXT_TASKS.items()}


def _task(name: str) -> ContextTask:
    if name not in CONTEXT_TASKS:
        raise UnknownTaskError(f"Unknown whole-context task {name!r}; known: {', '.join(CONTEXT_TASK_NAMES)}.")
    return CONTEXT_TASKS[name]


def build_items(
    name: str, tokenizer, documents: Sequence[Document], items: int, tokens: int = 2048, seed: int = 1234
) -> list[LongItem]:
    """`items` items of the family `name` (a key of `CONTEXT_TASKS`) at `tokens` tokens, fixed by `seed`.

    Raises:
        `UnknownTaskError`: `name` is not a family of `CONTEXT_TASKS`.
        `task_text.TaskLengthError`: the items cannot be fitted to `tokens` (the message says what to change).
    """
    return _task(name).build(tokenizer, documents, items, tokens, seed)


def score(item: LongItem, reply: str) -> float:
    """The score in [0, 1] of `reply` on `item`, by its family's rule (`CONTEXT_TASKS[item.task].score`)."""
    return float(_task(item.task).score(item, reply))


__all__ = [
    "CHANCE",
    "CHAT_SPLIT_FRIENDS",
    "CHAT_SPLIT_QUESTION",
    "CONTEXT_TASKS",
    "CONTEXT_TASK_NAMES",
    "FOLLOWUP_DEPTHS",
    "FOLLOWUP_PEOPLE",
    "PASSAGE_TOKENS",
    "SPLIT_DEPTHS",
    "ContextTask",
    "UnknownTaskError",
    "build_items",
    "chat_split",
    "exact_match",
    "followups",
    "references_found",
    "score",
]
