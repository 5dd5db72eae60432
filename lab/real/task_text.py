"""What the whole-context tasks (`lab.real.ruler_tasks`, `lab.real.context_tasks`,
`lab.real.code_tasks`) share: word lists written for them, streams of held-out real text to fill with, the
binary search that fits an item to a token length (as RULER fits its haystacks), and RULER's scoring.

```python
from lab.real.task_text import string_match_all

string_match_all("They are ABCDE and FGHIJ.", ["abcde", "fghij", "klmno"])   # 2 of 3 references found
```
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

from hf_kvmap.real.corpus import Document, code_texts, prose_texts

#: an item's prompt is at most its `tokens` and at least this share below them
LENGTH_TOLERANCE = 0.03

#: common English words, none a substring of another (so a reply naming one never matches another): the vocabulary of
#: common-word extraction and the nouns of needle keys
WORDS = tuple(
    """
    apple river stone cloud garden window bridge candle mirror forest island button ladder rabbit saddle tunnel
    wallet basket blanket bottle bucket camera carpet castle cheese circle coffee collar copper cotton cradle
    desert dinner doctor dragon drawer engine fabric farmer feather fiddle finger flower folder fountain friend
    frost funnel glove goat gravel guitar hammer harbor helmet hollow honey hunter jacket jelly jungle kettle
    kitten ladle lemon letter lizard magnet marble meadow melon metal mitten monkey motor muffin needle noodle
    ocean orange oven paddle palace panda paper parrot pebble pencil pigeon pillow pirate planet pocket potato
    powder pumpkin puppet puzzle quilt radio raisin record ribbon rocket rubber salmon sandal school shadow shelf
    shovel silver singer sister sketch socket spider sponge spoon spring squirrel stable statue sugar summer sunset
    sweater tablet tiger timber toast tomato tower tractor trumpet turtle valley velvet violin wagon walnut whistle
    winter wizard wolf yogurt zebra anchor badge banner barrel beacon beetle bench blossom bonnet border bracket
    branch brick broom bubble buckle bundle cabin cactus canal canoe canvas carrot cellar chapel chimney cider
    clover cobweb comet compass coral cottage crayon cricket crown crystal cushion daisy dolphin donkey dune eagle
    easel elbow ember falcon fence ferry flag flute fossil galaxy garlic geyser ginger glacier globe goblet gravy
    harp hedge heron hinge hive hook horizon igloo ivory jasmine jewel kayak kernel kiosk lagoon lantern lava leaf
    lily linen lobster locket lotus lumber maple marsh meteor mint moss mustard nectar nest nickel oasis olive
    onion orchard otter owl oyster pantry parcel peach peanut pearl pelican pepperoni petal piano pickle pilot pine
    pipe plank plum pond poppy porch prism quartz quiver radish raft raven reef rhubarb robin rope saffron sail
    sapphire scarf scroll seal sesame shell shrimp sleigh sloth snail sparrow spice spruce squash stork straw
    stream swan syrup thistle thorn thread thunder tide tulip turnip twig umbrella vase violet walrus wheat willow
    wren yacht acorn almond antler apron attic avocado bagel bakery bamboo banjo barley basil bayou beaver biscuit
    blender boulder bramble brass buffalo bugle burrow butter cabbage canary caramel cashew cedar celery cherry
    chestnut chisel cinnamon clam cobalt coconut cocoa cork crane crater crumb cupboard curtain cypress dagger
    denim dew dumpling emerald fern fig flannel flint fudge gazelle gecko gingham gondola gopher granite grape gull
    hamster hatchet hazelnut hummus iris jigsaw juniper kale kelp koala lentil lettuce lime llama lychee macaw
    mango mantis meringue mole moose mulberry muslin nutmeg oatmeal opal orca oregano paprika parsnip pasta pecan
    penguin pewter pistachio plaster polka pretzel puffin quail quince raccoon ravioli reed rosemary rye sage satin
    scallop shallot sherbet spinach sprout squid tamarind tangerine taffy tapestry teapot thyme toffee topaz trout
    truffle tweed vanilla vinegar waffle wasabi wool yam
    """.split()
)
#: adjectives of the keys of RULER's needles ("adjective-noun" pairs, as RULER draws them)
KEY_ADJECTIVES = (
    "amber", "silent", "northern", "copper", "hollow", "bright", "quiet", "velvet", "frozen", "golden", "crimson",
    "gentle", "ancient", "narrow", "rusty", "hidden", "lucky", "misty", "proud", "sandy", "shiny", "stormy", "tidy",
    "wooden", "woolly", "brave", "clever", "dusty", "eager", "fancy",
)  # fmt: skip
#: given names of the people of the conversation tasks
NAMES = (
    "Anna", "Ben", "Carla", "David", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kasia", "Luca", "Mira",
    "Nils", "Olga", "Pedro", "Rosa", "Sami", "Tara", "Viktor",
)  # fmt: skip
#: home towns and pets of the conversation tasks
TOWNS = ("Lisbon", "Oslo", "Nairobi", "Kyoto", "Denver", "Krakow", "Lima", "Dublin", "Porto", "Tallinn", "Quito")
PETS = ("Biscuit", "Pepper", "Rocket", "Mango", "Ziggy", "Waffles", "Juniper", "Pickle", "Noodle", "Tofu", "Pixel")
COLORS = ("teal", "crimson", "olive", "maroon", "indigo", "beige", "scarlet", "turquoise", "lilac", "ochre")


class TaskLengthError(ValueError):
    """An item cannot be fitted to the length asked (the filler ran out, or the fixed parts alone are longer)."""


def token_length(tokenizer, text: str) -> int:
    """How many token ids `text` is (no special tokens added)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


