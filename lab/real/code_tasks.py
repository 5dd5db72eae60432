"""`code_defs`: a long Python file whose last function must be completed with helpers defined across it, judged by
executing tests (HumanEval's way, `lab.real.humaneval.passes`).

Each item generates three helpers from the templates of `_HELPERS` (two that transform a list of integers, one that
folds it into one integer), each with a made-up name, an argument order of its own and a constant that only its body
holds (a margin, an offset, a modulus, a multiplier, a checksum's base). They sit at 10 %, 40 % and 70 % of the file,
between whole top-level statements of real held-out Python code (the standard library's, `hf_kvmap.real.corpus`). The
file ends with a function stub whose docstring says, in words of its own, what to do: pass the numbers through two of
the steps and fold them with the third, giving each step's explicit arguments. `meta["problem"]` is a HumanEval-style
problem (`prompt`: the helpers and the stub, without the filler; `test`: a `check(candidate)` asserting the reference's
results on three inputs; `entry_point`), so `passes(meta["problem"], completion)` judges a completion with the helpers in
scope and nothing imported; `meta["reference"]` is a completion that passes.

Why a sparse prefill of the question's spans fails: the stub names no helper and shares no word with their names,
argument names or docstrings (only words such as "the" or "by"), so the spans its words point at are the stub itself
and words that every function of the file repeats. A completion that passes must call each helper by its name with its
argument order, or copy the constant its body holds; those positions sit thousands of tokens before the stub, among
real code, where nothing the stub says leads.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Sequence

from hf_kvmap.real.corpus import Document, code_texts

from .humaneval import passes, truncate_completion
from .long_tasks import LongItem
from .task_text import LENGTH_TOLERANCE, TaskLengthError, token_length

#: where the three helpers sit in the file (their share of the filler before them)
HELPER_DEPTHS = (0.1, 0.4, 0.7)
#: a top-level statement of the held-out code longer than this is not used as filler (it would not fit the gaps)
MAX_SEGMENT_TOKENS = 512
#: words a stub's docstring may share with a helper's name, arguments and docstring
FUNCTION_WORDS = frozenset("a an and at by each for from in into is it its of on the then to".split())

# (kind, definition, stub phrase, reference call); `{name}` is the helper's name, `{k}` its hidden constant, `{x}` the
# explicit argument the stub gives; a "list" helper maps a list of integers to another, a "fold" one to an integer.
_HELPERS = (
    (
        "list",
        'def {name}(ceiling, values, shift):\n    """Raise every reading by `shift` plus the house margin, never past '
        '`ceiling`."""\n    margin = {k}\n    return [min(v + shift + margin, ceiling) for v in values]\n',
        "increase each number by {x} and by this module's fixed extra, topping out at {y}",
        "{name}({y}, data, {x})",
        (2, 9),
    ),
    (
        "list",
        'def {name}(values, stride):\n    """Keep every `stride`-th reading, counted from the house offset."""\n'
        "    return values[{k}::stride]\n",
        "retain only one number in {x}, beginning at this file's customary spot",
        "{name}(data, {x})",
        (1, 2),
    ),
    (
        "list",
        'def {name}(factor, values):\n    """Scale readings by `factor`, wrapped by the house modulus."""\n'
        "    return [(v * factor) % {k} for v in values]\n",
        "multiply all numbers by {x}, reducing modulo this file's usual base",
        "{name}({x}, data)",
        (89, 997),
    ),
    (
        "list",
        'def {name}(values, bias):\n    """Subtract `bias` from readings, dropping those which would go below zero, '
        'and stretch the rest by the house factor."""\n    return [(v - bias) * {k} for v in values if v >= bias]\n',
        "lower all numbers by {x}, discarding any that turn negative, then enlarge what remains by this file's "
        "usual multiplier",
        "{name}(data, {x})",
        (2, 5),
    ),
    (
        "fold",
        'def {name}(seed, values):\n    """Fold readings into the ledger checksum, starting from `seed`."""\n'
        "    total = seed\n    for v in values:\n        total = (total * {k} + v) % 1000003\n    return total\n",
        "finally combine what remains into one check value beginning at {x}",
        "{name}({x}, data)",
        (31, 131),
    ),
    (
        "fold",
        'def {name}(values, scale):\n    """Sum readings, weighted by position (counted from the house start) and by '
        '`scale`."""\n    return sum((i + {k}) * scale * v for i, v in enumerate(values))\n',
        "finally add up what remains, counting each number as many times as its place (as this file numbers "
        "places) and then {x} times over",
        "{name}(data, {x})",
        (1, 3),
    ),
)
_SYLLABLES = "ba be bi bo bu da de di do du ka ke ki ko ku la le li lo lu ma me mi mo mu na ne ni no nu ra re ri ro ru"


