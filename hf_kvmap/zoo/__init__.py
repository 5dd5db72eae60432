"""The tiny trained Qwen3 family that hf-kvmap ships (the default for the demo, examples and quality tests).

Members (see :data:`FAMILY` and ``family/README.md``): ``tiny-s``, ``tiny-m``, ``tiny-l`` share KV geometry
(2 KV heads of dim 32) at growing depth/width; ``tiny-x`` has mismatched KV geometry (4 KV heads of dim 16).
All share one character-level tokenizer (``family/tokenizer``).

    from hf_kvmap import zoo
    tok = zoo.load_tokenizer()
    small, large = zoo.load_model("tiny-s"), zoo.load_model("tiny-l")

Importing this package loads neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .family import FAMILY, MATCHED, MISMATCHED

__all__ = [
    "FAMILY",
    "FAMILY_DIR",
    "MATCHED",
    "MISMATCHED",
    "list_models",
    "tiny_family_tasks",
    "load_model",
    "load_tokenizer",
    "model_path",
    "tokenizer_path",
]

if TYPE_CHECKING:
    from ..evaluation import TaskSpec

FAMILY_DIR = Path(__file__).resolve().parent / "family"


def list_models(available_only: bool = False) -> list[str]:
    """Member names, smallest matched member first; ``available_only`` keeps those whose weights are present."""
    names = list(FAMILY)
    if available_only:
        names = [n for n in names if (FAMILY_DIR / n / "model.safetensors").exists()]
    return names


def model_path(name: str) -> Path:
    """Folder holding member ``name`` (``config.json``, ``model.safetensors``, ``generation_config.json``)."""
    if name not in FAMILY:
        raise KeyError(f"unknown tiny-family member {name!r}; known: {', '.join(FAMILY)}")
    return FAMILY_DIR / name


def tokenizer_path() -> Path:
    return FAMILY_DIR / "tokenizer"


def load_model(name: str, dtype=None, **kwargs):
    """``Qwen3ForCausalLM.from_pretrained(model_path(name), dtype=dtype or torch.float32)`` in eval mode."""
    import torch
    from transformers import Qwen3ForCausalLM

    from .._compat import set_model_revision

    path = model_path(name)
    if not (path / "model.safetensors").exists():
        raise FileNotFoundError(
            f"weights of {name!r} are missing at {path}; train them with examples/train_tiny_family.py --members {name}"
        )
    model = Qwen3ForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32, **kwargs)
    model.eval()
    # A stable identity for the approval tuple: the member's name and a revision derived from its weights file.
    model.config.name_or_path = f"hf_kvmap.zoo:{name}"
    set_model_revision(model.config, weights_revision(name))
    return model


def weights_revision(name: str) -> str:
    """The revision of a shipped member: the first 40 hex digits of the sha256 of its weights file."""
    import hashlib

    return hashlib.sha256((model_path(name) / "model.safetensors").read_bytes()).hexdigest()[:40]


def load_tokenizer(padding_side: str = "right", **kwargs):
    """The family's shared tokenizer (``AutoTokenizer.from_pretrained(tokenizer_path())``).

    Use ``padding_side="left"`` for batched generation.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_path()), padding_side=padding_side, **kwargs)


MAPPERS_DIR = Path(__file__).resolve().parent / "mappers"


def mapper_path(source: str, target: str) -> Path:
    """Folder of the shipped mapper from member ``source`` to member ``target`` (``mappers/<source>-to-<target>``)."""
    for name in (source, target):
        if name not in FAMILY:
            raise KeyError(f"unknown tiny-family member {name!r}; known: {', '.join(FAMILY)}")
    path = MAPPERS_DIR / f"{source}-to-{target}"
    if not (path / "config.json").exists():
        shipped = sorted(p.name for p in MAPPERS_DIR.iterdir() if (p / "config.json").exists())
        raise FileNotFoundError(
            f"No mapper {path.name} in this installation (it has {', '.join(shipped) or 'none'}): the package ships "
            "four (tiny-s/m/x -> tiny-l, tiny-l -> tiny-s). Reinstall the package, or fit it with "
            f"`python examples/fit_tiny_family_mappers.py --pairs {source}:{target}`."
        )
    return path


def calibration_batches(tokenizer, docs: int = 256, length: int = 512, batch_size: int = 16, seed: int = 0) -> list:
    """Fixed-length `(batch, length)` token-id batches cut from the family's calibration text (seed stream `seed`).

    Documents shorter than `length` tokens are dropped; raises `ValueError` when none is long enough.
    """
    import torch

    from .corpus import calibration_text

    sequences = []
    for text in calibration_text(n_docs=docs, seed=seed, n_chars=length + 16):
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= length:
            sequences.append(ids[:length])
    if not sequences:
        raise ValueError(f"No calibration document reached {length} tokens; use a smaller length.")
    return list(torch.tensor(sequences).split(batch_size))


#: the task mix of `context_batches`: the documents whose later tokens read facts stated earlier (recall, chat, copy)
CONTEXT_MIXTURE = {"recall": 0.35, "chat": 0.3, "copy": 0.1, "text": 0.1, "choice": 0.1, "arithmetic": 0.05}


def context_batches(
    tokenizer,
    docs: int = 256,
    length: int = 320,
    batch_size: int = 16,
    seed: int = 11,
    mixture: dict[str, float] | None = None,
) -> list:
    """Fixed-length `(batch, length)` token-id batches of the family's training-stream documents (`corpus.
    training_documents`, seed `seed`), weighted towards the documents that read back what they stated earlier
    (`CONTEXT_MIXTURE`): calibration text for the end-to-end objective, whose loss only sees what the target reads
    across the mapped prefix. Never the evaluation items (those come from their own seed stream).
    """
    import torch

    from .corpus import training_documents

    sequences, start = [], 0
    while len(sequences) < docs:
        for text in training_documents(
            64, seed=seed, n_chars=length + 64, start=start, mixture=mixture or CONTEXT_MIXTURE
        ):
            ids = tokenizer(text)["input_ids"]
            if len(ids) >= length:
                sequences.append(ids[:length])
        start += 64
        if start > 64 * max(docs, 16):
            raise ValueError(f"Too few training documents reach {length} tokens; use a smaller length.")
    return list(torch.tensor(sequences[:docs]).split(batch_size))


def tiny_family_tasks(items: int = 200, seed: int = 1234) -> list[TaskSpec]:
    """The task set of the shipped tiny family (`hf_kvmap.zoo.corpus`), as the demo and the cards use it."""
    from ..evaluation import TaskSpec
    from . import corpus

    return [
        TaskSpec("recall", "exact_match", corpus.make_eval_set("recall", items, seed=seed), stop="\n"),
        TaskSpec("arithmetic", "exact_match", corpus.make_eval_set("arithmetic", items, seed=seed), stop="\n"),
        TaskSpec("choice", "choice", corpus.make_eval_set("choice", items, seed=seed), chance=0.25),
        TaskSpec("chat", "exact_match", corpus.make_eval_set("chat", items, seed=seed), stop=corpus.END),
        TaskSpec("text", "perplexity", corpus.make_eval_set("text", max(items // 4, 4), seed=seed, n_chars=384)),
    ]
