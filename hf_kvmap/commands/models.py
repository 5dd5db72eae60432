"""Loading models named on the command line: a tiny-family member name, a local folder or a Hub id."""

from __future__ import annotations

#: Files of which a saved tokenizer has at least one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def check_model_folder(name: str, flag: str, command: str, tokenizer: bool = False) -> None:
    """Refuse a local folder without `config.json` (or, with `tokenizer`, without tokenizer files) by name."""
    from pathlib import Path

    folder = Path(name)
    if not folder.is_dir():
        return  # a Hub id (or a tiny-family name): resolved when it is loaded
    if not (folder / "config.json").is_file():
        raise SystemExit(
            f"hf-kvmap {command}: {flag} {folder} has no config.json: not a saved model folder (write one with "
            "`model.save_pretrained(folder)`)."
        )
    if tokenizer and not any((folder / file).is_file() for file in TOKENIZER_FILES):
        raise SystemExit(
            f"hf-kvmap {command}: {flag} {folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): "
            "save the tokenizer beside the model (`tokenizer.save_pretrained(folder)`)."
        )


def load_causal_lm(name: str, dtype=None):
    import torch
    from transformers import AutoModelForCausalLM

    from .. import zoo

    if name in zoo.FAMILY:
        return zoo.load_model(name, dtype=dtype)
    check_model_folder(name, "model", "eval")
    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype or torch.float32).eval()
    except (OSError, ValueError) as err:
        raise SystemExit(
            f"hf-kvmap: cannot load model {name!r}: it is not a tiny-family member ({', '.join(zoo.FAMILY)}), and "
            f"loading it as a folder or Hub id failed: {str(err).splitlines()[0]}"
        ) from None


def load_mapper(name: str, command: str, flag: str | None = "--mapper"):
    """`MapperModel.from_pretrained(name)`, its refusal (missing folder, failed verification) as a clean exit that
    names the argument (`flag`, none for a positional one: the message names the folder) it came from."""
    from ..modeling_mapper import MapperModel

    try:
        return MapperModel.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise SystemExit(f"hf-kvmap {command}: {f'{flag} {name}: ' if flag else ''}{err}") from None


def load_tokenizer(name: str, padding_side: str = "left"):
    from transformers import AutoTokenizer

    from .. import zoo

    if name in zoo.FAMILY:
        return zoo.load_tokenizer(padding_side=padding_side)
    check_model_folder(name, "model", "eval", tokenizer=True)
    return AutoTokenizer.from_pretrained(name, padding_side=padding_side)


def resolve_mapper(mapper: str | None, source: str, target: str) -> str:
    from .. import zoo

    if mapper:
        return mapper
    if source in zoo.FAMILY and target in zoo.FAMILY:
        return str(zoo.mapper_path(source, target))
    raise SystemExit("--mapper is required unless --source and --target are tiny-family members.")
