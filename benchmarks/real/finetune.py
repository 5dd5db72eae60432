"""`scale finetune` (attention or KL fine-tune of one fitted mapper) and `scale features` (the variants fitted on
features)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .common import save_atomically, stats_dir, write_json
from .scale import Scorer, direction_models, fitted_mapper, mapper_folder, snapshots

FINETUNE_OBJECTIVES = {"attention": "attn", "kl": "kl"}


def finetune_metric(result: dict) -> tuple[str, float, float]:
    """The held-out metric of a fine-tune's record, with its initial and best values."""
    if "initial_val_kl" in result:
        return "KL", result["initial_val_kl"], result["best_val_kl"]
    return "attention error", result["initial_val_error"], result["best_val_error"]


def readback_rows(tokenizer, documents, count: int, seed: int, chat_passage: int = 26) -> list[list[int]]:
    """`count` fine-tune rows in the form of the read-back tasks, built from the calibration split (the tasks read
    the held-out one): alternately a retrieval prompt and a chat-recall prompt (its four passages of `chat_passage`
    tokens, so that both kinds come out about as long), each with its answer and the chat's end of turn,
    left-cropped to the shortest so that the rows share one length. The crop may eat the start of the system prompt,
    never the fact read back: a row whose kept part no longer states its answer raises."""
    from lab.real.tasks import chat_recall, prose_retrieval

    half = (count + 1) // 2
    retrieval = prose_retrieval(tokenizer, documents, half, seed=seed, split="calibration")
    chat = chat_recall(tokenizer, documents, half, tokens=chat_passage, seed=seed, split="calibration")
    items = [item for pair in zip(retrieval, chat) for item in pair][:count]
    prompts = [tokenizer(i.prompt, add_special_tokens=False)["input_ids"] for i in items]
    answers = [tokenizer(i.answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for i in items]
    length = min(len(p) + len(a) for p, a in zip(prompts, answers))
    rows = []
    for item, prompt, answer in zip(items, prompts, answers):
        kept = prompt[len(prompt) + len(answer) - length :]
        if item.answer not in tokenizer.decode(kept):
            raise ValueError(
                f"Cropping the read-back rows to {length} tokens cut the fact out of a prompt of {len(prompt)} "
                "tokens; make the two kinds of prompt closer in length (chat_passage)."
            )
        rows.append(kept + answer)
    return rows


def cmd_finetune(args) -> int:
    """What the objectives bring on real weights: a mapper fitted at `--positions` (`--variant`: a ridge, or a
    fine-tuned one to fine-tune further), fine-tuned on calibration sequences of another seed (or, with `--data
    readback`, on `readback_rows`) by the per-layer attention objective (`hf_kvmap.objectives.attention`, variant
    `<variant>-attn`) or the end-to-end KL through the target (`hf_kvmap.objectives.kl_finetune`, `<variant>-kl`),
    then scored on the same items as every fit of the curve."""
    from hf_kvmap import MapperModel
    from hf_kvmap.objectives import attention_finetune, kl_finetune
    from hf_kvmap.real import corpus

    torch.set_num_threads(args.threads)
    scorer = Scorer(args)
    work = Path(args.work)
    source, target, positions = fitted_mapper(work, args.direction, args.variant, args.positions)
    name = args.name or f"{args.variant}-{FINETUNE_OBJECTIVES[args.objective]}" + (
        "-readback" if args.data == "readback" else ""
    )
    out = mapper_folder(work, positions, args.direction, name)
    if (out / "config.json").is_file():
        mapper = MapperModel.from_pretrained(out, dtype=torch.float32)
    else:
        mapper = MapperModel.from_pretrained(mapper_folder(work, positions, args.direction, args.variant))
        mapper = mapper.to(torch.float32)
        documents = corpus.load_manifest(args.manifest)
        if args.data == "readback":
            rows = readback_rows(scorer.tokenizer, documents, args.sequences, args.calibration_seed)
        else:
            rows = corpus.calibration_sequences(
                scorer.tokenizer, documents, args.sequences, args.seq_len, seed=args.calibration_seed
            )
        finetune = attention_finetune if args.objective == "attention" else kl_finetune
        extra = {"min_prefix": args.min_prefix} if args.objective == "kl" else {}
        result = finetune(
            mapper,
            scorer.models[source],
            scorer.models[target],
            [torch.tensor(rows)],
            steps=args.steps,
            lr=args.lr,
            batch_size=args.batch_size,
            eval_every=args.eval_every,
            patience=args.patience,
            val_sequences=args.val_sequences,
            cache_references=True,
            **extra,
        )
        save_atomically(mapper, out)
        record = result.to_dict()
        write_json(
            out / "finetune.json",
            {
                "objective": args.objective,
                "data": args.data,
                "start": args.variant,
                "calibration_seed": args.calibration_seed,
                **record,
            },
        )
        metric, initial, best = finetune_metric(record)
        print(
            f"{args.objective} fine-tune: held-out {metric} {initial:.4f} -> {best:.4f} "
            f"(step {result.best_step} of {result.steps_run}, {result.seconds:.0f} s)",
            flush=True,
        )
    scorer.score_mapper(positions, source, target, name, mapper)
    return 0


# the mappers that need features (a context window, keys and values read together, the MLP): name -> FitOptions
# fields; "ridge-k8-feat" is the plain per-position ridge on the same features, the control for their scale
FEATURE_VARIANTS = {
    "ridge-k8-feat": {},
    "ridge-k8-w1": {"context_window": 1},
    "ridge-k8-w3": {"context_window": 3},
    "ridge-k8-both": {"input_kinds": "both"},
    "ridge-k8-w1-both": {"context_window": 1, "input_kinds": "both"},
    "mlp-k8": {"kind": "mlp"},
    "mlp-k8-h256": {
        "kind": "mlp",
        "hidden_size": 256,
        "epochs": 10,
    },  # a quarter of the paper's width, half its epochs
}


def cmd_features(args) -> int:
    """Mappers that need calibration features on real weights (`FEATURE_VARIANTS`): one pass of both models over
    `--sequences` calibration sequences keeps the content-space features in memory (`hf_kvmap.gather_features`),
    every variant is fitted on them with the k = 8 layer selection of the statistics at `--selection-positions`,
    and scored like every fit of the curve, under the number of feature positions it was fitted on."""
    from hf_kvmap import CalibrationStatistics, FitOptions, LayerSelection, MapperModel
    from hf_kvmap.features import gather_features
    from hf_kvmap.fitting import fit
    from hf_kvmap.real import corpus

    torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in FEATURE_VARIANTS]
    if unknown:
        raise SystemExit(f"Unknown feature variants {unknown}; choose from {sorted(FEATURE_VARIANTS)}.")
    scorer = Scorer(args)
    source, target = direction_models(args.direction)
    folder = dict(snapshots(Path(args.calibration))).get(args.selection_positions)
    if folder is None:
        raise SystemExit(f"No snapshot of {args.selection_positions} positions under {args.calibration}.")
    stats = CalibrationStatistics.load(stats_dir(folder, source, target))
    selection = LayerSelection.from_statistics(stats).with_top_k(8)
    options = {
        v: FitOptions(ridge_lambda=args.ridge_lambda, stride=args.stride, **FEATURE_VARIANTS[v]) for v in variants
    }
    documents = corpus.load_manifest(args.manifest)
    rows = corpus.calibration_sequences(
        scorer.tokenizer, documents, args.sequences, args.seq_len, seed=args.calibration_seed
    )
    batches = [torch.tensor(rows[i : i + args.batch]) for i in range(0, len(rows), args.batch)]
    window = max(o.context_window for o in options.values())  # the variants set no per-layer windows
    start = time.perf_counter()
    features = gather_features(
        scorer.models[source],
        scorer.models[target],
        batches,
        source_layers=sorted({layer for layers in selection.source_layers for layer in layers}),
        stride=args.stride,
        context_window=window,
        max_memory_bytes=None,
    )
    feature_seconds = time.perf_counter() - start
    positions = features.num_positions
    print(f"features: {positions} positions, window {window}, {feature_seconds:.0f} s", flush=True)
    for variant in variants:
        out = mapper_folder(scorer.work, positions, args.direction, variant)
        if (out / "config.json").is_file():
            mapper = MapperModel.from_pretrained(out, dtype=torch.float32)
            record = json.loads((out / "features.json").read_text())
        else:
            start = time.perf_counter()
            fitted = fit(
                scorer.models[source],
                scorer.models[target],
                batches,
                options=options[variant],
                statistics=stats,
                selection=selection,
                features=features,
                tokenizer=scorer.tokenizer,
            )
            mapper = MapperModel.from_fitted(fitted)
            fit_seconds = time.perf_counter() - start
            save_atomically(mapper, out)
            record = {
                "fit_seconds": fit_seconds,
                "feature_seconds": feature_seconds,
                "sequences": args.sequences,
                "seq_len": args.seq_len,
                "stride": args.stride,
                "calibration_seed": args.calibration_seed,
                "selection_positions": args.selection_positions,
            }
            write_json(out / "features.json", record)
            print(f"{variant}: fitted in {fit_seconds:.0f} s", flush=True)
        scorer.score_mapper(positions, source, target, variant, mapper, **record)
    return 0