class TextStream:
    """Held-out real text of one kind as one stream of token ids, tokenized lazily and read by position.

    Args:
        tokenizer: the tokenizer the lengths are counted in.
        documents (`list[Document]`): the corpus manifest; only its held-out split is read.
        kind (`str`): `"prose"` or `"code"`.
        seed (`int`): fixes the order of the files (`hf_kvmap.real.corpus`).
    """

    def __init__(self, tokenizer, documents: Sequence[Document], kind: str, seed: int):
        if kind not in ("prose", "code"):
            raise ValueError(f"kind={kind!r} must be 'prose' or 'code'.")
        self.kind, self._tokenizer = kind, tokenizer
        self._texts = (prose_texts if kind == "prose" else code_texts)(documents, "heldout", seed)
        self._ids: list[int] = []
        separator = "\n\n" if kind == "prose" else "\n\n\n"
        self._separator = tokenizer(separator, add_special_tokens=False)["input_ids"]

    def ids(self, start: int, count: int) -> list[int]:
        """`count` token ids from position `start` of the stream (texts joined by blank lines)."""
        while len(self._ids) < start + count:
            try:
                text = next(self._texts)
            except StopIteration:
                raise TaskLengthError(
                    f"The held-out {self.kind} holds {len(self._ids)} tokens, fewer than the {start + count} these "
                    "items need; build fewer or shorter items."
                ) from None
            self._ids += self._tokenizer(text.strip(), add_special_tokens=False)["input_ids"] + self._separator
        return self._ids[start : start + count]

    def text(self, start: int, count: int) -> str:
        """The decoded text of `ids(start, count)`, stripped."""
        return self._tokenizer.decode(self.ids(start, count)).strip()