def _made_up_name(rng: random.Random) -> str:
    syllables = _SYLLABLES.split()
    return "_".join("".join(rng.choice(syllables) for _ in range(rng.randint(2, 3))) for _ in range(2))


class CodeSegments:
    """The whole top-level statements (functions, classes, imports, ...) of the held-out Python files, in a fixed
    order, each with its length in tokens; those over `MAX_SEGMENT_TOKENS` are left out."""

    def __init__(self, tokenizer, documents: Sequence[Document], seed: int):
        self._texts, self.tokenizer = code_texts(documents, "heldout", seed), tokenizer
        self.segments: list[tuple[str, int]] = []
        self._starts: list[int] = []  # each segment's first token in the stream of all of them

    def first_after(self, token: int) -> int:
        """The index of the first segment that starts at or after `token` tokens into the stream."""
        index = 0
        while self._start(index) < token:
            index += 1
        return index

    def _start(self, index: int) -> int:
        self.get(index)
        return self._starts[index]

    def get(self, index: int) -> tuple[str, int]:
        """The `index`-th segment and its length in tokens."""
        while len(self.segments) <= index:
            try:
                source = next(self._texts)
            except StopIteration:
                raise TaskLengthError(
                    f"The held-out code holds {len(self.segments)} usable top-level statements, fewer than these items "
                    "need; build fewer or shorter items."
                ) from None
            try:
                tree = ast.parse(source)
            except (SyntaxError, ValueError):
                continue
            lines = source.split("\n")
            for node in tree.body:
                first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                text = "\n".join(lines[first - 1 : node.end_lineno]).rstrip()
                length = token_length(self.tokenizer, text)
                if text and length <= MAX_SEGMENT_TOKENS:
                    self._starts.append(self._starts[-1] + self.segments[-1][1] if self.segments else 0)
                    self.segments.append((text, length))
        return self.segments[index]


def _filler(segments: CodeSegments, start: int, tokens: int, make) -> list[str]:
    """Segments from `start` on, each taken (in order) while `make(filler)` stays within `tokens`: counted by the
    segments' own lengths while far from it, then by tokenizing `make`'s text; a segment that does not fit is skipped
    (up to 200), and the filler ends where the held-out code does."""
    taken, index, skipped = [], start, 0
    used, exact = token_length(segments.tokenizer, make([])), False
    while skipped < 200:
        if not exact and used > tokens - MAX_SEGMENT_TOKENS:  # near the length: count exactly from here on
            used, exact = token_length(segments.tokenizer, make(taken)), True
        if tokens - used <= LENGTH_TOLERANCE * tokens / 3:
            break
        try:
            text, length = segments.get(index)
        except TaskLengthError:
            break
        index += 1
        if used + length + 3 > tokens:
            skipped += 1
        elif not exact:  # far from the length: the segments' lengths (and a separator each) add up
            taken.append(text)
            used += length + 3
        elif (found := token_length(segments.tokenizer, make([*taken, text]))) <= tokens:
            taken.append(text)
            used = found
        else:
            skipped += 1
    return taken


def _chunks(filler: list[str], lengths: list[int]) -> list[list[str]]:
    """`filler` cut in four at `HELPER_DEPTHS` of its tokens (`lengths`: each segment's)."""
    total, chunks, at = sum(lengths) or 1, [[] for _ in range(len(HELPER_DEPTHS) + 1)], 0
    for text, length in zip(filler, lengths):
        chunk = sum(at / total >= depth for depth in HELPER_DEPTHS)
        chunks[chunk].append(text)
        at += length
    return chunks


def _program(helpers: list[str], stub: str, body: str) -> dict:
    scope: dict = {}
    exec("\n\n".join([*helpers, stub + body]), scope)  # noqa: S102 - text generated here from `_HELPERS`
    return scope


