"""Deterministic, seeded generator of the tiny family's corpus (pure Python, no downloads).

Task shapes mirror the paper's evaluation suite at toy scale:

* ``recall``     -- key-value lines (``xk045``: a 2-letter key directly followed by a 3-digit value), later
                    questions ``?xk`` whose answer is the value stated earlier (long-context fact recall;
                    exact match of the generated value).
* ``arithmetic`` -- few-shot additions of 1-3 digit numbers ``23+456=479``; answered by generation (GSM8K
                    analogue, exact match; the answer is followed by a newline).
* ``choice``     -- a short story (``mia has a blue hat.``) and the prefix ``so mia has a``; four
                    continuations scored by log-likelihood (HellaSwag/ARC analogue, chance 25 %).
* ``text``       -- plain running text from a small grammar (perplexity).
* ``chat``       -- conversations with ``<|user|>`` / ``<|assistant|>`` turns ending in ``<|end|>``, mixing
                    the tasks above, so a conversation can be handed between models mid-way.

Training text also holds ``copy`` documents (random strings repeated later), which give tiny models the
dense copying signal they need to form induction heads.

Every function takes an explicit integer seed; the same arguments always give the same text.
Training text and evaluation items come from disjoint seed streams (see :func:`_rng`).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

__all__ = [
    "ALPHABET",
    "CHAT_MARKERS",
    "SPECIAL_TOKENS",
    "TASKS",
    "ArithmeticItem",
    "ChatItem",
    "ChoiceItem",
    "RecallItem",
    "TextItem",
    "calibration_text",
    "format_chat",
    "make_conversation",
    "make_document",
    "make_eval_set",
    "training_documents",
    "training_text",
]

USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"
CHAT_MARKERS = (USER, ASSISTANT, END)
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

#: every character the generator can emit (the tokenizer's base vocabulary)
ALPHABET = "\n !',-.:;=?+" + "0123456789" + "abcdefghijklmnopqrstuvwxyz"

TASKS = ("recall", "arithmetic", "choice", "text", "chat")

# ---------------------------------------------------------------------------------------------- seeds

_STREAMS = {"train": 1, "eval": 2, "calib": 3, "misc": 4}


def _rng(stream: str, seed: int, *parts) -> random.Random:
    """Independent RNG per (stream, seed, parts): train/eval/calibration never share a seed stream."""
    key = "|".join([stream, str(int(seed))] + [str(p) for p in parts])
    digest = hashlib.sha256(key.encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


# ------------------------------------------------------------------------------------------ vocab bits

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
# names end in distinct letters, so the last character identifies the name
NAMES = [
    "mia",
    "bob",
    "ted",
    "joe",
    "raj",
    "zak",
    "bil",
    "tom",
    "ann",
    "leo",
    "kip",
    "dar",
    "gus",
    "kat",
    "lev",
    "max",
    "amy",
    "liz",
    "ali",
    "jeh",
]
COLORS = ["red", "blue", "green", "pink", "black", "white", "gray", "gold", "brown", "orange"]
OBJECTS = [
    "hat",
    "cup",
    "box",
    "pen",
    "bag",
    "car",
    "kite",
    "lamp",
    "ring",
    "sock",
    "book",
    "fan",
    "key",
    "drum",
    "bell",
]

_DET = ["the", "a", "one", "that", "this"]
_ADJ = ["small", "big", "old", "young", "quiet", "happy", "tired", "brave", "red", "green", "dark", "bright"]
_NOUN_AN = ["dog", "cat", "bird", "fox", "horse", "child", "man", "woman", "farmer", "king", "girl", "boy"]
_NOUN_PL = ["river", "tree", "house", "hill", "road", "garden", "field", "door", "table", "window", "boat", "bridge"]
_VERB_I = ["sleeps", "sings", "runs", "waits", "smiles", "walks", "rests", "jumps", "laughs", "sits"]
_VERB_T = ["sees", "likes", "finds", "follows", "watches", "helps", "hears", "calls", "meets", "greets"]
_PREP = ["near", "under", "behind", "by", "in", "on", "over", "past"]
_TIME = ["today", "at night", "in the morning", "after lunch", "again", "every day", "once more"]
_CONJ = ["and then", "but", "so", "while", "because"]


# --------------------------------------------------------------------------------------------- items


@dataclass(frozen=True)
class RecallItem:
    """``context`` ends with ``?key``; the exact answer is the 3-digit ``answer`` stated earlier (``key+answer``)."""

    context: str
    answer: str
    key: str = ""


@dataclass(frozen=True)
class ArithmeticItem:
    """``prompt`` ends with ``a+b=``; generation must produce exactly ``answer`` (then ``stop``, a newline)."""

    prompt: str
    answer: str
    stop: str = "\n"


@dataclass(frozen=True)
class ChoiceItem:
    """Score each ``context + choices[i]`` by log-likelihood; ``label`` indexes the right one."""

    context: str
    choices: list[str]
    label: int


@dataclass(frozen=True)
class TextItem:
    """Plain running text for perplexity."""

    text: str


@dataclass(frozen=True)
class ChatItem:
    """A multi-turn conversation cut before the last assistant answer.

    ``context`` is the formatted conversation ending with ``<|assistant|>``; the assistant must generate
    ``answer`` (then ``<|end|>``). ``turns`` holds the (role, text) turns of ``context``.
    """

    context: str
    answer: str
    turns: list[tuple[str, str]] = field(default_factory=list)
    question: str = ""  # what the final user turn asks about: recall or arithmetic


# ------------------------------------------------------------------------------------ task primitives


def _key(r: random.Random) -> str:
    return r.choice(_LETTERS) + r.choice(_LETTERS)


def _value(r: random.Random) -> str:
    return f"{r.randrange(1000):03d}"


def _facts(r: random.Random, n: int) -> list[tuple[str, str]]:
    keys: list[str] = []
    while len(keys) < n:
        k = _key(r)
        if k not in keys:
            keys.append(k)
    return [(k, _value(r)) for k in keys]


def _recall_lines(r: random.Random, n_chars: int) -> list[str]:
    """Facts interleaved with questions about facts stated earlier (dense copying signal)."""
    lines: list[str] = []
    facts: list[tuple[str, str]] = []
    pool = _facts(r, 40)
    size = 0
    while size < n_chars:
        if pool and (len(facts) < 3 or r.random() < 0.45):
            k, v = pool.pop()
            facts.append((k, v))
            line = f"{k}{v}"
        else:
            k, v = r.choice(facts)
            line = f"?{k}{v}"
        lines.append(line)
        size += len(line) + 1
    return lines


def _number(r: random.Random) -> int:
    u = r.random()
    if u < 0.1:
        return r.randrange(10)
    if u < 0.45:
        return r.randrange(10, 100)
    return r.randrange(100, 1000)


def _addition(r: random.Random) -> tuple[int, int]:
    return _number(r), _number(r)


def _arith_line(r: random.Random) -> str:
    a, b = _addition(r)
    return f"{a}+{b}={a + b}"


def _story(r: random.Random, n: int = 4) -> list[tuple[str, str, str]]:
    names = r.sample(NAMES, n)
    pairs = set()
    out = []
    for nm in names:
        while True:
            c, o = r.choice(COLORS), r.choice(OBJECTS)
            if (c, o) not in pairs:
                pairs.add((c, o))
                break
        out.append((nm, c, o))
    return out


def _story_text(story) -> str:
    return " ".join(f"{nm} has a {c} {o}." for nm, c, o in story)


def _sentence(r: random.Random) -> str:
    def np_() -> str:
        d = r.choice(_DET)
        if r.random() < 0.6:
            return f"{d} {r.choice(_ADJ)} {r.choice(_NOUN_AN)}"
        return f"{d} {r.choice(_NOUN_AN)}"

    def place() -> str:
        return f"{r.choice(_PREP)} the {r.choice(_NOUN_PL)}"

    u = r.random()
    if u < 0.35:
        s = f"{np_()} {r.choice(_VERB_I)} {place()}"
    elif u < 0.7:
        s = f"{np_()} {r.choice(_VERB_T)} {np_()}"
    else:
        s = f"{np_()} {r.choice(_VERB_T)} {np_()} {place()}"
    if r.random() < 0.3:
        s += " " + r.choice(_TIME)
    if r.random() < 0.2:
        s += f" {r.choice(_CONJ)} {np_()} {r.choice(_VERB_I)}"
    return s + "."


def _until(n_chars: int, make, extra: int = 0) -> list[str]:
    """Pieces from `make()` until their lengths (plus `extra` each, for a separator) reach `n_chars`."""
    pieces: list[str] = []
    size = 0
    while size < n_chars:
        piece = make()
        pieces.append(piece)
        size += len(piece) + extra
    return pieces


def _plain(r: random.Random, n_chars: int) -> str:
    return " ".join(_until(n_chars, lambda: _sentence(r), extra=1))


# -------------------------------------------------------------------------------------------- chat


def format_chat(turns: list[tuple[str, str]], add_generation_prompt: bool = False) -> str:
    """``[("user", "12+3="), ("assistant", "15")]`` -> ``<|user|>12+3=<|assistant|>15<|end|>``.

    A user turn has no end marker (the assistant marker closes it); an assistant turn ends with
    ``<|end|>``. ``add_generation_prompt`` appends ``<|assistant|>`` after a final user turn.
    """
    parts = []
    for role, text in turns:
        if role == "user":
            parts.append(USER + text)
        elif role == "assistant":
            parts.append(ASSISTANT + text + END)
        else:
            raise ValueError(f"unknown role {role!r}")
    if add_generation_prompt:
        parts.append(ASSISTANT)
    return "".join(parts)


def _chat_turns(r: random.Random, n_turns: int) -> tuple[list[tuple[str, str]], list[str]]:
    """Alternating user/assistant exchanges mixing facts, recall, arithmetic and story questions."""
    turns: list[tuple[str, str]] = []
    turn_types: list[str] = []
    facts: dict[str, str] = {}
    pool = _facts(r, 12)
    story: list[tuple[str, str, str]] = []
    for _ in range(n_turns):
        u = r.random()
        if pool and (not facts or u < 0.3):
            k, v = pool.pop()
            facts[k] = v
            turns += [("user", f"{k}{v}"), ("assistant", "ok")]
            turn_types.append("fact")
        elif u < 0.6 and facts:
            k = r.choice(sorted(facts))
            turns += [("user", f"?{k}"), ("assistant", facts[k])]
            turn_types.append("recall")
        elif u < 0.8:
            a, b = _addition(r)
            turns += [("user", f"{a}+{b}="), ("assistant", str(a + b))]
            turn_types.append("arithmetic")
        else:
            if not story:
                story = _story(r, 3)
                turns += [("user", _story_text(story)), ("assistant", "ok")]
                turn_types.append("story")
            else:
                nm, c, o = r.choice(story)
                turns += [("user", f"what does {nm} have?"), ("assistant", f"a {c} {o}.")]
                turn_types.append("choice")
    return turns, turn_types


def make_conversation(n_turns: int, seed: int) -> list[tuple[str, str]]:
    """A conversation of ``n_turns`` user/assistant exchanges (``2 * n_turns`` turns)."""
    return _chat_turns(_rng("misc", seed, "conversation", n_turns), n_turns)[0]


# ---------------------------------------------------------------------------------------- documents


def make_document(task: str, r: random.Random, n_chars: int = 256) -> str:
    """One training document of roughly ``n_chars`` characters in the shape of ``task``."""
    if task == "recall":
        return "\n".join(_recall_lines(r, n_chars)) + "\n"
    if task == "arithmetic":
        return "\n".join(_until(n_chars, lambda: _arith_line(r), extra=1)) + "\n"
    if task == "choice":

        def block() -> str:
            story = _story(r, r.choice([3, 4, 4, 5] if n_chars >= 128 else [2, 2, 3]))
            qs = [f"so {nm} has a {c} {o}." for nm, c, o in r.sample(story, min(len(story), 3))]
            return _story_text(story) + " " + " ".join(qs) + "\n"

        return "".join(_until(n_chars, block))
    if task == "text":
        return _plain(r, n_chars) + "\n"
    if task == "copy":
        chars = _LETTERS + "0123456789"

        def copied() -> str:
            seg = "".join(r.choice(chars) for _ in range(r.randrange(4, min(40, max(8, n_chars // 4)))))
            return f"{seg}\n{seg}\n"

        return "".join(_until(n_chars, copied))
    if task == "chat":
        turns, _ = _chat_turns(r, max(2, n_chars // 22))
        return format_chat(turns)
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


#: training mixture (task -> weight)
MIXTURE = {"recall": 0.3, "copy": 0.12, "arithmetic": 0.18, "choice": 0.18, "text": 0.12, "chat": 0.1}


def training_documents(
    n_docs: int, seed: int = 0, n_chars: int = 256, start: int = 0, mixture: dict[str, float] | None = None
) -> list[str]:
    """Documents ``start .. start + n_docs - 1`` of the training stream (``mixture``: task -> weight,
    default :data:`MIXTURE`).

    Document ``i`` depends only on ``(seed, i, n_chars, mixture)``, so any slice of the stream is
    reproducible and resuming a run at document ``i`` gives the same data as not stopping.
    """
    tasks, weights = zip(*(mixture or MIXTURE).items())
    docs = []
    for i in range(start, start + n_docs):
        r = _rng("train", seed, i, n_chars)
        task = r.choices(tasks, weights)[0]
        docs.append(make_document(task, r, n_chars))
    return docs


def training_text(n_docs: int = 100, seed: int = 0, n_chars: int = 256) -> str:
    """Training documents joined into one string (blank-line separated)."""
    return "\n".join(training_documents(n_docs, seed, n_chars))


def calibration_text(n_docs: int = 64, seed: int = 0, n_chars: int = 512) -> list[str]:
    """Plain-ish mixed text for mapper calibration (its own seed stream; not training or eval data).

    Each document concatenates running text with fragments of the other tasks, so the statistics see
    every kind of content the evaluation uses.
    """
    docs = []
    for i in range(n_docs):
        r = _rng("calib", seed, i, n_chars)

        def piece(r=r) -> str:
            task = r.choices(["text", "recall", "arithmetic", "choice", "chat"], [0.4, 0.2, 0.15, 0.15, 0.1])[0]
            return make_document(task, r, r.choice([64, 96, 128]))

        docs.append("".join(_until(n_chars, piece))[: n_chars + 64])
    return docs


# ---------------------------------------------------------------------------------------------- eval


def _recall_item(r: random.Random, n_chars: int) -> RecallItem:
    lines = _recall_lines(r, n_chars)
    stated = {ln[:2]: ln[2:] for ln in lines if not ln.startswith("?")}
    # ask about a fact stated at least a few lines back
    early = [ln[:2] for ln in lines[: max(1, len(lines) * 2 // 3)] if not ln.startswith("?")]
    k = r.choice(early)
    return RecallItem(context="\n".join(lines) + f"\n?{k}", answer=stated[k], key=k)


def _arith_item(r: random.Random, shots: int = 3) -> ArithmeticItem:
    shots_txt = "".join(_arith_line(r) + "\n" for _ in range(shots))
    a, b = _addition(r)
    return ArithmeticItem(prompt=shots_txt + f"{a}+{b}=", answer=str(a + b))


def _choice_item(r: random.Random) -> ChoiceItem:
    story = _story(r, 4)
    nm, c, o = r.choice(story)
    other = r.choice([s for s in story if s[0] != nm])
    used = {(s[1], s[2]) for s in story}
    fresh = set()
    while len(fresh) < 2:
        cand = (r.choice(COLORS), r.choice(OBJECTS))
        if cand not in used:
            fresh.add(cand)
    options = [(c, o), (other[1], other[2])] + sorted(fresh)
    r.shuffle(options)
    choices = [f" {cc} {oo}." for cc, oo in options]
    return ChoiceItem(context=_story_text(story) + f" so {nm} has a", choices=choices, label=options.index((c, o)))


def _chat_item(r: random.Random, n_turns: int) -> ChatItem:
    while True:
        turns, turn_types = _chat_turns(r, n_turns)
        # cut at the last recall or arithmetic exchange (exact-match answers)
        idx = [i for i, k in enumerate(turn_types) if k in ("recall", "arithmetic") and i >= 2]
        if idx:
            i = idx[-1]
            kept = turns[: 2 * i + 1]
            return ChatItem(
                context=format_chat(kept, add_generation_prompt=True),
                answer=turns[2 * i + 1][1],
                turns=kept,
                question=turn_types[i],
            )


def make_eval_set(task: str, n: int, seed: int = 0, n_chars: int = 192) -> list:
    """``n`` evaluation items for ``task`` (``recall``, ``arithmetic``, ``choice``, ``text``, ``chat``).

    Items come from the ``eval`` seed stream, disjoint from the training stream.
    ``n_chars`` sets the context length of recall items and the length of text items.
    """
    items = []
    for i in range(n):
        r = _rng("eval", seed, task, i, n_chars)
        if task == "recall":
            items.append(_recall_item(r, n_chars))
        elif task == "arithmetic":
            items.append(_arith_item(r))
        elif task == "choice":
            items.append(_choice_item(r))
        elif task == "text":
            items.append(TextItem(_plain(r, n_chars)))
        elif task == "chat":
            items.append(_chat_item(r, max(3, n_chars // 24)))
        else:
            raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    return items
