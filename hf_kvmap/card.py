"""Model cards of mappers, rendered from structured data through `huggingface_hub`'s card API and a Jinja template."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .artifacts import EVALUATION_FILE, results_belong_to, results_hash
from .atomic import write_file_atomically
from .flops import mapper_parameters
from .reporting import PORTABLE_KERNELS, fmt_number, retention_cells, retention_measurable, write_json

TEMPLATE_PATH = Path(__file__).resolve().parent / "templates" / "mapper_card.md.jinja"


def _side(config, side: str) -> dict[str, Any]:
    geometry = getattr(config, f"{side}_geometry")
    summary = getattr(config, f"{side}_summary")
    rope = summary.get("rope_parameters") or {}
    return {
        "id": getattr(config, f"{side}_model_id"),
        "revision": getattr(config, f"{side}_revision"),
        "model_type": summary.get("model_type"),
        "geometry": f"{summary.get('model_type')}, {geometry.num_layers} layers, {geometry.num_kv_heads} KV heads x "
        f"{geometry.head_dim}, rope {rope.get('rope_type', 'default')}",
    }


def card_data(config, results: dict | None, model_name: str) -> ModelCardData:
    """The YAML metadata: library, tags, both base models, and model-index results when an evaluation exists."""
    # only Hub ids belong in `base_model` (not local paths or package-internal names like `hf_kvmap.zoo:tiny-s`)
    base_models = [
        m
        for m in (config.source_model_id, config.target_model_id)
        if m and ":" not in m and not m.startswith(("/", "."))
    ]
    eval_results = []
    for task, row in (results or {}).get("tasks", {}).items():
        if not retention_measurable(row):
            continue  # the target does not beat chance: no retention figure to publish
        for metric, key in (
            ("raw retention", "retention"),
            ("floor-normalized retention", "floor_normalized_retention"),
        ):
            value = row.get(key)
            if value is None or (isinstance(value, float) and not math.isfinite(value)):
                continue
            eval_results.append(
                EvalResult(
                    task_type="kv-cache-transfer",
                    task_name="KV cache transfer",
                    # the Hub groups results by dataset type, so each task gets its own
                    dataset_type=f"{results.get('run', {}).get('task_set', 'hf-kvmap')}/{task}",
                    dataset_name=task,
                    metric_type=key,
                    metric_name=metric,
                    metric_value=round(float(value), 4),
                )
            )
    return ModelCardData(
        model_name=model_name,
        library_name="hf-kvmap",
        tags=["hf-kvmap", "kv-cache", f"mapper-{config.kind}"],
        base_model=base_models or None,
        eval_results=eval_results or None,
    )


_MLP_SETTINGS = (
    "hidden_size",
    "init",
    "optimizer",
    "lr",
    "warmup_steps",
    "epochs",
    "batch_tokens",
    "loss",
    "split",
    "val_fraction",
    "patience",
    "positions_train",
    "positions_val",
    "seed",
    "torch_version",
)


def refit_reproducibility(config) -> str:
    """Whether a refit of the same calibration on another CPU is expected to give this mapper's bytes, from the
    kernel settings its statistics were gathered and solved with (`hf_kvmap.reporting.kernel_settings`; measured
    for ridge fits by `benchmarks.speed.portable_fit`, not for trained or fine-tuned maps)."""
    calibration = config.calibration or {}
    gathered, solved = calibration.get("kernel_settings"), calibration.get("solve_kernel_settings")
    portable = "`ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE`"  # the environment PORTABLE_KERNELS labels
    if gathered is None or solved is None:
        return "unknown (the kernel settings were not recorded)"
    if gathered != PORTABLE_KERNELS or solved != PORTABLE_KERNELS:
        return (
            f"other bytes on another CPU (gathered with {gathered}, solved with {solved}); set {portable} for a "
            "reproducible refit"
        )
    trained = ("mlp_training", "attention_finetune", "kl_finetune", "long_kl_finetune")
    trained = [key for key in trained if key in calibration]
    if trained:
        return (
            f"the statistics and ridge are portable; not measured for the training after them ({', '.join(trained)})"
        )
    return f"the same bytes on other x86 CPUs under the same settings (portable kernels: {portable})"


def _objective_rows(config) -> list[tuple[str, str]]:
    """Card rows for the per-map inputs, the key normalisation and the objective (none for a config without them,
    so older cards render unchanged)."""
    rows = []
    for layer, parts in sorted(getattr(config, "layer_inputs", {}).items(), key=lambda item: int(item[0])):
        for part in sorted(parts):
            window, input_kinds = config.part_inputs(int(layer), part)
            reads = "keys and values" if input_kinds == "both" else f"{part}s"
            rows.append((f"target layer {layer} {part} map reads", f"source {reads}, context window {window}"))
    if getattr(config, "key_norm", False):
        rows.append(("key normalisation", f"the target's per-head key norm (eps {config.key_norm_eps:g})"))
    calibration = config.calibration or {}
    record = calibration.get("attention_finetune")
    if record:
        settings = record["settings"]
        measure = "attention logits over the mapped keys" if settings["loss"] == "logits" else (
            "attention output over the mapped cache" + (" (through the output projection)"
                                                        if settings["space"] == "residual" else "")
        )  # fmt: skip
        relative = "relative " if settings["normalize"] else ""
        rows.append(
            (
                "objective" if "kl_finetune" not in calibration else "objective (first stage)",
                f"fit, then the per-layer {measure} of the frozen target's own queries: held-out "
                f"{relative}error {fmt_number(record['initial_val_error'], 4, 'g')} -> "
                f"{fmt_number(record['best_val_error'], 4, 'g')} (best step {record['best_step']} of "
                f"{record['steps_run']}; Adam lr {settings['lr']:g}, {settings['batch_size']} sequences per step, "
                f"{record['sequences_train']} + {record['sequences_val']} held-out sequences of "
                f"{record['sequence_length']} tokens)",
            )
        )
    record = calibration.get("kl_finetune")
    if record:
        settings = record["settings"]
        rows.append(
            (
                "objective" if "attention_finetune" not in calibration else "objective (second stage)",
                f"{'fit' if 'attention_finetune' not in calibration else 'attention fine-tune'}, then end-to-end KL "
                f"through the frozen target: held-out KL "
                f"{fmt_number(record['initial_val_kl'], 4, 'g')} -> {fmt_number(record['best_val_kl'], 4, 'g')} "
                f"(best step {record['best_step']} of {record['steps_run']}; Adam lr {settings['lr']:g}, "
                f"{settings['batch_size']} sequences per step, {record['sequences_train']} + "
                f"{record['sequences_val']} held-out sequences of {record['sequence_length']} tokens)",
            )
        )
    record = calibration.get("long_kl_finetune")
    if record:
        settings, data = record["settings"], record["rows"]
        rows.append(
            (
                "fine-tuned: KL at length",
                f"end-to-end KL through the frozen target of a tail of {data['tail']} tokens read through the mapped "
                f"cache of the rest (rows of {data['seq_len']} tokens, the teacher's top {data['top_k']} tokens): "
                f"held-out KL {fmt_number(record['initial_val_kl'], 4, 'g')} -> "
                f"{fmt_number(record['best_val_kl'], 4, 'g')} (best step {record['best_step']} of "
                f"{record['steps_run']}; Adam lr {settings['lr']:g}, {settings['batch_rows']} rows per step, "
                f"{len(data['train'])} + {len(data['val'])} held-out rows; from the map "
                f"{record['base_content_hash'] or '(unhashed)'})",
            )
        )
    return rows


def _mlp_training(config) -> tuple[list[tuple[str, Any]], list[dict[str, str]]]:
    """The MLP training record of `config.calibration["mlp_training"]` as card rows: the settings, and per target
    layer and K/V the held-out MSE and R^2 of the ridge (fitted on the same split) against the MLP kept."""
    training = (config.calibration or {}).get("mlp_training") if config.kind == "mlp" else None
    if not training:
        return [], []
    settings = [(key, training[key]) for key in _MLP_SETTINGS if training.get(key) is not None]
    rows = []
    for entry in training.get("layers", []):
        for part in ("key", "value"):
            row = entry[part]
            rows.append(
                {
                    "layer": entry["layer"],
                    "part": part,
                    # MSEs span orders of magnitude across layers: significant digits
                    "ridge_mse": fmt_number(row.get("ridge_val_mse"), 3, "g"),
                    "mlp_mse": fmt_number(row.get("val_mse"), 3, "g"),
                    "ridge_r2": fmt_number(row.get("ridge_val_r2")),
                    "mlp_r2": fmt_number(row.get("val_r2")),
                    "epoch": f"{row.get('best_epoch')} / {row.get('epochs_run')}",
                }
            )
    return settings, rows


def _handoff_guard(config) -> list[tuple[str, Any]]:
    """Rows of the card's guarded-handoff table, from `config.handoff_probe` (empty when it was never calibrated)."""
    stored = getattr(config, "handoff_probe", None)
    if not stored:
        return []
    probe = stored.get("probe", {})
    if probe.get("name") == "linear":
        described = "linear: " + " + ".join(
            f"{fmt_number(weight, 3, 'g')} x {part['name']}:{part.get('tokens')}"
            for weight, part in zip(probe.get("weights", []), probe.get("components", []))
        )
        described += f" + {fmt_number(probe.get('bias'), 3, 'g')}"
    else:
        described = f"{probe.get('name')}:{probe.get('tokens')}"
    calibration = stored.get("calibration", {})
    rows = [
        ("probe", f"`{described}`"),
        ("threshold (refuse when risk is above)", fmt_number(stored.get("threshold"), 4, "g")),
        ("false-alarm budget", fmt_number(stored.get("max_false_alarm"), 2)),
    ]
    if calibration:
        rows += [
            (
                "calibration items",
                f"{calibration.get('items')} ({', '.join(calibration.get('tasks', []))}, seed "
                f"{calibration.get('seed')})",
            ),
            ("answers changed by the mapping there", calibration.get("changed")),
            (
                "caught / false alarms there",
                f"{fmt_number(calibration.get('true_alarm'), 2)} / {fmt_number(calibration.get('false_alarm'), 2)}",
            ),
        ]
    return rows


