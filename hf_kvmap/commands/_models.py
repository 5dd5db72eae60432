"""Loading models named on the command line: a tiny-family member name, a local folder or a Hub id."""

from __future__ import annotations


def load_causal_lm(name: str, dtype=None):
    import torch
    from transformers import AutoModelForCausalLM

    from .. import zoo

    if name in zoo.FAMILY:
        return zoo.load_model(name, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype or torch.float32).eval()


def load_tokenizer(name: str, padding_side: str = "left"):
    from transformers import AutoTokenizer

    from .. import zoo

    if name in zoo.FAMILY:
        return zoo.load_tokenizer(padding_side=padding_side)
    return AutoTokenizer.from_pretrained(name, padding_side=padding_side)


def resolve_mapper(mapper: str | None, source: str, target: str) -> str:
    from .. import zoo

    if mapper:
        return mapper
    if source in zoo.FAMILY and target in zoo.FAMILY:
        return str(zoo.mapper_path(source, target))
    raise SystemExit("--mapper is required unless --source and --target are tiny-family members.")
