"""Character-level tokenizer shared by every member of the tiny family.

Vocabulary: ``<pad> <bos> <eos> <unk>``, the chat markers ``<|user|> <|assistant|> <|end|>`` (single
tokens), then one token per character of :data:`hf_kvmap.zoo.corpus.ALPHABET`. Encoding prepends
``<bos>``; decoding concatenates characters (no spaces inserted), so
``decode(encode(text), skip_special_tokens=True) == text`` for any corpus text.
"""

from __future__ import annotations

import json
import os

from .corpus import ALPHABET, BOS, CHAT_MARKERS, EOS, PAD, SPECIAL_TOKENS, UNK

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|end|>"
    "{% else %}{{ raise_exception('only user and assistant roles are supported') }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def vocab() -> dict[str, int]:
    toks = list(SPECIAL_TOKENS) + list(CHAT_MARKERS) + list(ALPHABET)
    return {t: i for i, t in enumerate(toks)}


def build_tokenizer():
    """A ``transformers.PreTrainedTokenizerFast`` over the character vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    v = vocab()
    tok = Tokenizer(models.WordLevel(vocab=v, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # chat markers: single tokens that survive decode(skip_special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_MARKERS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, v[BOS])]
    )
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        padding_side="right",
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
        **special,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(folder: str | os.PathLike) -> None:
    tok = build_tokenizer()
    tok.save_pretrained(str(folder))
    # make sure a special_tokens_map.json sits beside tokenizer.json for older loaders
    path = os.path.join(str(folder), "special_tokens_map.json")
    if not os.path.exists(path):
        with open(path, "w") as f:
            json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}, f, indent=2)
