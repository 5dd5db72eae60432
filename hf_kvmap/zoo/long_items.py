"""Long forms of the tiny family's recall and chat tasks: a long prompt of the family's own filler, one fact stated in
it, and the question about that fact last, at a prompt length asked in tokens (`hf-kvmap demo`'s long rows).

* ``recall`` -- the fact ``xk045`` is one line; recall lines of other keys fill the rest (facts, and questions about
  those facts answered inline, as in the training text); the prompt ends with ``?xk``; the answer is ``045``.
* ``chat``   -- one exchange states the fact (``<|user|>xk045<|assistant|>ok<|end|>``); exchanges of the chat task
  fill the rest (other facts, questions about them, additions, a story); the last user turn asks ``?xk``.

Where the fact stands is asked too: first (``reach=None``), or ``reach`` tokens from the prompt's end (the fact, the
filler after it and the question), the filler before it. The fact's key is stated and asked nowhere else, so the answer
can only be read from the fact itself. Every item is built from the ``eval`` seed stream of
:mod:`hf_kvmap.zoo.corpus` (under its own task name, so no short evaluation item is repeated), and the same
``(task, n, length, seed, reach)`` always gives the same items. A prompt is at most ``length`` tokens and short of it by
fewer than :data:`MAX_SHORTFALL` tokens; the part from the fact on is at most ``reach`` tokens and short of it by as
few.

Importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from . import corpus

__all__ = ["LONG_TASKS", "MAX_SHORTFALL", "MIN_LENGTH", "LongItem", "make_long_set", "token_count"]

LONG_TASKS = ("recall", "chat")
#: a prompt (and the part from its fact on) ends fewer tokens than this short of the length asked: the last piece that
#: still fits is a filler fact, a recall line ``ab123`` and its newline (6 tokens), or a chat exchange
#: ``<|user|>ab123<|assistant|>ok<|end|>`` (10)
MAX_SHORTFALL = {"recall": 6, "chat": 10}
#: the shortest length (and reach) a long item is built at: the fact, a few filler pieces and the question
MIN_LENGTH = 32


@dataclass(frozen=True)
class LongItem:
    """One long item: ``context`` (the prompt) and its exact ``answer`` (then ``stop``).

    ``fact`` is the stated fact (``xk045``) and ``key`` its key; the fact's first token is token ``fact_position`` of
    the prompt (BOS is token 0); ``tokens`` is the prompt's token count (BOS included), ``length`` the length asked."""

    context: str
    answer: str
    stop: str
    key: str
    fact: str
    fact_position: int
    tokens: int
    length: int


def token_count(text: str) -> int:
    """Tokens of `text` under the family's character-level tokenizer: one per character, one per chat marker, and the
    BOS it prepends (`tests/test_demo_long.py` checks it against the tokenizer on every item)."""
    return 1 + len(text) - sum((len(marker) - 1) * text.count(marker) for marker in corpus.CHAT_MARKERS)


class _Filler:
    """The filler of one item: pieces of the task's own text about facts other than the asked one."""

    def __init__(self, r: random.Random, task: str, key: str):
        self.r, self.task = r, task
        self.pool = [fact for fact in corpus._facts(r, 401) if fact[0] != key][:400]
        self.stated: list[tuple[str, str]] = []
        self.story: list[tuple[str, str, str]] = []

    def _fact(self, commit: bool) -> tuple[str, str]:
        k, v = self.pool.pop() if commit else self.pool[-1]
        if commit:
            self.stated.append((k, v))
        return k, v

    def _piece(self) -> tuple[str, bool]:
        """`(text, states a new fact)` of one piece (a recall line, or a chat exchange formatted)."""
        r, u = self.r, self.r.random()
        if self.task == "recall":
            if len(self.stated) < 3 or u < 0.45:
                return "".join(self.pool[-1]) + "\n", True
            return "?" + "".join(r.choice(self.stated)) + "\n", False
        if not self.stated or u < 0.3:
            k, v = self.pool[-1]
            return corpus.format_chat([("user", f"{k}{v}"), ("assistant", "ok")]), True
        if u < 0.6:
            k, v = r.choice(self.stated)
            return corpus.format_chat([("user", f"?{k}"), ("assistant", v)]), False
        if u < 0.8:
            a, b = corpus._addition(r)
            return corpus.format_chat([("user", f"{a}+{b}="), ("assistant", str(a + b))]), False
        if not self.story:
            self.story += corpus._story(r, 3)
            return corpus.format_chat([("user", corpus._story_text(self.story)), ("assistant", "ok")]), False
        name, color, thing = r.choice(self.story)
        return corpus.format_chat([("user", f"what does {name} have?"), ("assistant", f"a {color} {thing}.")]), False

    def fill(self, budget: int) -> str:
        """Pieces of at most `budget` tokens in all, short of it by fewer than `MAX_SHORTFALL[task]`: a piece that does
        not fit gives way to a filler fact (the smallest piece), and the filling ends when none fits either."""
        pieces = []
        while True:
            text, new = self._piece()
            size = token_count(text) - 1
            if size > budget:
                k, v = self.pool[-1]
                text = (
                    f"{k}{v}\n"
                    if self.task == "recall"
                    else corpus.format_chat([("user", k + v), ("assistant", "ok")])
                )
                size, new = token_count(text) - 1, True
                if size > budget:
                    return "".join(pieces)
            if new:
                self._fact(commit=True)
            pieces.append(text)
            budget -= size