def fit_to_length(make: Callable[[int], str], tokenizer, tokens: int, upper: int) -> tuple[str, int]:
    """The longest `make(n)` (for `n` in `[0, upper]`, `make` growing with `n`) that is at most `tokens` long, found by
    binary search; returns it and `n`.

    Raises:
        `TaskLengthError`: `make(0)` is already longer than `tokens`, or the best fit falls more than
            `LENGTH_TOLERANCE` short of it (`upper` too small: the filler ran out).
    """
    if token_length(tokenizer, make(0)) > tokens:
        raise TaskLengthError(
            f"An item without filler is already {token_length(tokenizer, make(0))} tokens, more than tokens={tokens}; "
            "ask for a longer length."
        )
    low, high = 0, upper
    while low < high:
        middle = (low + high + 1) // 2
        if token_length(tokenizer, make(middle)) <= tokens:
            low = middle
        else:
            high = middle - 1
    text = make(low)
    if token_length(tokenizer, text) < (1 - LENGTH_TOLERANCE) * tokens:
        raise TaskLengthError(
            f"The filler ran out: the longest item is {token_length(tokenizer, text)} tokens, short of tokens={tokens} "
            f"by more than {LENGTH_TOLERANCE:.0%}; ask for a shorter length."
        )
    return text, low


def sentence_cut(text: str, share: float) -> int:
    """A character position near `share` of `text` where a sentence (or at least a word) ends, to plant text at."""
    at = int(share * len(text))
    found = re.search(r"[.!?]\s|\n", text[at:])
    if found is None or found.end() > len(text) // 8 + 1:
        found = re.search(r"\s", text[at:])
    return len(text) if found is None else at + found.end()


def plant(text: str, planted: Sequence[tuple[float, str]]) -> str:
    """`text` with each `(share, sentence)` inserted at a sentence end near that share of it (in the order given where
    two land at one place)."""
    cuts = sorted((sentence_cut(text, share), order, sentence) for order, (share, sentence) in enumerate(planted))
    out, last = [], 0
    for cut, _, sentence in cuts:  # two sentences cut at one place keep the order they were given in
        out += [text[last:cut].rstrip(), sentence]
        last = cut
    out.append(text[last:].lstrip())
    return " ".join(part for part in out if part)


def chat_prompt(tokenizer, messages: list[dict], answer_prefix: str = "") -> str:
    """`messages` rendered with the tokenizer's chat template, ready for the assistant's turn, then `answer_prefix`
    (the start of the reply that the model continues, as RULER prompts chat models)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text + answer_prefix


def coded_word(rng: random.Random, letters: int = 6) -> str:
    """A random lowercase word of `letters` letters (RULER's coded words)."""
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(letters))


def string_match_all(reply: str, references: Sequence[str]) -> float:
    """RULER's `string_match_all`: the share of `references` found in `reply` (case-insensitive substrings), in
    [0, 1]."""
    if not references:
        raise ValueError("string_match_all needs at least one reference.")
    text = reply.lower()
    return sum(reference.lower() in text for reference in references) / len(references)


def string_match_listed(reply: str, references: Sequence[str]) -> float:
    """RULER's `string_match_all` held to the length of the list asked for: the references found in `reply`
    (case-insensitive substrings) over the larger of their count and the count of items the reply names (split at
    commas, semicolons, new lines and "and"). A reply that copies the whole list of candidates (which RULER's score
    credits with most references) scores its precision instead; a reply naming as many items as asked scores as
    RULER does."""
    found = string_match_all(reply, references) * len(references)
    named = [part for part in re.split(r",|;|\n|\band\b", reply) if re.search(r"[A-Za-z0-9]", part)]
    return found / max(len(references), len(named))


def words_of(text: str) -> set[str]:
    """The lowercase words of `text` (letters and digits; `Anna's` gives `anna` and `s`)."""
    return set(re.findall(r"[a-z0-9]+", text.lower()))


__all__ = [
    "COLORS",
    "KEY_ADJECTIVES",
    "LENGTH_TOLERANCE",
    "NAMES",
    "PETS",
    "TOWNS",
    "WORDS",
    "TaskLengthError",
    "TextStream",
    "chat_prompt",
    "coded_word",
    "fit_to_length",
    "plant",
    "sentence_cut",
    "string_match_all",
    "token_length",
    "words_of",
]
