"""Loading a model, its tokenizer or a mapper by name: a tiny-family member (`hf_kvmap.zoo`), a local folder or a Hub
id, as the command line and the benchmarks name them.

```python
from hf_kvmap.loading import load_causal_lm, load_tokenizer, resolve_mapper

source, target = load_causal_lm("tiny-m"), load_causal_lm("tiny-l")
mapper = MapperModel.from_pretrained(resolve_mapper(None, "tiny-m", "tiny-l"))  # the shipped tiny-m -> tiny-l mapper
```
"""

from __future__ import annotations

from pathlib import Path

#: Files of which a saved tokenizer has at least one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


class ModelFolderError(ValueError):
    """A local folder named as a model that holds no saved model (or no tokenizer beside it)."""


def check_model_folder(name: str, tokenizer: bool = False) -> None:
    """Refuse ([`ModelFolderError`]) a local folder without `config.json` or, with `tokenizer`, without tokenizer files; a
    name that is no folder (a Hub id or a tiny-family member) passes, resolved when it is loaded."""
    folder = Path(name)
    if not folder.is_dir():
        return
    if not (folder / "config.json").is_file():
        raise ModelFolderError(
            f"{folder} has no config.json: not a saved model folder (write one with `model.save_pretrained(folder)`)."
        )
    if tokenizer and not any((folder / file).is_file() for file in TOKENIZER_FILES):
        raise ModelFolderError(
            f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): save the tokenizer beside the "
            "model (`tokenizer.save_pretrained(folder)`)."
        )


def load_causal_lm(name: str, dtype=None):
    """A tiny-family member by name (`zoo.load_model`), else `AutoModelForCausalLM.from_pretrained(name)` of a folder
    or Hub id in `dtype` (float32 by default), in eval mode; a folder without a saved model is refused
    ([`ModelFolderError`]), and so is a name none of them loads (`ValueError`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from . import zoo

    if name in zoo.FAMILY:
        return zoo.load_model(name, dtype=dtype)
    check_model_folder(name)
    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype or torch.float32).eval()
    except (OSError, ValueError) as err:
        raise ValueError(
            f"cannot load model {name!r}: it is not a tiny-family member ({', '.join(zoo.FAMILY)}), and "
            f"loading it as a folder or Hub id failed: {str(err).splitlines()[0]}"
        ) from None


def load_tokenizer(name: str, padding_side: str = "left"):
    """The tiny family's tokenizer for a member's name, else `AutoTokenizer.from_pretrained(name)`."""
    from transformers import AutoTokenizer

    from . import zoo

    if name in zoo.FAMILY:
        return zoo.load_tokenizer(padding_side=padding_side)
    check_model_folder(name, tokenizer=True)
    return AutoTokenizer.from_pretrained(name, padding_side=padding_side)


def resolve_mapper(mapper: str | None, source: str, target: str) -> str:
    """`mapper` when given, else the folder of the shipped mapper from tiny-family member `source` to `target`; a
    `ValueError` when neither names one."""
    from . import zoo

    if mapper:
        return mapper
    if source in zoo.FAMILY and target in zoo.FAMILY:
        return str(zoo.mapper_path(source, target))
    raise ValueError("a mapper is needed unless the source and the target are tiny-family members.")


__all__ = [
    "TOKENIZER_FILES",
    "ModelFolderError",
    "check_model_folder",
    "load_causal_lm",
    "load_tokenizer",
    "resolve_mapper",
]
