"""`hf-kvmap fit`: collect calibration statistics through a source and a target model, and write a ridge or MLP
mapper."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path

from transformers.utils import logging

from ..configuration_mapper import INPUT_KINDS, LAMBDA_CONVENTIONS, MAPPER_KINDS, OBJECTIVES
from ..fit_options import ATTENTION_LOSSES, ATTENTION_SPACES, MLP_INITS, FitOptions
from . import _args

logger = logging.get_logger(__name__)

_MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
# `--flag`s whose default is the `FitOptions` field of the same name: (flag, argparse arguments, help)
_MAPPER_FLAGS = (
    ("--kind", {"choices": MAPPER_KINDS}, "Mapper kind (ridge: closed form)"),
    (
        "--context-window",
        {"type": int},
        "Earlier positions each map also reads (0: the paper's per-position map); fitted on features kept in memory "
        "(see --max-feature-memory)",
    ),
    (
        "--input-kinds",
        {"choices": INPUT_KINDS},
        "'same': keys map from source keys, values from source values; 'both': each map reads both",
    ),
    ("--top-k", {"type": str}, "Source layers per target layer, or 'all'"),
    ("--ridge-lambda", {"type": float}, "Ridge penalty"),
    (
        "--lambda-convention",
        {"choices": LAMBDA_CONVENTIONS},
        "'absolute': X^T X + lambda I; 'per_token': X^T X + N lambda I",
    ),
)
_MLP_FLAGS = (
    ("--hidden-size", {"type": int}, "Width of both hidden layers"),
    ("--epochs", {"type": int}, "Maximum passes over the training split"),
    ("--batch-tokens", {"type": int}, "Positions per Adam step"),
    ("--lr", {"type": float}, "Adam learning rate"),
    ("--warmup-steps", {"type": int}, "Linear learning-rate warmup (Adam steps)"),
    ("--val-fraction", {"type": float}, "Share of sequences held out for early stopping"),
    ("--patience", {"type": int}, "Epochs without a better validation MSE before stopping"),
    ("--init", {"choices": MLP_INITS}, "Start from the ridge solution or random"),
    ("--seed", {"type": int}, "Seed of the initialization and shuffling"),
)
_KL_FLAGS = (
    ("--kl-steps", {"type": int}, "Most Adam steps"),
    ("--kl-lr", {"type": float}, "Adam learning rate"),
    ("--kl-batch-size", {"type": int}, "Sequences per step"),
    ("--kl-eval-every", {"type": int}, "Steps between held-out evaluations"),
    ("--kl-patience", {"type": int}, "Evaluations without a better held-out KL before stopping"),
    ("--kl-val-sequences", {"type": int}, "Calibration sequences held out"),
    ("--kl-min-prefix", {"type": int}, "Shortest mapped prefix (and suffix) of a cut"),
)
_ATTN_FLAGS = (
    ("--attn-steps", {"type": int}, "Most Adam steps"),
    ("--attn-lr", {"type": float}, "Adam learning rate"),
    ("--attn-batch-size", {"type": int}, "Sequences per step"),
    ("--attn-eval-every", {"type": int}, "Steps between held-out evaluations"),
    ("--attn-patience", {"type": int}, "Evaluations without a better held-out error before stopping"),
    ("--attn-val-sequences", {"type": int}, "Calibration sequences held out"),
    ("--attn-min-prefix", {"type": int}, "Shortest mapped prefix (and suffix) of a cut"),
    ("--attn-loss", {"choices": ATTENTION_LOSSES}, "output: attention outputs; logits: logits over the mapped keys"),
    ("--attn-space", {"choices": ATTENTION_SPACES}, "residual: outputs through o_proj; heads: the heads' outputs"),
)
_TEXT_BLOCK_CHARS = 1 << 16


def parse_layer_window(spec: str) -> tuple[int, str, dict]:
    """`LAYER:PART=W[:both]` (e.g. `3:key=3:both`) -> `(3, "key", {"context_window": 3, "input_kinds": "both"})`."""
    try:
        where, what = spec.split("=")
        layer, part = where.split(":")
        window, *kinds = what.split(":")
        entry = {"context_window": int(window), "input_kinds": kinds[0] if kinds else "same"}
        if part not in ("key", "value") or len(kinds) > 1:
            raise ValueError
        return int(layer), part, entry
    except ValueError:
        raise SystemExit(
            f"hf-kvmap fit: --layer-window takes LAYER:PART=WINDOW[:both] (e.g. 3:key=3:both), got {spec!r}."
        ) from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "fit",
        help="Fit a ridge or MLP KV-cache mapper from a source model to a target model.",
        description=(
            "One streaming pass of calibration text through both models collects sufficient statistics; the mapper "
            "(top-k source layers per target layer by the single-source probe, closed-form ridge) is solved from them "
            "and saved with save_pretrained, together with selection.json (and selection.png with matplotlib). "
            "With --kind mlp a second pass keeps the features of the selected layers in memory and trains one MLP "
            "per target layer, KV head and K/V on them (MSE, Adam, early stopping on held-out sequences), starting "
            "from the ridge solution; training_curves.png shows its learning curves."
        ),
    )
    parser.add_argument("--source", help="Source model: Hub id or local folder.")
    parser.add_argument("--target", help="Target model: Hub id or local folder.")
    parser.add_argument("--data", help="Calibration text: a .txt file, or .jsonl with a 'text' field.")
    parser.add_argument("--out", required=True, help="Folder to write the mapper to.")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace --out even when it holds something other than a mapper of the same source and target.",
    )
    parser.add_argument(
        "--layer-window",
        action="append",
        default=[],
        metavar="LAYER:PART=W[:both]",
        help="A context window for one map only (repeatable), e.g. 3:key=3:both for target layer 3's keys; the "
        "other maps keep --context-window/--input-kinds",
    )
    parser.add_argument(
        "--key-norm",
        action="store_true",
        help="Normalise each predicted key head with the target's own key norm (Qwen3 k_norm)",
    )
    parser.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default=FitOptions.objective,
        help="mse: the fit alone; kl: then fine-tune end to end so the target reading the mapped cache reproduces "
        "its own next-token distributions on the calibration text; attention: then fine-tune so that the target's "
        "own queries read the same attention output in every layer (no backward through the target); "
        "attention+kl: both in turn (default: %(default)s)",
    )
    parser.add_argument(
        "--attn-no-normalize",
        dest="attn_normalize",
        action="store_false",
        help="Attention fine-tune: mean squared error per layer instead of relative to the reference's energy",
    )
    for group, flags in (
        (parser, _MAPPER_FLAGS),
        (parser.add_argument_group("MLP training (--kind mlp)"), _MLP_FLAGS),
        (parser.add_argument_group("end-to-end fine-tune (--objective kl)"), _KL_FLAGS),
        (parser.add_argument_group("attention fine-tune (--objective attention)"), _ATTN_FLAGS),
    ):
        for flag, extra, text in flags:
            field = flag[2:].replace("-", "_")
            group.add_argument(
                flag, default=getattr(FitOptions, field), help=f"{text} (default: %(default)s)", **extra
            )
    parser.add_argument("--seq-len", type=int, default=1024, help="Tokens per calibration sequence (default: 1024).")
    parser.add_argument("--stride", type=int, default=4, help="Keep every stride-th position (default: 4).")
    parser.add_argument("--max-sequences", type=int, default=500, help="Calibration sequences (default: 500).")
    parser.add_argument("--batch-size", type=int, default=1, help="Sequences per forward pass (default: 1).")
    parser.add_argument(
        "--stats",
        type=_args.statistics_folder,
        default=None,
        help="Also save the calibration statistics to this folder.",
    )
    parser.add_argument(
        "--from-stats",
        type=_args.saved_statistics,
        default=None,
        help="Solve from statistics saved with --stats instead of running the models (sweep --top-k/--ridge-lambda "
        "for free); --source/--target/--data are then not needed.",
    )
    parser.add_argument(
        "--dtype",
        choices=("float64", "float32"),
        default="float64",
        help="Accumulation dtype of the statistics (default: float64; solves are always float64).",
    )
    parser.add_argument(
        "--max-feature-memory",
        type=float,
        default=FitOptions.max_memory_bytes / 2**30,
        help="GiB of calibration features an MLP or windowed mapper may keep in memory (default: %(default)s).",
    )
    parser.add_argument("--model-dtype", choices=_MODEL_DTYPES, default="auto", help="dtype to load the models in.")
    parser.add_argument("--mapper-dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--device-map", default=None, help="accelerate device_map for both models (e.g. 'auto').")
    parser.add_argument("--statistics-device", default=None, help="Where the sums live (default: source's device).")
    parser.add_argument("--no-progress", action="store_true", help="Hide progress bars.")
    parser.set_defaults(func=run)
    return parser


def check_data(path: str) -> None:
    """Report every malformed line of a calibration file (`path:line: what is wrong`) before any model runs."""
    if not path.endswith((".txt", ".jsonl")):
        raise SystemExit(f"hf-kvmap fit: --data must be a .txt or .jsonl file, got {path}.")
    if not os.path.isfile(path):
        raise SystemExit(f"hf-kvmap fit: --data {path} does not exist.")
    if path.endswith(".txt"):
        if os.path.getsize(path) == 0:
            raise SystemExit(f"hf-kvmap fit: {path} is empty.")
        _check_utf8(path)
        return
    from ..reporting import jsonl_objects

    errors: list[str] = []
    for number, record in jsonl_objects(path, errors, "an object with a 'text' field"):
        if "text" not in record:
            errors.append(f"{path}:{number}: has no 'text' field.")
        elif not isinstance(record["text"], str):
            errors.append(f"{path}:{number}: text must be a string, got {type(record['text']).__name__}.")
        elif not record["text"]:
            errors.append(f"{path}:{number}: text is empty.")
    if errors:
        raise SystemExit(f"hf-kvmap fit: {path}: {len(errors)} malformed line(s):\n" + "\n".join(errors))


def _check_utf8(path: str) -> None:
    """Refuse a text file that is not UTF-8, naming the first bad byte's offset (read in 16 MiB blocks)."""
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as handle:
        while True:
            block = handle.read(1 << 24)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                raise SystemExit(
                    f"hf-kvmap fit: --data {path} is not UTF-8 text (byte {offset + err.start}: {err.reason}); save "
                    "it as UTF-8."
                ) from None
            if not block:
                return
            offset += len(block)