def passes_tests(item: LongItem, reply: str) -> float:
    """1.0 where `reply`, cut at the end of the function (`humaneval.truncate_completion`), passes the item's tests
    (`humaneval.passes(item.meta["problem"], ...)`), else 0.0."""
    return float(passes(item.meta["problem"], truncate_completion(reply)))


def code_defs(tokenizer, documents: Sequence[Document], items: int, tokens: int = 2048, seed: int = 1234):
    """Long Python files whose last function must be completed with the helpers defined across them (module
    docstring).

    Args:
        tokenizer: the tokenizer lengths are counted in.
        documents (`list[Document]`): the corpus manifest (`hf_kvmap.real.corpus.load_manifest`); its held-out code
            fills the file.
        items (`int`): how many items.
        tokens (`int`, *optional*, defaults to 2048): the prompt length (at most, within `LENGTH_TOLERANCE`).
        seed (`int`, *optional*, defaults to 1234): fixes the helpers, their constants, the tests and the code read.

    Returns:
        `list[LongItem]`: the prompt is the file up to the stub's docstring (a completion continues it); `answer` is
        empty; `meta`: `tokens`, `problem`, `reference`, `helpers` (their names in the order the reference calls them),
        `stub` (the stub's text).
    """
    segments, out = CodeSegments(tokenizer, documents, seed + 127), []
    for index in range(items):
        rng = random.Random(f"{seed}-code-defs-{tokens}-{index}")
        chosen = rng.sample([t for t in _HELPERS if t[0] == "list"], 2) + [rng.choice(_HELPERS[-2:])]
        names: list[str] = []
        while len(names) < len(chosen) + 1:
            name = _made_up_name(rng)
            if all(name.split("_")[0] not in other for other in names):
                names.append(name)
        helpers, phrases, calls = [], [], []
        for (_, definition, phrase, call, (low, high)), name in zip(chosen, names):
            args = {"x": rng.randint(2, 7), "y": rng.randint(40, 90)}
            helpers.append(definition.replace("{name}", name).replace("{k}", str(rng.randint(low, high))))
            phrases.append(phrase.format(**args))
            calls.append(call.replace("{name}", name).format(**args))
        entry = names[-1]
        stub = (
            f'def {entry}(numbers):\n    """Take `numbers`, a list of integers: {phrases[0]}; then {phrases[1]}; '
            f'{phrases[2]}. Return that value."""\n'
        )
        body = f"    data = numbers\n    data = {calls[0]}\n    data = {calls[1]}\n    return {calls[2]}\n"
        function = _program(helpers, stub, body)[entry]
        inputs = [[rng.randint(0, 60) for _ in range(rng.randint(6, 12))] for _ in range(3)]
        test = "def check(candidate):\n" + "".join(f"    assert candidate({x!r}) == {function(x)!r}\n" for x in inputs)
        placed = rng.sample(range(len(helpers)), len(helpers))  # which helper sits at which depth

        def make(filler: list[str], placed=placed, helpers=helpers, stub=stub) -> str:
            chunks = _chunks(filler, [token_length(tokenizer, text) for text in filler])
            parts = chunks[0]
            for depth, chunk in enumerate(chunks[1:]):
                parts = [*parts, helpers[placed[depth]].rstrip(), *chunk]
            return "\n\n\n".join([*parts, stub])

        prompt = make(_filler(segments, segments.first_after(index * tokens), tokens, make))
        if token_length(tokenizer, prompt) < (1 - LENGTH_TOLERANCE) * tokens:
            raise TaskLengthError(
                f"code_defs item {index} reaches {token_length(tokenizer, prompt)} tokens, short of tokens={tokens} by "
                f"more than {LENGTH_TOLERANCE:.0%} (the held-out code ran out); ask for fewer or shorter items."
            )
        problem = {
            "task_id": f"code_defs/{index}",
            "prompt": "\n\n\n".join([*helpers, stub]),
            "entry_point": entry,
            "test": test,
        }
        meta = {"tokens": token_length(tokenizer, prompt), "problem": problem, "reference": body, "stub": stub}
        meta["helpers"] = names[:-1]
        out.append(LongItem("code_defs", prompt, "", meta))
    return out


__all__ = ["FUNCTION_WORDS", "HELPER_DEPTHS", "MAX_SEGMENT_TOKENS", "CodeSegments", "code_defs", "passes_tests"]
