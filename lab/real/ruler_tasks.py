"""RULER's synthetic families (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?", arXiv:2404.06654), written here from the paper's description with this project's own wording and word lists,
at a length in tokens of the tokenizer given (2K, 4K and 8K for the real pair). Each prompt is the chat template's user
turn (instruction, context, question) followed by the start of the answer, which the model continues, as RULER prompts
chat models; the filler is binary-searched so the prompt is at most `tokens` and within `LENGTH_TOLERANCE` of it.

Scored by RULER's `string_match_all` (the share of the item's `meta["references"]` found in the reply, case-insensitive),
held to the length of the list asked for: a reply naming more items than there are references is divided by its count
(`task_text.string_match_listed`), so copying every candidate is not credited with the references among them.

Why a sparse prefill of the question's spans falls short on each (the target prefilling only the positions a strategy
such as `query_overlap` picks, the spans repeating the question's words, with nothing computed around them):

- `ruler_vt` (variable tracking, 2-4 hops, two distractor chains): the question names only the value, which the
  chain's first statement holds; every hop (`VAR KQZPT = VAR ABCDE`) repeats no word of the question but `VAR`, which
  all statements of all chains share, so the spans the question points at hold the start of the chain and none of
  the variables asked for. Which hop statements belong to the chain is known only by reading every statement.
- `ruler_cwe` (common-word extraction): the question names no word of the list. The answer is the ten words repeated
  most (6 times each against once below 4K tokens, 30 against 3 from 4K, as in RULER), which only counting the whole
  list finds: a tenth of the list shows each common word 0.6 times on average below 4K (most of them not at all).
  From 4K a uniform tenth shows them 3 times against 0.3, so a sparse prefill can rank some of them; it still loses
  those a subset happens to miss, where the whole list has all ten.
- `ruler_fwe` (frequent-word extraction): the same with random coded words in Zipf frequencies (exponent 2, 50 words;
  the most frequent word is shown as `...`): ranks 2-4 are asked, and a subset of the text blurs ranks 3 and 4 into
  5 and 6 (at 2K about 34, 19, 12 and 8 occurrences; a tenth of them is 3.4, 1.9, 1.2 and 0.8).
- `ruler_multikey` and `ruler_multivalue` (needles with similar keys; one key with four values): the control of the
  set. The question names its key, and the needles holding it repeat the question's words, so the spans it points at
  hold the answer (the similar keys score lower, missing one word of it); a sparse prefill is expected to do as well
  as the whole context here, and these two show where the map adds nothing.

The chance floors (`CHANCE`): naming one of the planted numbers at random (multikey, 1 in `MULTIKEY_NEEDLES`), three
of the 49 coded words (fwe); 0 for the others.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from hf_kvmap.real.corpus import Document

from .long_tasks import LongItem
from .task_text import (
    KEY_ADJECTIVES,
    WORDS,
    TaskLengthError,
    TextStream,
    chat_prompt,
    coded_word,
    fit_to_length,
    plant,
    token_length,
)

RULER_TASK_NAMES = ("ruler_multikey", "ruler_multivalue", "ruler_vt", "ruler_cwe", "ruler_fwe")
#: needles of a multi-key item (the asked one and keys that differ from it in one word), values of a multi-value key
MULTIKEY_NEEDLES, MULTIVALUE_VALUES = 4, 4
#: variable tracking: hops of the asked chain (item `i` has `VT_HOPS[i % 3]`), chains in all (the others distract)
VT_HOPS, VT_CHAINS = (2, 3, 4), 3
#: common-word extraction: the words asked, and (common, rare) repeats below 4K tokens and from 4K (RULER's)
CWE_COMMON, CWE_REPEATS = 10, {"short": (6, 1), "long": (30, 3)}
#: frequent-word extraction: distinct coded words, the Zipf exponent, the ranks asked (rank 1 is shown as "...")
FWE_VOCABULARY, FWE_ALPHA, FWE_RANKS = 50, 2.0, (2, 3, 4)
CHANCE = {
    "ruler_multikey": 1 / MULTIKEY_NEEDLES,
    "ruler_multivalue": 0.0,
    "ruler_vt": 0.0,
    "ruler_cwe": 0.0,
    "ruler_fwe": len(FWE_RANKS) / (FWE_VOCABULARY - 1),
}
#: what keeps the filler of two items of a family apart: item `i` reads the held-out prose from `i * tokens`
_PROSE_SEED = {"ruler_multikey": 101, "ruler_multivalue": 103, "ruler_vt": 107}


def _prose(tokenizer, documents, task: str, seed: int) -> TextStream:
    return TextStream(tokenizer, documents, "prose", seed + _PROSE_SEED[task])


def _depths(rng: random.Random, count: int) -> list[float]:
    """`count` distinct depths from 40 evenly spaced points in [2.5 %, 97.5 %] (RULER spaces 40 between 0 and 100 %)."""
    return sorted(rng.sample([0.025 + 0.95 * i / 39 for i in range(40)], count))


def _needle_item(
    tokenizer, stream: TextStream, start: int, tokens: int, needles, instruction: str, question: str, prefix: str
) -> tuple[str, int]:
    def make(n: int) -> str:
        context = plant(stream.text(start, n), needles) if n else " ".join(s for _, s in needles)
        return chat_prompt(
            tokenizer, [{"role": "user", "content": f"{instruction}\n\n{context}\n\n{question}"}], prefix
        )

    return fit_to_length(make, tokenizer, tokens, tokens)


def _similar_keys(rng: random.Random, count: int) -> list[str]:
    """`count` "adjective-noun" keys, the first the asked one and each other differing from it in one word."""
    adjective, noun = rng.choice(KEY_ADJECTIVES), rng.choice(WORDS)
    adjectives = iter(rng.sample([a for a in KEY_ADJECTIVES if a != adjective], count))
    nouns = iter(rng.sample([w for w in WORDS if w != noun], count))
    keys = [f"{adjective}-{noun}"]
    for i in range(1, count):
        keys.append(f"{adjective}-{next(nouns)}" if i % 2 else f"{next(adjectives)}-{noun}")
    return keys


def _numbers(rng: random.Random, count: int) -> list[str]:
    return [str(n) for n in rng.sample(range(1_000_000, 10_000_000), count)]


_NEEDLE = "One of the special magic numbers for {key} is: {value}."
_NEEDLE_INSTRUCTION = (
    "A few special magic numbers are hidden in the text below. Read it carefully and remember them: I will ask you "
    "about {what} afterwards."
)


def ruler_multikey(tokenizer, documents: Sequence[Document], items: int, tokens: int = 2048, seed: int = 1234):
    """Needles of `MULTIKEY_NEEDLES` similar keys ("adjective-noun", each distractor one word away from the asked key)
    with 7-digit values at depths drawn from 40 points of real held-out prose; the question asks one key's value
    (`meta["depth"]`: its needle's depth).

    Args:
        tokenizer: the tokenizer lengths are counted in (with a chat template).
        documents (`list[Document]`): the corpus manifest (`hf_kvmap.real.corpus.load_manifest`); its held-out prose
            fills the haystack.
        items (`int`): how many items.
        tokens (`int`, *optional*, defaults to 2048): the prompt length (at most, within `LENGTH_TOLERANCE`).
        seed (`int`, *optional*, defaults to 1234): fixes everything generated and the prose read.

    Returns:
        `list[LongItem]`: each with `answer` the asked value and `meta["references"]` `[answer]`.
    """
    stream, out = _prose(tokenizer, documents, "ruler_multikey", seed), []
    for index in range(items):
        rng = random.Random(f"{seed}-ruler-multikey-{tokens}-{index}")
        keys, values = _similar_keys(rng, MULTIKEY_NEEDLES), _numbers(rng, MULTIKEY_NEEDLES)
        depths = _depths(rng, MULTIKEY_NEEDLES)
        rng.shuffle(depths)
        needles = [(d, _NEEDLE.format(key=k, value=v)) for d, k, v in zip(depths, keys, values)]
        question = f"What is the special magic number for {keys[0]} in the text above?"
        prefix = f"The special magic number for {keys[0]} in the text above is"
        instruction = _NEEDLE_INSTRUCTION.format(what="one of them")
        prompt, _ = _needle_item(tokenizer, stream, index * tokens, tokens, needles, instruction, question, prefix)
        meta = {"tokens": token_length(tokenizer, prompt), "references": [values[0]], "depth": round(depths[0], 3)}
        meta["keys"] = keys
        out.append(LongItem("ruler_multikey", prompt, values[0], meta))
    return out


def ruler_multivalue(tokenizer, documents: Sequence[Document], items: int, tokens: int = 2048, seed: int = 1234):
    """One key with `MULTIVALUE_VALUES` 7-digit values in needles at four depths of real held-out prose; the question
    asks for all of them. Arguments as for `ruler_multikey`; `meta["references"]`: the values."""
    stream, out = _prose(tokenizer, documents, "ruler_multivalue", seed), []
    for index in range(items):
        rng = random.Random(f"{seed}-ruler-multivalue-{tokens}-{index}")
        key, values = _similar_keys(rng, 1)[0], _numbers(rng, MULTIVALUE_VALUES)
        depths = _depths(rng, MULTIVALUE_VALUES)
        needles = [(d, _NEEDLE.format(key=key, value=v)) for d, v in zip(depths, values)]
        question = f"What are all the special magic numbers for {key} in the text above?"
        prefix = f"The special magic numbers for {key} in the text above are"
        instruction = _NEEDLE_INSTRUCTION.format(what="them")
        prompt, _ = _needle_item(tokenizer, stream, index * tokens, tokens, needles, instruction, question, prefix)
        meta = {"tokens": token_length(tokenizer, prompt), "references": values, "key": key}
        out.append(LongItem("ruler_multivalue", prompt, ", ".join(values), meta))
    return out


def _variables(rng: random.Random, count: int, taken: set[str]) -> list[str]:
    names = []
    while len(names) < count:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in taken and not any(name in other or other in name for other in taken):
            taken.add(name)
            names.append(name)
    return names


def _chain(names: list[str], value: int) -> list[str]:
    return [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]


def ruler_vt(tokenizer, documents: Sequence[Document], items: int, tokens: int = 2048, seed: int = 1234):
    """Variable tracking: `VT_CHAINS` chains of assignments (`VAR ABCDE = 12345`, then `VAR FGHIJ = VAR ABCDE`, ...)
    spread through real held-out prose, each chain's statements in order and the chains interleaved; the asked chain
    has `VT_HOPS[i % 3]` hops (2-4), the others 2-4 at random, each its own 5-digit value. The question asks which
    variables hold the asked value; the answer's start says how many (hops + 1). A one-shot example of other names
    comes first. Arguments as for `ruler_multikey`; `meta`: `references` (the chain's variables, in order), `hops`,
    `value`, `chains` (every chain's variables, the asked one first)."""
    stream, out = _prose(tokenizer, documents, "ruler_vt", seed), []
    for index in range(items):
        rng = random.Random(f"{seed}-ruler-vt-{tokens}-{index}")
        hops, taken = VT_HOPS[index % len(VT_HOPS)], set()
        values = rng.sample(range(10_000, 100_000), VT_CHAINS + 1)
        chains = [_variables(rng, hops + 1, taken)]
        chains += [_variables(rng, rng.choice(VT_HOPS) + 1, taken) for _ in range(VT_CHAINS - 1)]
        statements = [_chain(names, value) for names, value in zip(chains, values)]
        order = [c for c, chain in enumerate(statements) for _ in chain]
        rng.shuffle(order)  # the chains interleaved, each in its own order
        position = [0] * VT_CHAINS
        placed = []
        for slot, chain in enumerate(order):
            placed.append(((slot + 0.5) / len(order), statements[chain][position[chain]] + "."))
            position[chain] += 1
        example_names = _variables(rng, 3, taken)
        example = " ... ".join(s + "." for s in _chain(example_names, values[-1]))
        instruction = (
            "Memorize every variable assignment in the text below; a variable is assigned either a number or another "
            f"variable. Example: in the text '{example}', the variables holding the value {values[-1]} are "
            f"{', '.join(example_names)}."
        )
        question = f"Which variables in the text above are assigned the value {values[0]}?"
        prefix = f"Following the assignments in the text, {hops + 1} variables hold the value {values[0]}. They are:"
        prompt, _ = _needle_item(tokenizer, stream, index * tokens, tokens, placed, instruction, question, prefix)
        meta = {"tokens": token_length(tokenizer, prompt), "references": chains[0], "hops": hops}
        meta.update(value=values[0], chains=chains)
        out.append(LongItem("ruler_vt", prompt, ", ".join(chains[0]), meta))
    return out


def ruler_cwe(tokenizer, documents: Sequence[Document], items: int, tokens: int = 2048, seed: int = 1234):
    """Common-word extraction: a numbered list of words in which `CWE_COMMON` words appear `CWE_REPEATS[...][0]`
    times and as many other words as fit appear `[1]` times each (6 and 1 below 4K tokens, 30 and 3 from 4K), in a
    random order; the question asks for the `CWE_COMMON` most common. No held-out text (`documents` is not read; kept
    for one signature). Other arguments as for `ruler_multikey`; `meta`: `references` (the common words), `repeats`.

    Raises:
        `TaskLengthError`: the word list (`task_text.WORDS`) is too short to fill `tokens` (ask for a shorter length).
    """
    repeats = CWE_REPEATS["short" if tokens < 4096 else "long"]
    out = []
    for index in range(items):
        rng = random.Random(f"{seed}-ruler-cwe-{tokens}-{index}")
        vocabulary = rng.sample(WORDS, len(WORDS))
        common, rare = vocabulary[:CWE_COMMON], vocabulary[CWE_COMMON:]
        prompt = _cwe_prompt(tokenizer, tokens, f"{seed}-ruler-cwe-order-{tokens}-{index}", common, rare, repeats)
        meta = {"tokens": token_length(tokenizer, prompt), "references": common, "repeats": list(repeats)}
        out.append(LongItem("ruler_cwe", prompt, ", ".join(common), meta))
    return out


def _cwe_prompt(tokenizer, tokens: int, order: str, common: list[str], rare: list[str], repeats) -> str:
    """The longest list of `common` and the first of `rare` words, shuffled by `order`, that fits `tokens`."""
    question = f"What are the {CWE_COMMON} most common words in the list above? Name each once, separated by commas."

    def make(n: int) -> str:
        words = [w for w in common for _ in range(repeats[0])] + [w for w in rare[:n] for _ in range(repeats[1])]
        random.Random(order).shuffle(words)
        listing = " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))
        content = f"Below is a numbered list of words. Some of them appear more often than others.\n\n{listing}\n\n"
        prefix = f"The {CWE_COMMON} most common words in the list are:"
        return chat_prompt(tokenizer, [{"role": "user", "content": content + question}], prefix)

    return fit_to_length(make, tokenizer, tokens, len(rare))[0]


def fwe_counts(words: int, vocabulary: int = FWE_VOCABULARY, alpha: float = FWE_ALPHA) -> list[int]:
    """How often each rank of a Zipf vocabulary appears among `words` words: `round(words * r**-alpha / H)` (at least
    1), `H` the sum of `r**-alpha` over the ranks."""
    total = sum(r**-alpha for r in range(1, vocabulary + 1))
    return [max(1, round(words * r**-alpha / total)) for r in range(1, vocabulary + 1)]


def _fwe_prompt(tokenizer, tokens: int, order: str, coded: list[str]) -> tuple[str, int]:
    """The longest coded text of `coded` in Zipf counts, shuffled by `order`, that fits `tokens`, and its words."""
    shown = ["...", *coded[1:]]
    question = "Apart from '...', which three coded words appear most often in the text above? Name them, most frequent first."

    def make(n: int) -> str:
        text = [w for w, count in zip(shown, fwe_counts(n)) for _ in range(count)] if n else []
        random.Random(order).shuffle(text)
        content = "Below is a coded text. Keep track of how often each coded word appears.\n\n" + " ".join(text)
        prefix = "The three most frequent coded words are:"
        return chat_prompt(tokenizer, [{"role": "user", "content": f"{content}\n\n{question}"}], prefix)

    return fit_to_length(make, tokenizer, tokens, 4 * tokens)


def ruler_fwe(tokenizer, documents: Sequence[Document], items: int, tokens: int = 2048, seed: int = 1234):
    """Frequent-word extraction: a text of `FWE_VOCABULARY` random 6-letter coded words, each rank `r` appearing
    `fwe_counts(...)[r - 1]` times in a random order, the most frequent shown as `...`; the question asks for the three
    most frequent coded words (ranks 2-4). `documents` is not read. Other arguments as for `ruler_multikey`; `meta`:
    `references` (ranks 2-4, most frequent first), `counts` (of every rank), `words` (`fwe_counts`'s argument).

    Raises:
        `TaskLengthError`: `tokens` is too short for ranks 2-5 to differ in count.
    """
    out = []
    for index in range(items):
        rng = random.Random(f"{seed}-ruler-fwe-{tokens}-{index}")
        coded: list[str] = []
        while len(coded) < FWE_VOCABULARY:
            word = coded_word(rng)
            if word not in coded:
                coded.append(word)
        prompt, words = _fwe_prompt(tokenizer, tokens, f"{seed}-ruler-fwe-order-{tokens}-{index}", coded)
        counts = fwe_counts(words)
        if not counts[1] > counts[2] > counts[3] > counts[4]:
            raise TaskLengthError(f"At tokens={tokens} ranks 2-5 tie ({counts[1:5]}); ask for a longer length.")
        references = [coded[r - 1] for r in FWE_RANKS]
        meta = {"tokens": token_length(tokenizer, prompt), "references": references, "counts": counts, "words": words}
        out.append(LongItem("ruler_fwe", prompt, ", ".join(references), meta))
    return out


__all__ = [
    "CHANCE",
    "CWE_COMMON",
    "CWE_REPEATS",
    "FWE_ALPHA",
    "FWE_RANKS",
    "FWE_VOCABULARY",
    "MULTIKEY_NEEDLES",
    "MULTIVALUE_VALUES",
    "RULER_TASK_NAMES",
    "VT_CHAINS",
    "VT_HOPS",
    "fwe_counts",
    "ruler_cwe",
    "ruler_fwe",
    "ruler_multikey",
    "ruler_multivalue",
    "ruler_vt",
]
