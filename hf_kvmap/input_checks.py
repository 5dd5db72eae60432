"""Checks of what a caller hands to `handoff`, `HandoffSession` and the savers, each raising an error that names the
problem and the fix: token ids (shape, dtype, range), the mask `generate` would infer from the pad token, a given
source cache against the prompt (at every position, from the first layer), thresholds, and where a mapper is
(the stale files a killed save leaves behind are `hf_kvmap.atomic`'s).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

#: relative error of a layer-0 key/value above which a given source cache is not the one of the prompt's tokens
#: (float32 recomputes it to ~1e-6; half precision to ~1e-3; another token or position is off by ~1)
SOURCE_CACHE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3, torch.float16: 5e-2, torch.bfloat16: 5e-2}


def vocabulary_size(model) -> int | None:
    """Rows of a model's input embedding (the ids it can read), `None` when it has none."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    return getattr(embeddings, "num_embeddings", None)


def check_token_ids(input_ids, models: Sequence = (), *, what: str = "input_ids") -> torch.Tensor:
    """`input_ids` as a `(batch, seq)` int64 tensor; refuses other shapes, float/bool dtypes, an empty batch and ids
    outside the vocabulary of any of `models`."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{what} must be a (batch, seq) tensor of token ids; got a {type(input_ids).__name__}.")
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise TypeError(
            f"{what} has dtype {input_ids.dtype}; pass integer token ids (the tokenizer's `input_ids`, "
            "`return_tensors='pt'`)."
        )
    if input_ids.dim() != 2:
        raise ValueError(f"{what} must be a (batch, seq) long tensor; got shape {tuple(input_ids.shape)}.")
    if input_ids.shape[0] == 0:
        raise ValueError(f"{what} is an empty batch (shape {tuple(input_ids.shape)}): pass at least one prompt.")
    input_ids = input_ids.long()
    check_vocabulary(input_ids, models, what=what)
    return input_ids


def check_vocabulary(input_ids: torch.Tensor, models: Sequence, *, what: str = "input_ids") -> None:
    """Refuse ids below 0 or at least the smallest vocabulary of `models` (an embedding lookup would fail or, on
    some devices, read garbage)."""
    sizes = [size for size in map(vocabulary_size, models) if size]
    if not input_ids.numel() or not sizes:
        return
    vocab = min(sizes)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(
            f"{what} holds token id {bad}, outside the models' vocabulary of {vocab} (ids 0 .. {vocab - 1}): "
            "tokenize with the models' own tokenizer."
        )


def as_token_row(token_ids, models: Sequence = ()) -> torch.Tensor:
    """One turn of a conversation as a `(1, n)` int64 tensor: a 1-D or 1-row tensor, a list of ints, or a tokenizer
    output (`BatchEncoding`/dict with `input_ids`)."""
    if isinstance(token_ids, Mapping):
        if "input_ids" not in token_ids:
            raise TypeError(f"A {type(token_ids).__name__} without `input_ids` is not a turn; pass the token ids.")
        token_ids = token_ids["input_ids"]
    if isinstance(token_ids, (str, bytes)):
        raise TypeError(
            f"Got a {type(token_ids).__name__}; a session holds token ids: pass `tokenizer(text)['input_ids']` "
            "(or the tokenizer's output itself)."
        )
    if not isinstance(token_ids, torch.Tensor):
        flat = token_ids
        while isinstance(flat, (list, tuple)) and flat and isinstance(flat[0], (list, tuple)):
            flat = [item for row in flat for item in row] if len(flat) == 1 else flat[0]
        if isinstance(flat, (list, tuple)) and any(isinstance(t, bool) or not isinstance(t, int) for t in flat):
            raise TypeError("A turn must be integer token ids; got non-integer entries (floats, strings, ...).")
        try:
            token_ids = torch.tensor(token_ids, dtype=torch.long)
        except (TypeError, ValueError) as err:
            raise TypeError(f"A turn must be integer token ids ({err}).") from None
    if token_ids.dtype == torch.bool or token_ids.is_floating_point() or token_ids.is_complex():
        raise TypeError(
            f"The turn has dtype {token_ids.dtype} (bool/float ids would be truncated); pass integer token ids."
        )
    if token_ids.dim() == 2 and token_ids.shape[0] != 1:
        raise ValueError(
            f"The turn has {token_ids.shape[0]} rows: a session is one conversation (batch 1); append one row, and "
            "run one session per conversation."
        )
    if token_ids.dim() > 2:
        raise ValueError(f"The turn has shape {tuple(token_ids.shape)}; pass a 1-D or (1, n) tensor of token ids.")
    row = token_ids.long().reshape(1, -1)
    check_vocabulary(row, models, what="The turn")
    return row


def eos_token_ids(model) -> list[int]:
    """The end-of-sequence ids of `model`'s generation config, as a list (empty when it has none)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(token) for token in eos])


