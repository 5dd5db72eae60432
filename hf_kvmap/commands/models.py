"""Loading models named on the command line (`hf_kvmap.loading`), a refusal as a clean exit that names the command
and the argument it came from."""

from __future__ import annotations

from .. import loading


def check_model_folder(name: str, flag: str, command: str, tokenizer: bool = False) -> None:
    """Refuse a local folder without `config.json` (or, with `tokenizer`, without tokenizer files) by name."""
    try:
        loading.check_model_folder(name, tokenizer=tokenizer)
    except ValueError as err:
        raise SystemExit(f"hf-kvmap {command}: {flag} {err}") from None


def load_causal_lm(name: str, dtype=None):
    try:
        return loading.load_causal_lm(name, dtype=dtype)
    except loading.ModelFolderError as err:
        raise SystemExit(f"hf-kvmap eval: model {err}") from None
    except ValueError as err:
        raise SystemExit(f"hf-kvmap: {err}") from None


def load_mapper(name: str, command: str, flag: str | None = "--mapper"):
    """`MapperModel.from_pretrained(name)`, its refusal (missing folder, failed verification) as a clean exit that
    names the argument (`flag`, none for a positional one: the message names the folder) it came from."""
    from ..modeling_mapper import MapperModel

    try:
        return MapperModel.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise SystemExit(f"hf-kvmap {command}: {f'{flag} {name}: ' if flag else ''}{err}") from None


def load_tokenizer(name: str, padding_side: str = "left"):
    try:
        return loading.load_tokenizer(name, padding_side=padding_side)
    except loading.ModelFolderError as err:
        raise SystemExit(f"hf-kvmap eval: model {err}") from None


def resolve_mapper(mapper: str | None, source: str, target: str) -> str:
    try:
        return loading.resolve_mapper(mapper, source, target)
    except ValueError:
        raise SystemExit("--mapper is required unless --source and --target are tiny-family members.") from None
