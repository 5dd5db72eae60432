"""The scale curve: fits of growing calibration snapshots, the scorer every scale command shares, `scale run`,
`follow`, `score` and `first-layer`."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_kvmap.real.calibrating import checkpoint_dir

from .calibrate import cmd_calibrate
from .common import (
    BENCHMARKS,
    DIRECTIONS,
    LARGE,
    SHORT,
    SMALL,
    VARIANTS,
    PrefillStore,
    cached_handoff_class,
    direction_name,
    load_model,
    load_tokenizer,
    save_atomically,
    stats_dir,
    write_json,
)
from .evaluate import held_out_r2
from .fit import ridge_all_mapper

SCALE_RESULTS = BENCHMARKS / "results" / "real_family_scale.json"
GUARD_RESULTS = BENCHMARKS / "results" / "real_family_guard.json"
#: the generation tasks the guard is measured on (a probe predicts a changed greedy answer)
GUARD_TASKS = ("prose_retrieval", "chat_recall")
SCALE_PLOT = BENCHMARKS / "results" / "real_family_scale.png"
TASKS = "prose_retrieval,chat_recall,code_recall,code_nll"
#: the paper's calibration: 500 sequences x 1,024 tokens at stride 4 (its "~128K tokens"); cards are written from here
PAPER_POSITIONS = 128_000


def snapshots(calibration: Path) -> list[tuple[int, Path]]:
    """`(positions, folder)` of every complete snapshot and of the current checkpoint, smallest first."""
    found = {}
    for folder in [*sorted(calibration.glob("snapshot-*")), checkpoint_dir(calibration)]:
        if folder is None or folder.name.endswith(".tmp") or not (folder / "progress.json").is_file():
            continue
        progress = json.loads((folder / "progress.json").read_text())
        found.setdefault(int(progress["positions"]), folder)
    return sorted(found.items())


def fit(stats, variant: str, ridge_lambda: float):
    from hf_kvmap import LayerSelection, mapper_from_statistics

    selection = LayerSelection.from_statistics(stats)
    top_k = VARIANTS[variant]
    if top_k is None:
        return ridge_all_mapper(stats, selection, ridge_lambda)
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
        from lab.real.tasks import real_family_tasks

        self.args = args
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.tokenizer = load_tokenizer(SMALL, args.cache_dir)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        documents = corpus.load_manifest(args.manifest)
        self.tasks = real_family_tasks(
            self.tokenizer, documents, items=args.items, seed=args.seed, names=args.tasks.split(",")
        )
        self.models = models or {name: load_model(name, args.cache_dir, args.dtype) for name in (SMALL, LARGE)}
        self.names = {id(model): SHORT[name] for name, model in self.models.items()}
        self.store = PrefillStore(self.work / "prefills")
        self.handoff_class = cached_handoff_class()
        self.path = self.work / f"scores-items{args.items}-seed{args.seed}-{args.dtype}.json"
        self.scores = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.contexts = perplexity_contexts(self.tokenizer, self.tasks)
        self.directions = [d for d in DIRECTIONS if direction_name(*d) in args.directions.split(",")]

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
        value = evaluate_items(handoff, task.task_type, task.items, mode, progress=key, **kwargs)
        seconds = time.perf_counter() - start
        self.scores[key] = {"score": value, "n_items": len(task.items), "seconds": seconds, **extra}
        write_json(self.path, self.scores)
        print(f"{key}: {value:.4f} ({seconds:.0f} s)", flush=True)

    def alone(self) -> None:
        handoff = self.handoff(SMALL, LARGE, None)
        for task in self.tasks:
            self.record(f"{task.name}|alone|{SHORT[SMALL]}", task, handoff, "source")
            self.record(f"{task.name}|alone|{SHORT[LARGE]}", task, handoff, "target")

    def score(self, positions: int, folder: Path) -> None:
        """Fit every variant of every direction on the snapshot `folder` and score it (skipping what is scored)."""
        from hf_kvmap import CalibrationStatistics

        for source, target in self.directions:
            direction = direction_name(source, target)
            todo = [
                v
                for v in self.args.variants.split(",")
                if any(f"{t.name}|{positions}|{direction}|{v}" not in self.scores for t in self.tasks)
            ]
            if not todo:
                continue
            self.record_calibration(positions, folder)
            stats = CalibrationStatistics.load(stats_dir(folder, source, target))
            for variant in todo:
                start = time.perf_counter()
                mapper = fit(stats, variant, self.args.ridge_lambda)
                fit_seconds = time.perf_counter() - start
                save_atomically(mapper, mapper_folder(self.work, positions, direction, variant))
                extra = {"fit_seconds": fit_seconds, "ridge_lambda": self.args.ridge_lambda}
                self.score_mapper(positions, source, target, variant, mapper, **extra)
            del stats

    def record_calibration(self, positions: int, folder: Path) -> None:
        """What the statistics of a snapshot cost: the seconds of its chunks (both models' forwards and the sums)."""
        key = f"calibration|{positions}"
        if key not in self.scores:
            done = json.loads((folder / "progress.json").read_text())["done"]
            self.scores[key] = {"seconds": sum(c["seconds"] for c in done.values()), "chunks": len(done)}
            write_json(self.path, self.scores)

    def score_mapper(
        self, positions: int, source: str, target: str, variant: str, mapper, target_first_layer: bool = False, **extra
    ) -> None:
        """Held-out R^2 and every task of one fitted mapper, keyed by its calibration size (skipping what is scored);
        with `target_first_layer` the handoff has the target compute its first layer (no R^2: the same map)."""
        direction = direction_name(source, target)
        mapper = mapper.to(self.models[target].dtype)
        key = f"r2|{positions}|{direction}|{variant}"
        if key not in self.scores and self.contexts and not target_first_layer:
            m = self.models
            self.scores[key] = held_out_r2(mapper, m[source], m[target], source, target, self.store, self.contexts)
            write_json(self.path, self.scores)
        handoff = self.handoff(source, target, mapper, target_first_layer)
        for task in self.tasks:
            self.record(f"{task.name}|{positions}|{direction}|{variant}", task, handoff, "mapped", **extra)


def direction_models(direction: str) -> tuple[str, str]:
    """`(source, target)` model names of a direction such as `0.5b-to-1.5b`."""
    short = {v: k for k, v in SHORT.items()}
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
    """Calibrate (as `family calibrate`, resumable) and score each snapshot as it is kept, in one process
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
    return cmd_calibrate(calibration, models=scorer.models, after_checkpoint=after_checkpoint)


#: `finetune --objective`: the fine-tune and the suffix of the fine-tuned variant's name


def int_list(text: str) -> list[int]:
    """`"1,2,4"` -> `[1, 2, 4]`; an empty string is an empty list."""
    return [int(n) for n in text.split(",") if n]


FIRST_LAYER = "+target-L0"


def cmd_first_layer(args) -> int:
    """The fitted mappers scored again with the target computing its own first layer from the token ids
    (`MappedCache.from_source(..., first_layer="target", target_model=, input_ids=)`), as variant
    `<variant>+target-L0`: what the map keeps once layer 0, which `swap` shows breaks retrieval alone, is exact."""
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