def generate_mask(model, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The attention mask `model.generate(input_ids)` infers without one (`input_ids != pad_token_id` where the pad
    token occurs and differs from every eos token), or `None` when it infers all ones."""
    config = getattr(model, "generation_config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        return None
    if pad in eos_token_ids(model) or not bool((input_ids == pad).any()):
        return None
    return (input_ids != pad).long()


def derive_mask(model, input_ids: torch.Tensor) -> torch.Tensor | None:
    """`generate_mask`, refused where it is no left padding (a pad token id after a token)."""
    mask = generate_mask(model, input_ids)
    if mask is None:
        return None
    inner = mask[:, 1:] < mask[:, :-1]
    if bool(inner.any()):
        row, col = inner.nonzero()[0].tolist()
        pad = model.generation_config.pad_token_id
        raise ValueError(
            f"input_ids row {row} holds the pad token id {pad} at column {col + 1}, after a token, and no "
            "attention_mask was passed: `generate` would mask it out there. Pass the tokenizer's attention_mask "
            "(left padding), or generate with an explicit mask."
        )
    if bool((mask.sum(-1) == 0).any()):
        raise ValueError("A row of input_ids is all padding (the pad token id); drop it or pass attention_mask.")
    return mask


def check_left_padding_mask(attention_mask: torch.Tensor, hold_back: int | None = None) -> None:
    """Refuse an attention mask of values other than 0/1, or with padding after a token (right or inner padding):
    only left-padded batches map exactly, and a fallback would otherwise serve what no mapping can match. With
    `hold_back`, also refuse a row with no token left to map after holding back that many."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask is a {type(attention_mask).__name__}; pass the tokenizer's mask tensor.")
    values = (
        attention_mask if attention_mask.is_floating_point() or attention_mask.is_complex() else attention_mask.long()
    )
    if not bool(((values == 0) | (values == 1)).all()):
        raise ValueError(
            "attention_mask may hold only 0 and 1 (padding and tokens); got other values. Pass the tokenizer's "
            "left-padded 0/1 mask."
        )
    tokens = values.real.long() if values.is_complex() else values.long()
    inner = tokens[:, 1:] < tokens[:, :-1]
    if bool(inner.any()):
        row = int(inner.any(-1).nonzero()[0])
        raise ValueError(
            f"attention_mask row {row} has padding after a token (right padding): only left-padded batches map "
            "exactly. Pass a left-padded 0/1 mask: tokenize with `padding_side='left'`."
        )
    if hold_back is not None:
        counts = tokens.sum(-1)
        if bool((counts <= hold_back).any()):
            row = int((counts <= hold_back).nonzero()[0])
            raise ValueError(
                f"attention_mask row {row} has {int(counts[row])} token(s), none left to map after holding back "
                f"{hold_back}."
            )


