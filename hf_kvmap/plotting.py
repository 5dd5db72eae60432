"""Every plot hf-kvmap draws, from results already computed (matplotlib is optional: `pip install hf-kvmap[plot]`).

Compute modules never import this one; the command line and the scripts call it with what they computed.
"""

from __future__ import annotations

from pathlib import Path

from transformers.utils import logging

logger = logging.get_logger(__name__)


def save_figure(fig, path, dpi: int) -> None:
    """`fig.savefig` written atomically (a kill leaves the previous image or the complete new one), in the format
    that `path`'s suffix names (PNG without one)."""
    from .atomic import write_file_atomically

    form = Path(path).suffix.lstrip(".").lower() or "png"
    write_file_atomically(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=form))


def pyplot(what: str):
    """`matplotlib.pyplot` on the non-interactive backend, or `None` (logged) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info(f"matplotlib is not installed; skipping {what}.")
        return None
    return plt


def plot_selection(selection, path) -> bool:
    """The probe scores of a `LayerSelection` (target layer vs source layer, selected cells marked) as a PNG.

    Returns `False` without writing anything when matplotlib is not installed.
    """
    plt = pyplot("the selection heat map")
    if plt is None:
        return False
    scores = selection.scores.numpy()
    height, width = scores.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.25 * width + 2), max(3.0, 0.25 * height + 1.5)))
    image = ax.imshow(scores, origin="lower", aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    for target_layer, layers in enumerate(selection.source_layers):
        ax.scatter(layers, [target_layer] * len(layers), marker="s", s=12, facecolors="none", edgecolors="red")
    ax.set_xlabel("source layer")
    ax.set_ylabel("target layer")
    ax.set_title(f"probe R$^2$ (K/V mean, {selection.probe}), top_k={selection.top_k}")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return True


def plot_training_curves(config, path) -> bool:
    """Learning curves of an MLP mapper: validation MSE per epoch relative to the ridge on the same split, one line
    per target layer, keys and values side by side (read from `config.calibration["mlp_training"]`).

    Epoch 0 is the ridge itself (1.0 with `init="ridge"`); a line below 1 is an MLP that beats the ridge, and the dot
    marks the epoch whose weights were kept. Returns `False` without writing anything when matplotlib is not installed
    or the config holds no MLP training record with a validation split.
    """
    training = (config.calibration or {}).get("mlp_training")
    if not training or not training.get("layers"):
        return False
    plt = pyplot("the MLP training curves")
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    drawn = False
    for ax, part in zip(axes, ("key", "value")):
        for entry in training["layers"]:
            row = entry[part]
            ridge = row.get("ridge_val_mse")
            history = [v for v in row.get("val_mse_history", []) if v is not None]
            if not ridge or not history:
                continue
            curve = [1.0] + [value / ridge for value in history]
            (line,) = ax.plot(range(len(curve)), curve, label=f"layer {entry['layer']}", linewidth=1.2)
            best = row.get("best_epoch", 0)
            if best < len(curve):
                ax.plot([best], [curve[best]], "o", color=line.get_color(), markersize=4)
            drawn = True
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{part}s")
        ax.set_xlabel("epoch (0 = ridge)")
    if not drawn:
        plt.close(fig)
        return False
    axes[0].set_ylabel("validation MSE / ridge's")
    axes[1].legend(fontsize="small", ncol=2)
    fig.suptitle(f"MLP mapper training (hidden {training.get('hidden_size')}, dot = weights kept)")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return True


def plot_diagnostics(diagnostics: dict, path) -> bool:
    """Heat maps (layer x head) of key R^2, value R^2 and attention cosine (`hf_kvmap.diagnostics.diagnose`)."""
    plt = pyplot("the diagnostics heat maps")
    if plt is None:
        return False
    keys = ("key_r2", "value_r2", "attention_cosine")
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key in zip(axes, keys):
        data = [layer[key] for layer in diagnostics["layers"]]
        image = ax.imshow(data, aspect="auto", vmin=min(0.0, min(map(min, data))), vmax=1.0, cmap="viridis")
        ax.set_title(key.replace("_", " "))
        ax.set_xlabel("head")
        ax.set_ylabel("target layer")
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    return True


def _plot_long(ax, long: dict, colors: dict) -> None:
    """The demo's long rows: each way's first token per length and task (filled where it pays)."""
    from .payoff import pays

    for task, style in zip(long, ("-", "--", ":", "-.")):
        rows = long[task]
        for way in ("target", "mapped", "repaired", "guarded"):
            tokens = [row["tokens"] for row in rows]
            ax.plot(
                tokens, [row["ways"][way]["ttft_ms"] for row in rows], style, color=colors[way], label=f"{task}: {way}"
            )
            paying = [row for row in rows if way != "target" and pays(row, way)]
            ax.plot([r["tokens"] for r in paying], [r["ways"][way]["ttft_ms"] for r in paying], "o", color=colors[way])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms to the first token (median)")
    ax.set_title("long prompts (dots: pays, at the target's accuracy)")
    ax.legend(fontsize="x-small", ncol=2)


def plot_demo(results: dict, path: Path) -> bool:
    """An `hf-kvmap demo` results dict: the long rows' time to the first token per length and way (where the demo
    measured them), accuracy per task and way (chance dotted), time to first token per task and way, and the latency
    curves per context length."""
    plt = pyplot("the demo plot")
    if plt is None:
        return False
    serving = results.get("serving") or {}
    tasks = list(results["tasks"])
    long = (results.get("long") or {}).get("tasks") or {}
    fig, axes = plt.subplots(1, 3 + bool(long), figsize=(16 + 5 * bool(long), 4.2))
    ax_acc, ax_ttft, ax_lat = axes[-3:]
    ways = ("source", "target", "mapped", "repaired", "guarded")
    colors = {way: f"C{k}" for k, way in enumerate(ways)}  # one colour per way in every panel
    if long:
        _plot_long(axes[0], long, colors)
    width = 0.8 / len(ways)
    for k, way in enumerate(ways):
        values = [
            results["tasks"][t][way]
            if way in ("source", "target", "mapped")
            else serving.get(t, {}).get(way, {}).get("accuracy", 0.0)
            for t in tasks
        ]
        offset = (k - (len(ways) - 1) / 2) * width
        ax_acc.bar([i + offset for i in range(len(tasks))], values, width, label=way, color=colors[way])
    for i, task in enumerate(tasks):
        ax_acc.hlines(results["tasks"][task]["chance"], i - 0.4, i + 0.4, colors="k", linestyles=":")
    ax_acc.set_xticks(range(len(tasks)), tasks)
    ax_acc.set_ylabel("accuracy")
    ax_acc.set_ylim(0, 1)
    run = results["run"]
    ax_acc.set_title(f"{run['source']} -> {run['target']}: accuracy (dotted: chance)")
    ax_acc.legend(fontsize="small")
    served = list(serving)
    if served:
        names = ("target", "mapped", "repaired", "guarded")
        width = 0.8 / len(names)
        for k, way in enumerate(names):
            offset = (k - (len(names) - 1) / 2) * width
            ax_ttft.bar(
                [i + offset for i in range(len(served))],
                [serving[t][way]["ttft_ms"] for t in served],
                width,
                label=way,
                color=colors[way],
            )
        ax_ttft.set_xticks(range(len(served)), served)
        ax_ttft.set_ylabel("ms (median over requests)")
        ax_ttft.set_title("time to first token (source prefill done)")
        ax_ttft.legend(fontsize="small")
    if results.get("latency"):
        tokens = [row["tokens"] for row in results["latency"]]
        for key, label, style, color in (
            ("mapper_ms", "mapper (from_source)", "o-", "C7"),
            ("prefill_ms", "target re-prefill (body)", "s-", "C8"),
            ("ttft_target_ms", "first token: target alone", "d--", colors["target"]),
            ("ttft_mapped_ms", "first token: mapped", "^--", colors["mapped"]),
            ("ttft_repaired_ms", "first token: repaired", "v--", colors["repaired"]),
        ):
            if key in results["latency"][0]:
                ax_lat.plot(tokens, [row[key] for row in results["latency"]], style, label=label, color=color)
        ax_lat.set_xscale("log")
        ax_lat.set_yscale("log")
        ax_lat.set_xlabel("context tokens")
        ax_lat.set_ylabel("ms (median, warmed up)")
        ax_lat.set_title("latency")
        ax_lat.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=110)
    return True


__all__ = ["plot_demo", "plot_diagnostics", "plot_selection", "plot_training_curves", "pyplot"]