def _ladder(config) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The card's guard-ladder summary and rows, from `config.handoff_ladder` (empty when there is none)."""
    stored = getattr(config, "handoff_ladder", None)
    if not stored:
        return {}, []
    probe, strategy = stored.get("probe", {}), stored.get("strategy", {})
    calibration = stored.get("calibration") or {}
    outcome = calibration.get("outcome", {})
    rungs = [{"name": "mapped" if r["fraction"] == 0 else "repair", **r} for r in stored.get("rungs", [])]
    shares = outcome.get("rungs", {})
    rows = [
        {
            "rung": rung["name"],
            "max_risk": fmt_number(rung["max_risk"], 4, "g"),
            "fraction": f"{rung['fraction']:.0%}",
            "shares": fmt_number(shares.get("mapped" if rung["fraction"] == 0 else f"repair:{rung['fraction']:g}"), 2),
        }
        for rung in rungs
    ]
    rows.append(
        {"rung": "fallback", "max_risk": "above", "fraction": "100%", "shares": fmt_number(shares.get("fallback"), 2)}
    )
    summary = {
        "probe": f"{probe.get('name')}:{probe.get('tokens')}",
        "strategy": ", ".join(f"{k}={v}" for k, v in strategy.items()),
        "group_names": "share of calibration items",
        "calibrated": "",
    }
    if calibration:
        per_group = outcome.get("per_group", {})
        worst = max((g["changed_served"] for g in per_group.values()), default=outcome.get("changed_served"))
        summary["calibrated"] = (
            f"Calibrated on {calibration.get('items')} items ({', '.join(sorted(per_group))}): changed answers served "
            f"at most {fmt_number(calibration.get('max_changed'), 2)} per task"
            + (
                f" as a one-sided {fmt_number(calibration['confidence'], 2)} upper confidence bound"
                if calibration.get("confidence") is not None
                else ""
            )
            + f" (there: {fmt_number(worst, 3)} on the "
            f"worst task), mean cost {fmt_number(outcome.get('mean_cost'), 3)} of a prefill with the probe, the mapping, "
            f"the repairs and the fallbacks counted (net saving {fmt_number(outcome.get('net_saving'), 3)})."
        )
    if stored.get("min_tokens") is not None:
        summary["calibrated"] += (
            f" A prompt of fewer than {stored['min_tokens']} tokens is not mapped: the target prefills it"
            + (
                f" ({fmt_number(shares['short'], 2)} of the calibration items)."
                if shares.get("short") is not None
                else "."
            )
        )
    if stored.get("min_margin") is not None:
        summary["calibrated"] += (
            (
                " After its rung each row is checked: the target runs the prompt's last token on the served cache, "
                "and a row whose first answer token it takes"
                if stored.get("check_tokens", 1) == 1
                else f" After its rung each row is checked: the target decodes its first {stored['check_tokens']} "
                "greedy answer tokens on the served cache (cropped back after), and a row any of them it takes"
            )
            + " with a probability margin (top-1 minus top-2) below "
            f"{fmt_number(stored['min_margin'], 2)} falls back to the target's own prefill"
            + (
                f" ({fmt_number(outcome['checked_fallback'], 2)} of the calibration items)."
                if "checked_fallback" in outcome
                else "."
            )
        )
    return summary, rows