#: The dtypes a mapped cache may be built in (what attention layers compute in).
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_mapping_request(
    batch: int,
    seq: int,
    *,
    hold_back,
    dtype,
    attention_mask,
    source_position_ids,
    position_ids,
    target_model,
    input_ids,
    source_model,
    repair,
) -> None:
    """The arguments of `MappedCache.from_source` against each other and the source cache's `(batch, seq)`; each
    refusal names the argument and what to pass instead."""
    from .validation import check_int

    check_int(
        "hold_back",
        hold_back,
        1,
        meaning=": at least the final prompt token must be held back for the target to run (a cache covering the "
        "whole prompt makes `generate` re-process it and return wrong tokens)",
    )
    if hold_back >= seq:
        raise ValueError(
            f"hold_back={hold_back} leaves nothing to map: the source cache holds only {seq} tokens. "
            "Use a smaller hold_back or prefill more context."
        )
    if dtype is not None and dtype not in CACHE_DTYPES:
        raise ValueError(
            f"dtype={dtype!r}: a mapped cache holds the float dtypes a model computes in, one of "
            f"{[str(d).removeprefix('torch.') for d in CACHE_DTYPES]}."
        )
    if attention_mask is not None and position_ids is not None:
        raise ValueError("Pass either `attention_mask` or `position_ids`, not both.")
    if position_ids is not None and source_position_ids is not None:
        raise ValueError(
            "Pass either `position_ids` (the cache is read where it was built) or `source_position_ids` with "
            "an `attention_mask` (built at one set of positions, read at another), not both."
        )
    for name, tensor in (
        ("attention_mask", attention_mask),
        ("source_position_ids", source_position_ids),
        ("position_ids", position_ids),
    ):
        if tensor is not None and tuple(tensor.shape) != (batch, seq):
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but the source cache covers (batch, seq) = {(batch, seq)}."
            )
    if attention_mask is not None:
        check_left_padding_mask(attention_mask, hold_back)
    if target_model is not None and input_ids is None:
        raise ValueError("Pass `target_model` and `input_ids` together (the target computes its first layer).")
    if source_model is not None and input_ids is None:
        raise ValueError(
            "source_model checks the source cache against the prompt's token ids: pass `input_ids` with it."
        )
    if input_ids is not None and target_model is None and source_model is None:
        raise ValueError(
            "input_ids are read by `target_model` (it computes its first layer) or `source_model` (it checks the "
            "source cache): pass one of them with the ids, or leave the ids out."
        )
    if repair is not None and target_model is None:
        raise ValueError(
            "repair= needs the target: pass `target_model` and `input_ids` (the target recomputes the selected "
            "positions from the token ids)."
        )
    if input_ids is not None and tuple(input_ids.shape) != (batch, seq):
        raise ValueError(f"input_ids have shape {tuple(input_ids.shape)}; the source cache covers {(batch, seq)}.")


def check_threshold(threshold, where: str) -> float:
    """A probe threshold as a float; refuses NaN (every `risk > nan` is False: it would accept everything)."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise ValueError(f"threshold={threshold!r} ({where}) must be a number.")
    if math.isnan(threshold):
        raise ValueError(
            f"threshold=nan ({where}): every risk compares False with NaN, so it would accept every mapped cache. "
            "Pass a finite threshold, or recalibrate with `hf_kvmap.calibrate_probe`."
        )
    return float(threshold)


@torch.no_grad()
def relative_error_by_position(mine: torch.Tensor, own: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`(batch, seq)` relative L2 error of `(batch, heads, seq, dim)` tensors per position (0 on padding)."""
    own = own.float()
    mine = mine.float().to(own.device)
    diff = (mine - own).pow(2).sum((1, 3))
    norm = own.pow(2).sum((1, 3)).clamp_min(1e-30)
    return ((diff / norm).sqrt() * mask.to(own.device)).nan_to_num(nan=float("inf")).cpu()


@torch.no_grad()
def first_layer_error(model, input_ids, position_ids, mask, keys, values) -> torch.Tensor:
    """`(batch, seq)` worst relative error of given layer-0 `keys`/`values` against the ones `model` computes from
    `input_ids` at `position_ids` (they depend on nothing else)."""
    from .first_layer import target_first_layer

    own_keys, own_values = target_first_layer(model, input_ids, position_ids)
    return torch.maximum(
        relative_error_by_position(keys, own_keys, mask), relative_error_by_position(values, own_values, mask)
    )