def _item(task: str, r: random.Random, length: int, reach: int | None) -> LongItem:
    key, value = corpus._facts(r, 1)[0]
    fact = f"{key}{value}"
    if task == "recall":
        stated, question, stop = fact + "\n", f"?{key}", "\n"
    else:
        stated = corpus.format_chat([("user", fact), ("assistant", "ok")])
        question, stop = corpus.format_chat([("user", f"?{key}")], add_generation_prompt=True), corpus.END
    filler = _Filler(r, task, key)
    fixed = token_count(stated + question) - 1  # the fact's piece and the question (BOS not counted)
    after = filler.fill((length - 1 if reach is None else reach) - fixed)
    before = ""
    if reach is not None:  # its own facts (the pool keeps every key distinct), none asked before it is stated
        filler.stated, filler.story = [], []
        before = filler.fill(length - 1 - (token_count(stated + after + question) - 1))
    context = before + stated + after + question
    offset = len(corpus.USER) if task == "chat" else 0
    position = token_count(before) + (1 if task == "chat" else 0)  # BOS, the filler before, `<|user|>` for chat
    if not context[len(before) + offset :].startswith(fact):
        raise RuntimeError("the fact is not where it was placed (a bug in hf_kvmap.zoo.long_items)")
    return LongItem(context, value, stop, key, fact, position, token_count(context), length)


def make_long_set(task: str, n: int, length: int, seed: int = 1234, reach: int | None = None) -> list[LongItem]:
    """`n` long items of `task` (one of :data:`LONG_TASKS`): prompts of at most `length` tokens (short of it by fewer
    than :data:`MAX_SHORTFALL`), one fact stated in the filler and the question about it last.

    Args:
        task (`str`): `"recall"` or `"chat"`.
        n (`int`): how many items.
        length (`int`): the prompt length asked, in tokens (BOS included), at least :data:`MIN_LENGTH`.
        seed (`int`, *optional*, defaults to 1234): the evaluation seed.
        reach (`int`, *optional*): the tokens from the fact's first token to the prompt's end (the question included),
            from :data:`MIN_LENGTH` to `length - 1`; `None` states the fact first.

    >>> item = make_long_set("recall", 1, 256)[0]
    >>> item.context.startswith(item.fact) and item.context.endswith("?" + item.key) and item.tokens <= 256
    True
    """
    if task not in LONG_TASKS:
        raise ValueError(f"task={task!r} has no long form; give one of {LONG_TASKS}.")
    if isinstance(length, bool) or not isinstance(length, int) or length < MIN_LENGTH:
        raise ValueError(f"length={length!r}: give a prompt length of at least {MIN_LENGTH} tokens.")
    if reach is not None and (
        isinstance(reach, bool) or not isinstance(reach, int) or not MIN_LENGTH <= reach < length
    ):
        raise ValueError(
            f"reach={reach!r}: give the tokens from the fact to the prompt's end, from {MIN_LENGTH} to length - 1 "
            f"({length - 1}), or None to state the fact first."
        )
    where = "first" if reach is None else reach
    return [_item(task, corpus._rng("eval", seed, f"long_{task}", i, length, where), length, reach) for i in range(n)]
