"""Retention on the real pair against calibration scale.

The paper's ridge (k = 8 and k = all) is fitted on growing prefixes of one calibration stream (the snapshots that
`real_family.py calibrate --snapshots 2,4,8,...` keeps) and every fit is scored on the same items, three ways
(source alone, target alone, handoff), with the prefills of each model computed once and kept on disk. It answers
"does the paper's method hold on this pair if it gets more calibration text", and how far the answer moves with
the number of calibration positions (the paper's scale: 500 x 1,024 tokens at stride 4 = 128K positions).

    python benchmarks/real_scale.py --cache-dir C run --calibration W/calib --work S [--items 16]
    python benchmarks/real_scale.py report --work S      # benchmarks/results/real_family_scale.{json,png}

`run` is resumable (every score is written as soon as it is known) and picks up snapshots that appeared since the
last run; the running calibration's current checkpoint is scored too, under its position count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import real_family as rf  # noqa: E402

RESULTS = HERE / "results" / "real_family_scale.json"
GUARD_RESULTS = HERE / "results" / "real_family_guard.json"
#: the generation tasks the guard is measured on (a probe predicts a changed greedy answer)
GUARD_TASKS = ("prose_retrieval", "chat_recall")
PLOT = HERE / "results" / "real_family_scale.png"
TASKS = "prose_retrieval,chat_recall,code_recall,code_nll"
#: the paper's calibration: 500 sequences x 1,024 tokens at stride 4 (its "~128K tokens"); cards are written from here
PAPER_POSITIONS = 128_000


def snapshots(calibration: Path) -> list[tuple[int, Path]]:
    """`(positions, folder)` of every complete snapshot and of the current checkpoint, smallest first."""
    found = {}
    for folder in [*sorted(calibration.glob("snapshot-*")), rf.checkpoint_dir(calibration)]:
        if folder is None or folder.name.endswith(".tmp") or not (folder / "progress.json").is_file():
            continue
        progress = json.loads((folder / "progress.json").read_text())
        found.setdefault(int(progress["positions"]), folder)
    return sorted(found.items())


def fit(stats, variant: str, ridge_lambda: float):
    from hf_kvmap import LayerSelection, mapper_from_statistics

    selection = LayerSelection.from_statistics(stats)
    top_k = rf.VARIANTS[variant]
    if top_k is None:
        return rf.ridge_all_mapper(stats, selection, ridge_lambda)
    return mapper_from_statistics(stats, ridge_lambda=ridge_lambda, selection=selection.with_top_k(top_k))


def mapper_folder(work: Path, positions: int, direction: str, variant: str) -> Path:
    return work / "mappers" / str(positions) / direction / variant


def perplexity_contexts(tokenizer, tasks) -> list[torch.Tensor]:
    """The first half of every perplexity item (the context the evaluation prefills): held-out text for R^2."""
    contexts = []
    for task in tasks:
        if task.task_type == "perplexity":
            for item in task.items:
                ids = torch.tensor([tokenizer(item.text)["input_ids"]])
                contexts.append(ids[:, : max(2, int(ids.shape[1] * 0.5))])
    return contexts


class Scorer:
    """The items, the prefill store and the scores file of one scale study, over models loaded once."""

    def __init__(self, args, models: dict | None = None):
        from hf_kvmap.real import corpus
        from hf_kvmap.real.tasks import real_family_tasks

        self.args = args
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.tokenizer = rf.load_tokenizer(rf.SMALL, args.cache_dir)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        documents = corpus.load_manifest(args.manifest)
        self.tasks = real_family_tasks(
            self.tokenizer, documents, items=args.items, seed=args.seed, names=args.tasks.split(",")
        )
        self.models = models or {
            name: rf.load_model(name, args.cache_dir, args.dtype) for name in (rf.SMALL, rf.LARGE)
        }
        self.names = {id(model): rf.SHORT[name] for name, model in self.models.items()}
        self.store = rf.PrefillStore(self.work / "prefills")
        self.handoff_class = rf.cached_handoff_class()
        self.path = self.work / f"scores-items{args.items}-seed{args.seed}-{args.dtype}.json"
        self.scores = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.contexts = perplexity_contexts(self.tokenizer, self.tasks)
        self.directions = [d for d in rf.DIRECTIONS if rf.direction_name(*d) in args.directions.split(",")]

    def handoff(self, source: str, target: str, mapper, target_first_layer: bool = False):
        m = self.models
        return self.handoff_class(
            m[source], m[target], mapper, self.tokenizer, target_first_layer=target_first_layer, store=self.store,
            names=self.names,
        )  # fmt: skip

    def record(self, key: str, task, handoff, mode: str, **extra) -> None:
        from hf_kvmap.evaluation import evaluate_items

        if key in self.scores:
            return
        start = time.perf_counter()
        kwargs = {"stop": task.stop} if task.task_type == "exact_match" else {}
        value = evaluate_items(handoff, task.task_type, task.items, mode, **kwargs)
        seconds = time.perf_counter() - start
        self.scores[key] = {"score": value, "n_items": len(task.items), "seconds": seconds, **extra}
        rf.write_json(self.path, self.scores)
        print(f"{key}: {value:.4f} ({seconds:.0f} s)", flush=True)

    def alone(self) -> None:
        handoff = self.handoff(rf.SMALL, rf.LARGE, None)
        for task in self.tasks:
            self.record(f"{task.name}|alone|{rf.SHORT[rf.SMALL]}", task, handoff, "source")
            self.record(f"{task.name}|alone|{rf.SHORT[rf.LARGE]}", task, handoff, "target")

    def score(self, positions: int, folder: Path) -> None:
        """Fit every variant of every direction on the snapshot `folder` and score it (skipping what is scored)."""
        from hf_kvmap import CalibrationStatistics

        for source, target in self.directions:
            direction = rf.direction_name(source, target)
            todo = [
                v
                for v in self.args.variants.split(",")
                if any(f"{t.name}|{positions}|{direction}|{v}" not in self.scores for t in self.tasks)
            ]
            if not todo:
                continue
            self.record_calibration(positions, folder)
            stats = CalibrationStatistics.load(rf._stats_dir(folder, source, target))
            for variant in todo:
                start = time.perf_counter()
                mapper = fit(stats, variant, self.args.ridge_lambda)
                fit_seconds = time.perf_counter() - start
                rf.save_atomically(mapper, mapper_folder(self.work, positions, direction, variant))
                extra = {"fit_seconds": fit_seconds, "ridge_lambda": self.args.ridge_lambda}
                self.score_mapper(positions, source, target, variant, mapper, **extra)
            del stats

    def record_calibration(self, positions: int, folder: Path) -> None:
        """What the statistics of a snapshot cost: the seconds of its chunks (both models' forwards and the sums)."""
        key = f"calibration|{positions}"
        if key not in self.scores:
            done = json.loads((folder / "progress.json").read_text())["done"]
            self.scores[key] = {"seconds": sum(c["seconds"] for c in done.values()), "chunks": len(done)}
            rf.write_json(self.path, self.scores)

    def score_mapper(
        self, positions: int, source: str, target: str, variant: str, mapper, target_first_layer: bool = False, **extra
    ) -> None:
        """Held-out R^2 and every task of one fitted mapper, keyed by its calibration size (skipping what is scored);
        with `target_first_layer` the handoff has the target compute its first layer (no R^2: the same map)."""
        direction = rf.direction_name(source, target)
        mapper = mapper.to(self.models[target].dtype)
        key = f"r2|{positions}|{direction}|{variant}"
        if key not in self.scores and self.contexts and not target_first_layer:
            m = self.models
            self.scores[key] = rf.held_out_r2(mapper, m[source], m[target], source, target, self.store, self.contexts)
            rf.write_json(self.path, self.scores)
        handoff = self.handoff(source, target, mapper, target_first_layer)
        for task in self.tasks:
            self.record(f"{task.name}|{positions}|{direction}|{variant}", task, handoff, "mapped", **extra)


def direction_models(direction: str) -> tuple[str, str]:
    """`(source, target)` model names of a direction such as `0.5b-to-1.5b`."""
    short = {v: k for k, v in rf.SHORT.items()}
    source, target = (short[n] for n in direction.split("-to-"))
    return source, target


def fitted_mapper(work: Path, direction: str, variant: str, positions: int | None) -> tuple[str, str, int]:
    """`(source, target, positions)` of a mapper `run`/`follow` fitted: at `positions`, or the largest size fitted."""
    source, target = direction_models(direction)
    fitted = sorted(int(p.name) for p in (work / "mappers").iterdir() if (p / direction / variant).is_dir())
    if not fitted:
        raise SystemExit(f"No {direction}/{variant} fitted under {work / 'mappers'}; run `follow` or `run` first.")
    return source, target, positions or fitted[-1]


def cmd_run(args) -> int:
    torch.set_num_threads(args.threads)
    scorer = Scorer(args)
    scorer.alone()
    for positions, folder in snapshots(Path(args.calibration)):
        if args.sizes is None or positions in args.sizes:
            scorer.score(positions, folder)
    print(f"prefills computed {scorer.store.computed}, loaded {scorer.store.loaded}; scores in {scorer.path}")
    return 0


def cmd_follow(args) -> int:
    """Calibrate (as `real_family.py calibrate`, resumable) and score each snapshot as it is kept, in one process
    holding one copy of the two models (two processes holding two copies do not fit in 24 GiB)."""
    torch.set_num_threads(args.threads)
    scorer = Scorer(args)
    scorer.alone()
    for positions, folder in snapshots(Path(args.out)):
        if folder.name.startswith("snapshot-"):
            scorer.score(positions, folder)

    def after_checkpoint(progress, snapshot):
        if snapshot is not None:
            scorer.score(int(progress["positions"]), snapshot)

    calibration = argparse.Namespace(**{**vars(args), "seed": args.calibration_seed})  # --seed is the items' seed
    return rf.cmd_calibrate(calibration, models=scorer.models, after_checkpoint=after_checkpoint)


#: `finetune --objective`: the fine-tune and the suffix of the fine-tuned variant's name
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
    from hf_kvmap.real.tasks import chat_recall, prose_retrieval

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
        rf.save_atomically(mapper, out)
        record = result.to_dict()
        rf.write_json(
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
    stats = CalibrationStatistics.load(rf._stats_dir(folder, source, target))
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
            rf.save_atomically(mapper, out)
            record = {
                "fit_seconds": fit_seconds,
                "feature_seconds": feature_seconds,
                "sequences": args.sequences,
                "seq_len": args.seq_len,
                "stride": args.stride,
                "calibration_seed": args.calibration_seed,
                "selection_positions": args.selection_positions,
            }
            rf.write_json(out / "features.json", record)
            print(f"{variant}: fitted in {fit_seconds:.0f} s", flush=True)
        scorer.score_mapper(positions, source, target, variant, mapper, **record)
    return 0


def int_list(text: str) -> list[int]:
    """`"1,2,4"` -> `[1, 2, 4]`; an empty string is an empty list."""
    return [int(n) for n in text.split(",") if n]


def cmd_swap(args) -> int:
    """`hf_kvmap.diagnostics.layer_swap` on real weights: the target reads its own cache except one mapped layer
    (then only the mapped keys, only the mapped values of every layer), for the mapper fitted at `--positions`
    (default: the largest scored); prefills from the store, so each swap costs only the target's reading."""
    from hf_kvmap import MapperModel
    from hf_kvmap.diagnostics import layer_swap

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    source, target, positions = fitted_mapper(work, args.direction, args.variant, args.positions)
    scorer = Scorer(args)
    folder = mapper_folder(work, positions, args.direction, args.variant)
    mapper = MapperModel.from_pretrained(folder, dtype=scorer.models[target].dtype)
    handoff = scorer.handoff(source, target, mapper)
    path = work / f"swap-items{args.items}-seed{args.seed}-{args.dtype}.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    layers = None if args.layers == "all" else int_list(args.layers)
    own_layers, own_first, own_tokens = (int_list(text) for text in (args.own_layers, args.own_first, args.own_tokens))
    suffix = "" if layers is None and not own_layers else f"|swap-{args.layers}|own-{args.own_layers or 'none'}"
    suffix += f"|own-first-{args.own_first}" if own_first else ""
    suffix += f"|own-tokens-{args.own_tokens}" if own_tokens else ""
    for task in scorer.tasks:
        key = f"{task.name}|{positions}|{args.direction}|{args.variant}{suffix}"
        if key in results:
            continue
        start = time.perf_counter()
        row = layer_swap(
            handoff, task, layers=layers, own_layers=own_layers, own_first=own_first, own_tokens=own_tokens
        )
        results[key] = {**row, "seconds": time.perf_counter() - start, "n_items": args.items}
        rf.write_json(path, results)
        worst = sorted(row["layers"].items(), key=lambda kv: kv[1], reverse=task.task_type == "perplexity")[:4]
        print(
            f"{key}: target {row['target']:.3f}, mapped {row['mapped']:.3f}, keys only {row['keys_only']:.3f}, "
            f"values only {row['values_only']:.3f}; worst single layers {worst}; all but {row.get('all_but')}; "
            f"own first {row.get('own_first')}; own tokens {row.get('own_tokens')}",
            flush=True,
        )
    return 0


FIRST_LAYER = "+target-L0"


def cmd_first_layer(args) -> int:
    """The fitted mappers scored again with the target computing its own first layer from the token ids
    (`MappedCache.from_source(..., target_model=, input_ids=)`), as variant `<variant>+target-L0`: what the map
    keeps once layer 0, which `swap` shows breaks retrieval alone, is exact."""
    return score_fits(args, plain=args.also_plain, first_layer=True)


def cmd_score(args) -> int:
    """Fitted mappers (and both models alone) scored on the items of `--items` / `--seed`, e.g. a second item set to
    report the variants on that they were not compared on (`report --held-out ITEMS:SEED` tabulates it)."""
    return score_fits(args, plain=True, first_layer=False)


def each_fit(args):
    """`(spec, source, target, positions, variant, mapper)` of each `--fits` entry (`positions:variant`), loaded from
    `--work` (a fit that is not there stops with `fitted_mapper`'s message)."""
    from hf_kvmap import MapperModel

    work = Path(args.work)
    for spec in args.fits.split(","):
        positions, variant = spec.split(":")
        source, target, positions = fitted_mapper(work, args.direction, variant, int(positions))
        mapper = MapperModel.from_pretrained(mapper_folder(work, positions, args.direction, variant))
        yield spec, source, target, positions, variant, mapper


def score_fits(args, plain: bool, first_layer: bool) -> int:
    """Score each `--fits` mapper as it maps alone (`plain`) and with the target's own first layer (skipping what
    is scored), after both models alone."""
    torch.set_num_threads(args.threads)
    scorer = Scorer(args)
    scorer.alone()
    for _, source, target, positions, variant, mapper in each_fit(args):
        if plain:
            scorer.score_mapper(positions, source, target, variant, mapper)
        if first_layer:
            scorer.score_mapper(positions, source, target, variant + FIRST_LAYER, mapper, target_first_layer=True)
    return 0


KEYS_RESULTS = HERE / "results" / "real_family_keys.json"


def key_geometry(mapped: list[torch.Tensor], true: list[torch.Tensor]) -> dict:
    """How one layer's mapped keys (content space, `(batch, heads, T, dim)` per sequence) sit against the target's:
    `norm_ratio` (mean mapped key norm over mean target key norm), `cosine` (mean over tokens and heads) and `r2`
    (centered per dimension, pooled: a layer whose keys share a large mean has a small variance to explain, so a
    small error there is a large negative R^2 while the cosine stays near 1)."""
    norms = [(m.double().norm(dim=-1).mean(), t.double().norm(dim=-1).mean()) for m, t in zip(mapped, true)]
    cosines = [
        torch.nn.functional.cosine_similarity(m.double(), t.double(), dim=-1).mean() for m, t in zip(mapped, true)
    ]
    return {
        "norm_ratio": float(sum(m for m, _ in norms) / sum(t for _, t in norms)),
        "cosine": float(sum(cosines) / len(cosines)),
        "r2": rf._layer_r2(mapped, true),
    }


class _LazyModel:
    """A model loaded only when the prefill store misses (`PrefillStore.cache` reads `dtype`, calls `get_decoder`);
    its `config` is read from the model folder without loading the weights."""

    def __init__(self, name: str, cache_dir, dtype: str):
        from transformers import AutoConfig

        self.name, self.cache_dir, self.dtype_name, self.model = name, cache_dir, dtype, None
        self.dtype = rf.DTYPES[dtype]
        self.config = AutoConfig.from_pretrained(rf.model_folder(name, cache_dir))

    def get_decoder(self):
        if self.model is None:
            self.model = rf.load_model(self.name, self.cache_dir, self.dtype_name)
        return self.model.get_decoder()


def cmd_keys(args) -> int:
    """Per target layer, how the mapped keys of each `--fits` mapper sit against the target's own on the
    perplexity tasks' held-out contexts (`key_geometry`), from the prefill store (a model loads only on a miss)."""
    from hf_kvmap.real import corpus
    from hf_kvmap.real.tasks import real_family_tasks

    torch.set_num_threads(args.threads)
    source, target = direction_models(args.direction)
    tokenizer = rf.load_tokenizer(rf.SMALL, args.cache_dir)
    tasks = real_family_tasks(
        tokenizer, corpus.load_manifest(args.manifest), items=args.items, seed=args.seed, names=args.tasks.split(",")
    )
    contexts = perplexity_contexts(tokenizer, tasks)
    store = rf.PrefillStore(Path(args.work) / "prefills")
    models = {name: _LazyModel(name, args.cache_dir, args.dtype) for name in (source, target)}
    fits = {}
    for spec, *_, mapper in each_fit(args):
        mapped, true = rf.mapped_and_true_parts(
            mapper.to(models[target].dtype), models[source], models[target], source, target, store, contexts
        )
        layers = [key_geometry(m, t) for m, t in zip(mapped["key"], true["key"])]
        fits[spec] = {name: [layer[name] for layer in layers] for name in ("norm_ratio", "cosine", "r2")}
        print(spec, "norm ratio by layer:", " ".join(f"{r:.2f}" for r in fits[spec]["norm_ratio"]), flush=True)
    result = {
        "run": {"direction": args.direction, "tasks": args.tasks, "items_per_task": args.items, "seed": args.seed},
        "positions": sum(int(ids.shape[1] - 1) for ids in contexts),
        "fits": fits,
    }
    rf.write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


def cmd_guard(args) -> int:
    """The guarded handoff on real weights: `benchmarks/handoff.py`'s candidate probes on one fitted mapper, their
    thresholds chosen on the `--seed` items (calibration set) and their rates reported on the `--report-seed` items;
    resumable per set and task. Writes `results/real_family_guard.json`."""
    import handoff as bench

    from hf_kvmap import MapperModel
    from hf_kvmap.real import corpus
    from hf_kvmap.real.tasks import real_family_tasks
    from hf_kvmap.reporting import environment_info, update_file_section

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    source, target, positions = fitted_mapper(work, args.direction, args.variant, args.positions)
    sets = {"calibration": args.seed, "report": args.report_seed}
    folder = work / "guard" / f"{positions}-{args.variant}-items{args.items}"
    path = folder / f"{args.direction}.json"
    data = json.loads(path.read_text()) if path.is_file() else {"items": args.items, "sets": sets, "rows": {}}
    if data["sets"] != sets:
        raise SystemExit(f"{path} holds the item sets {data['sets']}, not {sets}; pass those seeds or another --work.")
    tokenizer = rf.load_tokenizer(rf.SMALL, args.cache_dir)
    documents = corpus.load_manifest(args.manifest)
    models, mapper = None, None
    for set_name, seed in sets.items():
        for task in real_family_tasks(tokenizer, documents, items=args.items, seed=seed, names=list(GUARD_TASKS)):
            if f"{set_name}/{task.name}" in data["rows"]:
                continue
            if models is None:
                models = {name: rf.load_model(name, args.cache_dir, args.dtype) for name in (source, target)}
                mapper = MapperModel.from_pretrained(mapper_folder(work, positions, args.direction, args.variant))
                mapper = mapper.to(models[target].dtype).eval()
            start = time.perf_counter()
            pairs = [(item.prompt, item.answer + task.stop) for item in task.items]
            rows = bench.item_rows(models[source], models[target], mapper, tokenizer, task.name, pairs)
            data["rows"][f"{set_name}/{task.name}"] = rows
            rf.write_json(path, data)
            print(f"{set_name}/{task.name}: {len(rows)} items ({time.perf_counter() - start:.0f} s)", flush=True)
    settings = argparse.Namespace(work=folder, max_false_alarm=args.max_false_alarm)
    pair = (rf.SHORT[source], rf.SHORT[target])
    try:
        result = bench.analyse(settings, None, directions=[pair], tasks=GUARD_TASKS)
    except ValueError as error:  # e.g. no calibration item kept its answer: no false-alarm rate to choose by
        raise SystemExit(f"{path}: {error}") from error
    result["run"] = {
        "mapper": f"{positions}/{args.direction}/{args.variant}",
        "items_per_task_and_set": args.items,
        "sets": sets,
        "tasks": list(GUARD_TASKS),
        "candidates": list(bench.CANDIDATES),
        "max_false_alarm": args.max_false_alarm,
        "dtype": args.dtype,
        "label": "changed = the greedy answer on the mapped cache differs from the target's own",
    }
    result["environment"] = environment_info()
    rf.write_json(GUARD_RESULTS, result)
    # from the file, as the drift test reads it (non-finite values are null there)
    update_file_section(HERE.parent / "README.md", "real-guard", guard_markdown(json.loads(GUARD_RESULTS.read_text())))
    direction = result["directions"][args.direction]
    print(f"chosen {direction['chosen']}; guarded report set: {json.dumps(direction['guarded_report'])}")
    print(f"wrote {GUARD_RESULTS}")
    return 0


def _share(rate: float | None, count: int) -> str:
    """`3/4` from a rate over `count` items; `-` where there were none."""
    return "-" if rate is None or not count else f"{round(rate * count)}/{count}"


def guard_markdown(result: dict) -> str:
    """The README section of the guard on real weights, from `results/real_family_guard.json`."""
    run = result["run"]
    (direction, data), *_ = result["directions"].items()
    tasks = run["tasks"]
    lines = [
        f"Written by `python benchmarks/real_scale.py --items {run['items_per_task_and_set']} --seed "
        f"{run['sets']['calibration']} guard --work $WORK/scale --positions {run['mapper'].split('/')[0]} --variant "
        f"{run['mapper'].split('/')[-1]} --report-seed {run['sets']['report']}` from "
        f"`benchmarks/results/real_family_guard.json`: the mapper `{run['mapper']}` ({direction}), "
        f"{run['items_per_task_and_set']} items per task on a calibration set (seed {run['sets']['calibration']}; "
        f"each probe's threshold is chosen there, false alarms <= {run['max_false_alarm']:.0%}, both tasks pooled) "
        f"and as many on a report set (seed {run['sets']['report']}; the rates below). *Changed*: the greedy "
        "answer on the mapped cache differs from the target's own; *caught*: changed answers the probe refuses; "
        "*false alarms*: kept answers it refuses.",
        "",
        "| set / task | items | target alone right | mapped right (hold back 1) | answers changed (hold back 1) |",
        "|---|---|---|---|---|",
    ]
    for name, acc in data["accuracy"].items():
        n = acc["items"]
        lines.append(
            f"| {name} | {n} | {_share(acc['target_own'], n)} | {_share(acc['mapped']['1'], n)} | "
            f"{_share(acc['changed']['1'], n)} |"
        )
    head = " | ".join(f"caught {t}" for t in tasks) + " | " + " | ".join(f"false alarms {t}" for t in tasks)
    lines += [
        "",
        f"| probe | hold back | threshold | {head} | AUC {' / '.join(tasks)} |",
        "|---|---|---|" + "---|" * (2 * len(tasks) + 1),
    ]
    for name, probe in data["probes"].items():
        report = probe["report"]
        caught = [_share(report[t]["true_alarm"], report[t]["changed"]) for t in tasks]
        false = [_share(report[t]["false_alarm"], report[t]["kept"]) for t in tasks]
        aucs = " / ".join("-" if probe["auc"][t] is None else f"{probe['auc'][t]:.2f}" for t in tasks)
        threshold = "-" if probe["threshold"] is None else f"{probe['threshold']:.4g}"
        lines.append(f"| {name} | {probe['hold_back']} | {threshold} | {' | '.join(caught + false)} | {aucs} |")
    guarded = data["guarded_report"]
    served = "; ".join(
        f"{t}: right {guarded[t]['accuracy']:.0%}, fallback {guarded[t]['fallback_rate']:.0%}, changed answers "
        f"served {guarded[t]['changed_answers_served']:.0%}"
        for t in tasks
    )
    lines += [
        "",
        "Chosen on the calibration set (the first in the table that catches 80 % of its changed answers, else the "
        f"one that catches the most; probe costs are not measured here): `{data['chosen']}`. Guarded serving on the "
        f"report set (the mapped answer where it accepts, the target's own prefill where it refuses): {served}.",
    ]
    return "\n".join(lines)


def assemble_curve(scores: dict) -> dict:
    """Per (direction, variant): one three-way results row (retention, floor-normalized) per calibration size."""
    curves: dict = {}
    for key in scores:
        parts = key.split("|")
        if len(parts) != 4 or parts[0] in ("r2", "calibration"):
            continue
        _, positions, direction, variant = parts
        curves.setdefault(f"{direction}/{variant}", set()).add(int(positions))
    out = {}
    for name, sizes in sorted(curves.items()):
        direction, variant = name.split("/")
        source, target = direction.split("-to-")
        rows = []
        for positions in sorted(sizes):
            results = rf.assemble(scores, source, target, variant, run=str(positions))
            if results is None:
                continue
            r2 = scores.get(f"r2|{positions}|{direction}|{variant}")
            if r2 is not None:
                results["held_out_r2"] = {
                    part: sum(r2[f"{part}_r2"]) / len(r2[f"{part}_r2"]) for part in ("key", "value")
                }
            fit_seconds = [
                v["fit_seconds"]
                for k, v in scores.items()
                if k.endswith(f"|{positions}|{name.replace('/', '|')}") and "fit_seconds" in v
            ]
            if fit_seconds:
                results["fit_seconds"] = fit_seconds[0]
            if f"calibration|{positions}" in scores:
                results["calibration_seconds"] = scores[f"calibration|{positions}"]["seconds"]
            rows.append({"positions": positions, **results})
        out[name] = rows
    return out


def split_curves(curves: dict, direction: str) -> tuple[dict, list[tuple[str, dict]]]:
    """The curves fitted at three or more sizes, and `(label, row)` of every other fit of `direction` with the largest
    fit of each of those curves beside them (what the plot's two rows show)."""
    scale = {name: rows for name, rows in curves.items() if len(rows) >= 3}
    points = [
        (f"{name.split('/')[1]} @{row['positions'] // 1024}K", row)
        for name, rows in curves.items()
        if name.startswith(direction + "/")
        for row in (rows[-1:] if name in scale else rows)
    ]
    return scale, points


def plot_curve(curves: dict, path: Path, alone: dict | None = None, direction: str = "0.5b-to-1.5b") -> None:
    """Top row: the variants fitted at three or more calibration sizes, against the size. Bottom row: every other
    variant of `direction` (and the largest fit of each curve, for reference) as one dot per fit, read across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alone = alone or {}
    source, target = direction.split("-to-")
    tasks = sorted({t for rows in curves.values() for row in rows for t in row["tasks"]})
    metrics = [*tasks, "code_nll", "prose_ppl", "held_out_r2"]

    def value(row: dict, metric: str, part: str = "key"):
        if metric == "held_out_r2":
            return row.get("held_out_r2", {}).get(part)
        return (row["tasks"].get(metric) or row["perplexity"].get(metric, {})).get("mapped")

    def title(metric: str) -> str:
        if metric == "held_out_r2":
            return "held-out R^2 (K; V dashed / hollow)"
        return f"{metric} after the handoff" + (", lower is better" if metric in ("code_nll", "prose_ppl") else "")

    scale, points = split_curves(curves, direction)
    fig, axes = plt.subplots(2, len(metrics), figsize=(3.6 * len(metrics), 3.4 + 0.28 * len(points) + 1.0))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ticks = sorted({row["positions"] for rows in scale.values() for row in rows})
    for color, (name, rows) in zip(colors, scale.items()):
        x = [row["positions"] for row in rows]
        for ax, metric in zip(axes[0], metrics):
            ax.plot(x, [value(row, metric) for row in rows], marker="o", color=color, label=name)
            if metric == "held_out_r2":
                ax.plot(x, [value(row, metric, "value") for row in rows], "--", marker="o", color=color)
    for ax, metric in zip(axes[0], metrics):
        ax.set_title(title(metric), fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t // 1024}K" if t >= 1024 else str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("calibration positions")
    y = range(len(points))
    for ax, metric in zip(axes[1], metrics):
        ax.scatter([value(row, metric) for _, row in points], y, color="C0", zorder=3)
        if metric == "held_out_r2":
            ax.scatter([value(row, metric, "value") for _, row in points], y, facecolors="none", edgecolors="C0")
        ax.set_yticks(list(y), [label for label, _ in points] if metric == metrics[0] else [""] * len(points))
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(title(metric), fontsize=9)
    axes[1][0].set_ylabel(f"{direction}, every fit")
    for metric, top, bottom in zip(metrics, axes[0], axes[1]):
        for model, style in ((target, ":"), (source, "-.")):
            entry = alone.get(f"{metric}|alone|{model}")
            if entry is not None:
                top.axhline(entry["score"], color="gray", ls=style, lw=1, label=f"{model} alone")
                bottom.axvline(entry["score"], color="gray", ls=style, lw=1)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cell(row: dict, task: str) -> str:
    entry = row["tasks"].get(task) or row["perplexity"].get(task)
    if entry is None:
        return "n/a"
    if task in row["perplexity"]:
        return f"{entry['mapped']:.2f}"
    hits = round(entry["mapped"] * entry["n_items"])
    return f"{hits}/{entry['n_items']}"


def curve_table(alone: dict, curves: dict) -> list[str]:
    """One markdown row per model alone and per fit: every task, held-out R^2, fit and calibration seconds."""
    tasks = sorted({t for rows in curves.values() for row in rows for t in row["tasks"]})
    ppl = sorted({t for rows in curves.values() for row in rows for t in row["perplexity"]})
    lines = [
        "| mapper | calibration positions | "
        + " | ".join(tasks + ppl)
        + " | held-out key R^2 | held-out value R^2 | fit s | calibration s |",
        "|---|---|" + "---|" * (len(tasks) + len(ppl) + 4),
    ]
    for model in ("0.5b", "1.5b"):
        cells = []
        for task in tasks + ppl:
            entry = alone.get(f"{task}|alone|{model}")
            if entry is None:
                cells.append("n/a")
            elif task in ppl:
                cells.append(f"{entry['score']:.2f}")
            else:
                cells.append(f"{round(entry['score'] * entry['n_items'])}/{entry['n_items']}")
        lines.append(f"| {model} alone | | " + " | ".join(cells) + " | | | | |")
    for name, rows in curves.items():
        for row in rows:
            r2 = row.get("held_out_r2", {})
            r2_cells = [f"{r2[p]:.3f}" if p in r2 else "n/a" for p in ("key", "value")]
            cells = [_cell(row, t) for t in tasks + ppl]
            r2_cells += [f"{row[k]:,.0f}" if k in row else "" for k in ("fit_seconds", "calibration_seconds")]
            lines.append(f"| {name} | {row['positions']:,} | " + " | ".join(cells + r2_cells) + " |")
    return lines


def report_markdown(report: dict) -> str:
    """The README section: the curve as a table (one row per fit), the swap diagnosis, what they say."""
    run = report["run"]
    lines = [
        f"Written by `python benchmarks/real_scale.py report` from `benchmarks/results/real_family_scale.json`: the "
        f"paper's ridge fitted on growing prefixes of one calibration stream (1,024-token sequences of the pinned "
        f"corpus, stride 2, models in {run['dtype']}, ridge lambda {', '.join(f'{v:g}' for v in run['ridge_lambda'])}), every fit scored on the "
        f"same {run['items_per_task']} items per task (seed {run['seed']}). The paper calibrates on about 128K "
        "positions. Reproduce with `python benchmarks/real_scale.py follow --out $WORK/calib --work $WORK/scale` "
        "(calibrates, keeps snapshots, scores each; resumable), then `report`.",
        "",
        *curve_table(report["alone"], report["curves"]),
    ]
    lines += [
        "",
        "Exact-match and choice tasks: items right / items scored; perplexity tasks: mean NLL per "
        "token of the continuation (lower is better). Held-out R^2: mean over target layers on the contexts of the "
        "perplexity items (keys in content space). Fit s: solving the ridge from the statistics (layer selection "
        "included); calibration s: the pass that gathered them (both models' forwards and the sums, in "
        "chunks of 4 x 1,024 tokens on one or two threads of a machine shared with other work).",
    ]
    for held in report.get("held_out") or []:
        lines += [
            "",
            f"The same fits on a second item set (`real_scale.py --items {held['items']} --seed {held['seed']} score`, "
            f"{held['items']} items per task, seed {held['seed']}: items the variants were not compared on):",
            "",
            *curve_table(held["alone"], held["curves"]),
        ]
    for name, result in (report.get("finetunes") or {}).items():
        settings = result["settings"]
        objective = result.get("objective", "attention")  # the first fine-tunes ran before `--objective`
        described = {"attention": "the per-layer attention objective", "kl": "the end-to-end KL through the target"}
        metric, initial, best = finetune_metric(result)
        data = (
            "retrieval and chat-recall prompts with their answers, built from the calibration split"
            if result.get("data") == "readback"
            else "another calibration seed"
        )
        option = " --data readback" if result.get("data") == "readback" else ""
        start = "the ridge fitted at that size"
        if result.get("start", "ridge-k8") not in rf.VARIANTS:  # a fine-tune of a fine-tune
            start = f"`{result['start']}`"
            option += f" --variant {result['start']} --name {name.split('/')[-1].split('@')[0]}"
            if "calibration_seed" in result:
                option += f" --calibration-seed {result['calibration_seed']}"
        lines += [
            "",
            f"`{name}`: {start}, then fine-tuned by {described[objective]} "
            f"(`real_scale.py finetune --objective {objective}{option}`: {result['sequences_train']} sequences of "
            f"{result['sequence_length']} tokens of {data}, {result['sequences_val']} held out, "
            f"Adam {settings['lr']:g}, {result['steps_run']} steps in {result['seconds']:.0f} s): held-out {metric} "
            f"{initial:.4f} -> {best:.4f} (best at step {result['best_step']}).",
        ]
    feature_fits = report.get("feature_fits") or {}
    if feature_fits:
        lines += [
            "",
            "Fitted on features (`real_scale.py features`: one pass of both models keeping the content-space features "
            "in memory, every variant solved or trained on them with the k = 8 selection of a snapshot's statistics; "
            "`ridge-k8-feat` is the per-position ridge on the same features, the control; `-w1`/`-w3`: each map also "
            "reads the 1 / 3 positions before; `-both`: keys and values together; `mlp-k8-h256`: the paper's MLP at "
            "hidden size 256, ridge-initialized, 10 epochs):",
            "",
            "| fit | sequences x tokens (stride) | calibration seed | selection from | feature pass s | fit s |",
            "|---|---|---|---|---|---|",
        ]
        for name, record in feature_fits.items():
            lines.append(
                f"| `{name}` | {record['sequences']} x {record['seq_len']:,} ({record['stride']}) | "
                f"{record['calibration_seed']} | {record['selection_positions']:,} positions | "
                f"{record['feature_seconds']:.0f} | {record['fit_seconds']:.0f} |"
            )
    swap = report.get("layer_swap") or {}
    if swap:
        lines += [
            "",
            "Which layers break it (`hf_kvmap.diagnostics.layer_swap` on real weights: the target reads its own cache "
            "except one mapped layer; then only the mapped keys, only the mapped values, of every layer; and the converse, "
            "every layer mapped except one that stays the target's own; and the target's own first n layers with the "
            "rest mapped, the cache a target gets by running its first n layers itself; and every layer mapped but the "
            "prompt's first n tokens, which are the target's own, the cache a target gets by prefilling them itself):",
            "",
            "| task / fit | target alone | all mapped | keys only mapped | values only mapped | worst single layers | "
            "all mapped but one, the target's own | the target's own first n layers, the rest mapped | "
            "the target's own first n tokens, the rest mapped |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for key, row in swap.items():
            task = key.split("|")[0]
            higher_is_better = not task.endswith(("nll", "ppl"))
            worst = sorted(row["layers"].items(), key=lambda kv: kv[1], reverse=not higher_is_better)[:4]
            worst_cells = ", ".join(f"L{layer} {score:.3f}" for layer, score in worst) or "not run"
            own_cells = ", ".join(f"all but L{layer}: {score:.3f}" for layer, score in row.get("all_but", {}).items())
            first_cells = ", ".join(f"{n}: {score:.3f}" for n, score in row.get("own_first", {}).items())
            token_cells = ", ".join(f"{n}: {score:.3f}" for n, score in row.get("own_tokens", {}).items())
            lines.append(
                f"| {task}, {key.split('|')[2]}/{key.split('|')[3]} at {int(key.split('|')[1]):,} positions | "
                f"{row['target']:.3f} | {row['mapped']:.3f} | "
                f"{row['keys_only']:.3f} | {row['values_only']:.3f} | {worst_cells} | {own_cells or 'not run'} | "
                f"{first_cells or 'not run'} | {token_cells or 'not run'} |"
            )
    lines += ["", "![real family, calibration scale](benchmarks/results/real_family_scale.png)"]
    return "\n".join(lines)


def mapper_records(work: Path, filename: str) -> dict:
    """`{"<direction>/<variant>@<positions>": record}` of the `filename` JSON kept beside each fitted mapper (its
    `history`, when it has one, left out)."""
    records = {}
    for path in sorted((work / "mappers").glob(f"*/*/*/{filename}")):
        positions, direction, variant = path.parent.relative_to(work / "mappers").parts
        record = json.loads(path.read_text())
        records[f"{direction}/{variant}@{positions}"] = {k: v for k, v in record.items() if k != "history"}
    return records


def cmd_report(args) -> int:
    from hf_kvmap.reporting import environment_info, update_file_section

    work = Path(args.work)
    path = work / f"scores-items{args.items}-seed{args.seed}-{args.dtype}.json"
    scores = json.loads(path.read_text())
    curves = assemble_curve(scores)
    report = {
        "run": {
            "items_per_task": args.items,
            "seed": args.seed,
            "dtype": args.dtype,
            "ridge_lambda": sorted({v["ridge_lambda"] for v in scores.values() if "ridge_lambda" in v}),
        },
        "alone": {k: v for k, v in scores.items() if "|alone|" in k},
        "curves": curves,
    }
    for key, filename in (("finetunes", "finetune.json"), ("feature_fits", "features.json")):
        records = mapper_records(work, filename)
        if records:
            report[key] = records
    for spec in args.held_out:
        items, seed = (int(n) for n in spec.split(":"))
        held = json.loads((work / f"scores-items{items}-seed{seed}-{args.dtype}.json").read_text())
        report.setdefault("held_out", []).append(
            {"items": items, "seed": seed, "alone": {k: v for k, v in held.items() if "|alone|" in k},
             "curves": assemble_curve(held)}
        )  # fmt: skip
    swap = work / f"swap-items{args.items}-seed{args.seed}-{args.dtype}.json"
    if swap.is_file():
        report["layer_swap"] = json.loads(swap.read_text())
    report["environment"] = environment_info()
    cards = write_cards(work, report)
    rf.write_json(RESULTS, report)
    plot_curve(curves, PLOT, report["alone"])
    update_file_section(HERE.parent / "README.md", "real-scale", report_markdown(report))
    for name, rows in curves.items():
        for row in rows:
            cells = ", ".join(
                f"{t} {r['mapped']:.3f}/{r['target']:.3f}" for t, r in {**row["tasks"], **row["perplexity"]}.items()
            )
            print(f"{name} @ {row['positions']}: {cells}")
    print(f"wrote {RESULTS}, {PLOT}, README section real-scale, cards {', '.join(cards) or 'none'}")
    return 0


def paper_scale_fits(report: dict) -> dict[str, tuple[str, dict]]:
    """Card name -> `(curve, row)` of each plain ridge (`ridge-k8`, `ridge-all`) fitted at the paper's calibration
    scale (`PAPER_POSITIONS` or more; the largest fit of its curve, e.g. `0.5b-to-1.5b/ridge-k8`)."""
    fits = {}
    for curve, rows in report["curves"].items():
        direction, variant = curve.split("/")
        if variant in rf.VARIANTS and rows[-1]["positions"] >= PAPER_POSITIONS:
            fits[f"qwen2.5-coder-{direction}-{variant}-{rows[-1]['positions'] // 1024}k"] = (curve, rows[-1])
    return fits


def render_scale_card(name: str, config, report: dict, row: dict):
    """The card of one paper-scale fit: its results on the curve's items and its held-out R^2."""
    from hf_kvmap.card import render_card

    results = {key: row[key] for key in ("tasks", "perplexity", "summary") if key in row}
    if "held_out_r2" in row:
        results["diagnostics_summary"] = {
            f"held-out {part} R^2 (mean over target layers)": value for part, value in row["held_out_r2"].items()
        }
    return render_card(rf.weightless_mapper(config), rf.card_results(report, results), model_name=name)


def write_cards(work: Path, report: dict) -> list[str]:
    """A card in `model_cards/real/` for each fit of `paper_scale_fits`; its config is kept beside the 16K fits'
    (`real_family_configs/`), so the card can be rendered again without the weights."""
    from hf_kvmap import MapperConfig

    fits = paper_scale_fits(report)
    for name, (curve, row) in fits.items():
        config = MapperConfig.from_pretrained(mapper_folder(work, row["positions"], *curve.split("/")))
        config.save_pretrained(rf.CONFIGS / name)
        render_scale_card(name, config, report, row).save(rf.CARDS / f"{name}.md")
    return list(fits)


def fit_command(sub, name: str, help: str, tasks: str) -> argparse.ArgumentParser:
    """A subcommand about one direction's fitted mappers: the options `finetune`, `swap` and `first-layer` share."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--manifest", type=Path, default=rf.MANIFEST)
    p.add_argument("--tasks", default=tasks)
    p.add_argument("--directions", default="0.5b-to-1.5b", help=argparse.SUPPRESS)
    p.add_argument("--direction", default="0.5b-to-1.5b")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=None, help="hf-kvmap obtain cache (default ~/.cache/hf-kvmap)")
    parser.add_argument("--dtype", choices=sorted(rf.DTYPES), default="float32")
    parser.add_argument("--items", type=int, default=16, help="items per task")
    parser.add_argument("--seed", type=int, default=1234)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="fit every snapshot and score it (resumable)")
    p.add_argument("--calibration", type=Path, required=True, help="the calibrate --out folder (its snapshots)")
    p.add_argument("--work", type=Path, required=True, help="scores and prefills are kept here")
    p.add_argument("--manifest", type=Path, default=rf.MANIFEST)
    p.add_argument("--tasks", default=TASKS)
    p.add_argument("--directions", default="0.5b-to-1.5b,1.5b-to-0.5b")
    p.add_argument("--variants", default="ridge-k8,ridge-all")
    p.add_argument("--sizes", type=lambda t: set(int_list(t)), default=None, help="only these calibration positions")
    p.add_argument("--ridge-lambda", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("follow", help="calibrate and score each snapshot as it is kept, one process")
    p.add_argument("--out", type=Path, required=True, help="the calibration folder (as calibrate --out)")
    p.add_argument("--work", type=Path, required=True, help="scores and prefills are kept here")
    p.add_argument("--manifest", type=Path, default=rf.MANIFEST)
    p.add_argument("--sequences", type=int, default=500)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=4)
    p.add_argument("--stride", type=int, default=2)
    p.add_argument("--calibration-seed", dest="calibration_seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--snapshots", type=lambda t: set(int_list(t)), default={2, 4, 8, 16, 32, 64})
    p.add_argument("--tasks", default=TASKS)
    p.add_argument("--directions", default="0.5b-to-1.5b")
    p.add_argument("--variants", default="ridge-k8,ridge-all")
    p.add_argument("--ridge-lambda", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_follow)
    p = fit_command(sub, "finetune", "attention or KL fine-tune of one fitted mapper, scored like the curve", TASKS)
    p.add_argument("--objective", choices=sorted(FINETUNE_OBJECTIVES), default="attention")
    p.add_argument("--min-prefix", type=int, default=32, help="kl: the shortest mapped prefix and suffix")
    p.add_argument(
        "--data",
        choices=("calibration", "readback"),
        default="calibration",
        help="calibration text, or retrieval and chat-recall prompts built from the calibration split (--seq-len unused)",
    )
    p.add_argument("--variant", default="ridge-k8", help="the fitted mapper to start from (a fine-tuned one too)")
    p.add_argument("--name", default=None, help="the fine-tuned variant (default: <variant>-<objective>[-readback])")
    p.add_argument("--positions", type=int, default=None, help="which fit (default: the largest)")
    p.add_argument("--sequences", type=int, default=32, help="fine-tune sequences (the last --val-sequences held out)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calibration-seed", dest="calibration_seed", type=int, default=1, help="not the ridge's stream")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=1e-4, help="Adam step (1e-3 made the held-out error worse here)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--val-sequences", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_finetune)
    p = fit_command(sub, "features", "fit and score the mappers that need features (windows, both kinds, MLP)", TASKS)
    p.add_argument("--calibration", type=Path, required=True, help="the calibration folder (its snapshots)")
    p.add_argument("--selection-positions", type=int, default=32768, help="the snapshot whose k = 8 selection is used")
    p.add_argument("--variants", default="ridge-k8-feat,ridge-k8-w1,ridge-k8-w3,ridge-k8-both")
    p.add_argument("--sequences", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--batch", type=int, default=2, help="sequences per forward")
    p.add_argument("--calibration-seed", dest="calibration_seed", type=int, default=2, help="not the ridge's stream")
    p.add_argument("--ridge-lambda", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_features)
    p = fit_command(sub, "swap", "layer_swap of one fitted mapper on real weights", "prose_retrieval,code_nll")
    p.add_argument("--variant", default="ridge-all")
    p.add_argument("--positions", type=int, default=None, help="which fit (default: the largest)")
    p.add_argument("--layers", default="all", help="layers to swap in one at a time ('all', or a list, may be empty)")
    p.add_argument("--own-layers", default="", help="layers kept the target's own, one at a time, the rest mapped")
    p.add_argument(
        "--own-first",
        default="",
        help="numbers n of leading layers kept the target's own (layers 0..n-1), the rest mapped",
    )
    p.add_argument(
        "--own-tokens",
        default="",
        help="numbers n of leading prompt tokens kept the target's own in every layer, the rest mapped",
    )
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_swap)
    p = fit_command(sub, "first-layer", "score fitted mappers with the target computing its first layer", TASKS)
    p.add_argument("--fits", required=True, help="positions:variant,... of fitted mappers (e.g. 32768:ridge-k8)")
    p.add_argument("--also-plain", action="store_true", help="score each mapper without the first layer too")
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_first_layer)
    p = fit_command(sub, "guard", "the guarded handoff's candidate probes on one fitted mapper (two item sets)", TASKS)
    p.add_argument("--variant", default="ridge-k8")
    p.add_argument("--positions", type=int, default=None, help="which fit (default: the largest)")
    p.add_argument("--report-seed", type=int, default=4321, help="the report set (thresholds come from --seed's)")
    p.add_argument("--max-false-alarm", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_guard)
    p = fit_command(
        sub, "keys", "per layer: mapped key norms, cosines and R^2 against the target's", "code_nll,prose_ppl"
    )
    p.add_argument("--fits", required=True, help="positions:variant,... of fitted mappers (e.g. 131072:ridge-k8)")
    p.add_argument("--out", type=Path, default=KEYS_RESULTS)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_keys)
    p = fit_command(sub, "score", "score fitted mappers and both models alone on the items of --items/--seed", TASKS)
    p.add_argument("--fits", required=True, help="positions:variant,... of fitted mappers (e.g. 32768:ridge-k8)")
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_score)
    p = sub.add_parser("report", help="write the results JSON and the plot")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument(
        "--held-out",
        action="append",
        default=[],
        metavar="ITEMS:SEED",
        help="also tabulate the fits scored (`score`) on this item set; repeatable",
    )
    p.set_defaults(func=cmd_report)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