def check_source_cache(source, first_layer, input_ids, position_ids, mask) -> None:
    """Refuse a source cache that is not the source's cache of `input_ids`: its layer 0 (`first_layer`, the
    `(keys, values)` pair) must be what the source computes from each token at its position, at every real
    position. A layer 0 holding NaN or inf is left to the mapping's finiteness check (a corrupted cache, which
    `handoff`'s policy handles like any other layer's)."""
    keys, values = first_layer
    if keys is None or keys.dim() != 4 or tuple(keys.shape[::2]) != tuple(input_ids.shape):
        return  # from_source names the layout problem
    if not bool(torch.isfinite(keys).all() and torch.isfinite(values).all()):
        return  # a corrupted cache, not another prompt's: the mapping's finiteness check names it, the policy handles it
    error = first_layer_error(source, input_ids, position_ids, mask, keys, values)
    tolerance = SOURCE_CACHE_TOLERANCE.get(keys.dtype, 5e-2)
    bad = error > tolerance
    if bool(bad.any()):
        row, col = bad.nonzero()[0].tolist()
        raise ValueError(
            f"source_cache is not the source's cache of these input_ids: its first layer differs from what the "
            f"source computes for row {row}'s token at position {col} (relative error {float(error[row, col]):.3g}; "
            f"{int(bad.sum())} position(s) in all). Pass the cache of exactly these tokens "
            "(the cache `source(input_ids, use_cache=True)` returns), or none and let the handoff prefill them; "
            "for a left-padded cache built at mask positions, pass `source_position_ids`."
        )


def looks_local(name) -> bool:
    """Whether a model name is meant as a local path rather than a Hub id (`owner/name`)."""
    if isinstance(name, os.PathLike):
        return True
    text = str(name)
    return text.startswith((".", "/", "~")) or os.path.isabs(text) or text.count("/") > 1 or "\\" in text


#: what every saved mapper config records (with the names configs were saved with before); without them a mapper
#: cannot be applied as it was fitted
SAVED_CONFIG_FIELDS = {
    "source_summary": ("source_summary", "source_config"),
    "target_summary": ("target_summary", "target_config"),
    "source_layers": ("source_layers",),
}


def check_saved_config(path: Path) -> None:
    """Refuse a mapper `config.json` that is not valid JSON, not a JSON object, or lacks a field every saved config
    records (`SAVED_CONFIG_FIELDS`), naming the file and the field."""
    import json

    fix = "the file was damaged or edited: re-save the mapper with `save_pretrained`, or download it again."
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}): {fix}") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{path} holds a JSON {type(data).__name__}, not a mapper config (an object of fields): {fix}"
        )
    missing = [field for field, names in SAVED_CONFIG_FIELDS.items() if all(data.get(name) is None for name in names)]
    if missing:
        raise ValueError(
            f"{path} records no {', '.join(f'`{field}`' for field in missing)}, which every saved mapper config "
            f"records (what the mapper reads and maps): {fix}"
        )


def check_mapper_location(name, subfolder: str | None = None) -> None:
    """Refuse a local mapper path that does not exist, a folder without `config.json` and a `config.json` that is no
    saved mapper config (`check_saved_config`), by name (not as a bad Hub id)."""
    from .atomic import recover_folder

    path = Path(os.path.expanduser(str(name)))
    recover_folder(path)  # a save killed between its two renames (where folders cannot be exchanged)
    if path.is_dir():
        folder = path / (subfolder or "")
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"{folder} has no config.json: not a saved mapper folder (write one with `mapper.save_pretrained("
                "folder)`, or name the folder that holds it)."
            )
        check_saved_config(folder / "config.json")
    elif path.exists():
        raise ValueError(f"{name} is a file, not a mapper folder: pass the folder `save_pretrained` wrote.")
    elif looks_local(name):
        raise ValueError(
            f"{name}: no such folder. It is read as a local path (a Hub id looks like 'owner/name'); check the path, "
            "or save a mapper there with `mapper.save_pretrained`."
        )