def _texts(path: str) -> Iterator[str]:
    """Documents of a .jsonl file (one per line, 'text' field), or blocks of whole lines of a .txt file."""
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if "text" not in record:
                    raise SystemExit(f"hf-kvmap fit: {path} line {number} has no 'text' field.")
                yield record["text"]
        return
    if not path.endswith(".txt"):
        raise SystemExit(f"hf-kvmap fit: --data must be a .txt or .jsonl file, got {path}.")
    block: list[str] = []
    size = 0
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            block.append(line)
            size += len(line)
            if size >= _TEXT_BLOCK_CHARS:
                yield "".join(block)
                block, size = [], 0
    if block:
        yield "".join(block)


def calibration_sequences(tokenizer, path: str, seq_len: int, max_sequences: int) -> list[list[int]]:
    """Tokenize the data file and cut the token stream into `max_sequences` sequences of `seq_len` tokens.

    .jsonl documents are separated by the tokenizer's EOS token (when it has one); a .txt file is one stream.
    """
    if seq_len < 2 or max_sequences < 1:
        raise SystemExit(
            f"hf-kvmap fit: need --seq-len >= 2 and --max-sequences >= 1 (got {seq_len}, {max_sequences})."
        )
    needed = seq_len * max_sequences
    stream: list[int] = []
    separator = [tokenizer.eos_token_id] if path.endswith(".jsonl") and tokenizer.eos_token_id is not None else []
    try:
        for text in _texts(path):
            stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            stream.extend(separator)
            if len(stream) >= needed:
                break
    except UnicodeDecodeError as err:  # read before any model loads
        raise SystemExit(f"hf-kvmap fit: --data {path} is not UTF-8 text ({err.reason}); save it as UTF-8.") from None
    count = min(max_sequences, len(stream) // seq_len)
    if count == 0:
        raise SystemExit(f"hf-kvmap fit: {path} holds {len(stream)} tokens, fewer than one sequence of {seq_len}.")
    if count < max_sequences:
        logger.warning(f"{path} yields only {count} sequences of {seq_len} tokens (asked for {max_sequences}).")
    return [stream[i * seq_len : (i + 1) * seq_len] for i in range(count)]


def _loaded(flag: str, name: str, what: str, load, **kwargs):
    """`load(name, **kwargs)`; a failure (a Hub id that is neither cached nor reachable, a folder without the files)
    as a clean exit naming the flag and the fix."""
    try:
        return load(name, **kwargs)
    except (OSError, ValueError) as err:
        raise SystemExit(
            f"hf-kvmap fit: cannot load the {what} of {flag} {name}: {str(err).splitlines()[0]} Pass a local model "
            "folder, or a Hub id that is reachable or already in the Hub cache (HF_HUB_OFFLINE=1 reads it from there)."
        ) from None


def _check_tokenizers(source_tokenizer, target: str) -> None:
    from transformers import AutoTokenizer

    try:
        target_tokenizer = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as err:
        logger.warning(f"Could not load the target tokenizer from {target} ({err}); assuming it is the source's.")
        return
    if source_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise SystemExit(
            f"hf-kvmap fit: the target tokenizer ({target}, {len(target_tokenizer.get_vocab())} tokens) differs from "
            f"the source tokenizer ({len(source_tokenizer.get_vocab())} tokens): a KV-cache mapper needs one shared "
            "tokenizer (models of one family)."
        )


def _check_out(out: str, source_id: str | None, target_id: str | None, overwrite: bool) -> None:
    """Refuse (before any model runs) an --out folder that is not empty and not a mapper of the same pair."""
    from ..artifacts import foreign_files
    from ..atomic import unwritable
    from ..configuration_mapper import MapperConfig

    folder = Path(out)
    problem = unwritable(folder)
    if problem:
        raise SystemExit(f"hf-kvmap fit: --out {problem}")
    if overwrite or not folder.exists() or (folder.is_dir() and not any(folder.iterdir())):
        return
    config = folder / "config.json"
    try:
        recorded = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SystemExit(
            f"hf-kvmap fit: --out {folder} holds a config.json that is not valid JSON ({err}): it is no readable "
            "mapper. Choose another folder, or pass --overwrite to replace it."
        ) from None
    if not isinstance(recorded, dict):
        recorded = {}
    pair = (recorded.get("source_model_id"), recorded.get("target_model_id"))
    is_mapper = recorded.get("model_type") == MapperConfig.model_type
    if is_mapper and pair == (source_id, target_id) and not foreign_files(folder):
        return
    found = f"it holds a mapper of {pair[0]} -> {pair[1]}" if is_mapper else "it holds no mapper"
    if is_mapper and foreign_files(folder):
        found += " and other files"
    raise SystemExit(
        f"hf-kvmap fit: --out {folder} is not empty and not a mapper of {source_id} -> {target_id} ({found}). "
        "Choose another folder, or pass --overwrite to replace it."
    )


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..artifacts import tokenizer_fingerprint
    from ..fitting import collect_statistics, fit, mapper_from_fitted
    from ..plotting import plot_selection, plot_training_curves
    from ..statistics import CalibrationStatistics
    from .models import check_model_folder

    try:
        fields = {
            flag[2:].replace("-", "_"): None for flag, _, _ in _MAPPER_FLAGS + _MLP_FLAGS + _KL_FLAGS + _ATTN_FLAGS
        }
        fields = {name: getattr(args, name) for name in fields}
        fields["top_k"] = None if str(args.top_k).lower() == "all" else int(args.top_k)
        layer_inputs: dict = {}
        for spec in args.layer_window:
            layer, part, entry = parse_layer_window(spec)
            layer_inputs.setdefault(layer, {})[part] = entry
        options = FitOptions(
            **fields,
            layer_inputs=layer_inputs or None,
            key_norm=args.key_norm,
            objective=args.objective,
            attn_normalize=args.attn_normalize,
            stride=args.stride,
            statistics_dtype=getattr(torch, args.dtype),
            max_memory_bytes=int(args.max_feature_memory * 2**30),
            dtype=getattr(torch, args.mapper_dtype),
        )
    except ValueError as err:  # a bad value, or a --top-k that is neither an integer nor 'all'
        raise SystemExit(f"hf-kvmap fit: {err}") from None
    needs_models = options.fits_on_features or options.key_norm or bool(options.objective_stages)
    if needs_models and args.from_stats:
        raise SystemExit(
            "hf-kvmap fit: --from-stats solves a plain ridge from saved statistics, but an MLP mapper, a "
            "--context-window, --layer-window, --input-kinds both, --key-norm or --objective other than mse needs both "
            "models (features streamed through them, the target's key norm, or a fine-tune with the target); drop "
            "--from-stats and pass --source, --target and --data."
        )
    source = target = batches = tokenizer = None
    if args.from_stats:
        from ..statistics import METADATA_FILE

        if not (args.from_stats / METADATA_FILE).is_file():
            raise SystemExit(
                f"hf-kvmap fit: --from-stats {args.from_stats} holds no {METADATA_FILE}: not a folder of statistics "
                "saved with --stats."
            )
        try:
            stats = CalibrationStatistics.load(args.from_stats, device=args.statistics_device or "cpu")
        except (OSError, ValueError, KeyError) as err:
            raise SystemExit(f"hf-kvmap fit: --from-stats {args.from_stats}: {err}") from None
        sequences = int(stats.sequences)
        _check_out(args.out, stats.source_model_id, stats.target_model_id, args.overwrite)
    else:
        _check_out(args.out, args.source, args.target, args.overwrite)
        for flag, name in (("--source", args.source), ("--target", args.target)):
            if name:
                check_model_folder(name, flag, "fit", tokenizer=flag == "--source")
        if args.data:
            check_data(args.data)
        missing = [flag for flag in ("source", "target", "data") if not getattr(args, flag)]
        if missing:
            raise SystemExit(
                f"hf-kvmap fit: pass {', '.join('--' + flag for flag in missing)} (or --from-stats DIR to solve from "
                "saved statistics)."
            )
        tokenizer = _loaded("--source", args.source, "tokenizer", AutoTokenizer.from_pretrained)
        _check_tokenizers(tokenizer, args.target)
        sequences = calibration_sequences(tokenizer, args.data, args.seq_len, args.max_sequences)
        batches = list(torch.tensor(sequences, dtype=torch.long).split(max(1, args.batch_size)))
        sequences = len(sequences)

        load_kwargs = {"dtype": "auto" if args.model_dtype == "auto" else getattr(torch, args.model_dtype)}
        if args.device_map:
            load_kwargs["device_map"] = args.device_map
        source = _loaded("--source", args.source, "model", AutoModelForCausalLM.from_pretrained, **load_kwargs).eval()
        target = _loaded("--target", args.target, "model", AutoModelForCausalLM.from_pretrained, **load_kwargs).eval()
        stats = collect_statistics(
            source,
            target,
            batches,
            options,
            device=args.statistics_device,
            progress=not args.no_progress,
            fingerprint=tokenizer_fingerprint(tokenizer),
        )
        if args.stats:
            stats.save(args.stats)
        if not needs_models:  # the ridge is solved from the statistics alone: free the models first
            source = target = batches = None
    fitted = fit(
        source,
        target,
        batches,
        options=options,
        statistics=stats,
        tokenizer=tokenizer,
        device=args.statistics_device,
        progress=not args.no_progress,
    )
    mapper = mapper_from_fitted(
        fitted, source_model=source, target_model=target, calibration=batches, progress=not args.no_progress
    )
    mapper.save_pretrained(args.out, overwrite=args.overwrite)
    fitted.selection.save_selection_json(os.path.join(args.out, "selection.json"))
    plot_selection(fitted.selection, os.path.join(args.out, "selection.png"))
    if options.kind == "mlp":
        plot_training_curves(mapper.config, os.path.join(args.out, "training_curves.png"))
    print(
        f"hf-kvmap fit: {stats.count()} positions from {sequences} sequences; kind={options.kind}; "
        f"top_k={options.top_k}; context_window={options.context_window}; input_kinds={options.input_kinds}; "
        f"layer_inputs={options.layer_inputs}; key_norm={options.key_norm}; objective={options.objective}; "
        f"mapper written to {args.out}"
    )
    return 0