def render_card(
    mapper, results: dict | None = None, model_name: str | None = None, repo_id: str | None = None
) -> ModelCard:
    """Render the card of `mapper` (a `MapperModel` or `MapperConfig`) with an optional evaluation results dict.

    `results` is the JSON `hf-kvmap eval` / `hf-kvmap demo` writes (`tasks`, `perplexity`, `latency`,
    `diagnostics`, `run`, `environment`). Unknown values are left out of the card.
    """
    config = getattr(mapper, "config", mapper)
    # what the mapper holds, fitted weights and the target's key-norm weights it copies (`flops.mapper_parameters`
    # counts both; it works from the config alone, so a card rendered from a config gets the same count)
    num_parameters = mapper_parameters(config)
    model_name = model_name or repo_id or f"{config.source_summary['model_type']}-kv-mapper"
    source, target = _side(config, "source"), _side(config, "target")
    depth = (config.source_geometry.num_layers, config.target_geometry.num_layers)
    results = results or {}
    run = results.get("run", {})
    workload = None
    if results.get("tasks"):
        workload = f"{run.get('task_set', 'tasks')}: {', '.join(results['tasks'])}"
        if run.get("items_per_task"):
            workload += f" ({run['items_per_task']} items per task, seed {run.get('seed')})"
    calibration = [
        (key, ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else value)
        for key, value in sorted(config.calibration.items())
        if value is not None and not isinstance(value, dict)
    ]
    retention_rows = [
        {
            "name": name,
            # "kind": results written before the task type had its own name
            "task_type": row.get("task_type", row.get("kind", "")),
            "source": fmt_number(row.get("source")),
            "target": fmt_number(row.get("target")),
            "mapped": fmt_number(row.get("mapped")),
            "chance": fmt_number(row.get("chance"), 2),
            **dict(zip(("retention", "floor"), retention_cells(row))),
        }
        for name, row in results.get("tasks", {}).items()
    ]
    perplexity_rows = [
        {"name": name, **{mode: fmt_number(row.get(mode)) for mode in ("source", "target", "mapped")}}
        for name, row in results.get("perplexity", {}).items()
    ]
    latency_rows = [
        {
            "tokens": row["tokens"],
            "mapper_ms": fmt_number(row["mapper_ms"], 2),
            "prefill_ms": fmt_number(row["prefill_ms"], 2),
            "speedup": fmt_number(row.get("speedup"), 2) + "x",
        }
        for row in results.get("latency", [])
    ]
    mlp_settings, mlp_rows = _mlp_training(config)
    ladder, ladder_rows = _ladder(config)
    env = results.get("environment", {})
    diagnostics = [
        f"{key}: {fmt_number(value) if isinstance(value, float) else value}"
        for key, value in results.get("diagnostics_summary", {}).items()
    ]
    return ModelCard.from_template(
        card_data(config, results, model_name),
        template_path=str(TEMPLATE_PATH),
        model_name=model_name,
        repo_id=repo_id or model_name,
        source=source,
        target=target,
        direction="small -> large"
        if depth[0] < depth[1]
        else ("large -> small" if depth[0] > depth[1] else "same depth"),
        tokenizer_fingerprint=config.tokenizer_fingerprint,
        content_hash=getattr(config, "content_hash", None),
        workload=workload,
        kind=config.kind,
        mlp_hidden_size=config.mlp_hidden_size,
        input_kinds=config.input_kinds,
        context_window=config.context_window,
        objective_rows=_objective_rows(config),
        top_k=", ".join(sorted({str(len(layers)) for layers in config.source_layers})),
        num_parameters=num_parameters,
        key_norm=getattr(config, "key_norm", False),
        ridge_lambda=config.ridge_lambda,
        lambda_convention=config.lambda_convention,
        calibration=calibration,
        refit=refit_reproducibility(config),
        mlp_settings=mlp_settings,
        mlp_rows=mlp_rows,
        library_version=config.library_version,
        retention_rows=retention_rows,
        perplexity_rows=perplexity_rows,
        latency_rows=latency_rows,
        latency_env=f"{env.get('device', 'cpu')}, {env.get('threads', '?')} threads, torch {env.get('torch', '?')}",
        diagnostics=diagnostics,
        handoff_guard=_handoff_guard(config),
        ladder=ladder,
        ladder_rows=ladder_rows,
    )


def write_card(
    mapper,
    folder: str | os.PathLike,
    evaluation: dict | None = None,
    repo_id: str | None = None,
    *,
    name: str | None = None,
) -> Path:
    """(Re)render `folder/README.md` of `mapper` (a `MapperModel`) from its config and the evaluation results.

    A given `evaluation` is stored as `folder/evaluation.json` (refused with `ValueError` if it records the content
    hash of another artifact); without it, the one already there is used if it records this artifact's hash. The
    card is named after `repo_id` (or `name`, or the folder). Returns the card's path.
    """
    folder = Path(folder)
    if evaluation is not None:
        if results_belong_to(evaluation, mapper.config, mapper.state_dict()) is False:
            raise ValueError(
                f"These results were measured on the mapper with content hash {results_hash(evaluation)}, not "
                f"on this one ({mapper.config.content_hash}): evaluate this mapper (`hf-kvmap eval`) instead."
            )
        write_json(folder / EVALUATION_FILE, evaluation)
    elif (folder / EVALUATION_FILE).exists():
        previous = json.loads((folder / EVALUATION_FILE).read_text())
        if results_belong_to(previous, mapper.config, mapper.state_dict()):
            evaluation = previous
    model_name = repo_id.split("/")[-1] if repo_id else (name or folder.resolve().name)
    card = render_card(mapper, evaluation, model_name=model_name, repo_id=repo_id)
    write_file_atomically(folder / "README.md", card.save)
    return folder / "README.md"
