"""Train the tiny family (seeded, resumable, CPU).

Checkpoints (model + AdamW state, safetensors only, plus a JSON with the step) go under
``runs/zoo/<name>/``; re-running the same command resumes from the last checkpoint and, because batch
``s`` is always documents ``s*B .. s*B+B-1`` of the seeded stream, reproduces the uninterrupted run.
Final weights, the learning curve (``training_log.jsonl`` + ``learning_curve.png``) and the final
evaluation (``eval.json``) go into ``hf_kvmap/zoo/family/<name>/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from hf_kvmap.zoo import FAMILY_DIR, corpus
from hf_kvmap.zoo.family import FAMILY, make_config
from hf_kvmap.zoo.tokenizer import build_tokenizer, save_tokenizer

from .tasks import eval_sets, evaluate_model

#: default schedule per member: steps, peak lr, batch size (sized for ~100 min on one CPU core in total)
DEFAULTS = {
    "tiny-l": dict(steps=800, lr=2e-3, batch=16),
    "tiny-x": dict(steps=1200, lr=3e-3, batch=16),
    "tiny-m": dict(steps=800, lr=3e-3, batch=16),
    "tiny-s": dict(steps=800, lr=3e-3, batch=16),
}


def _lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


#: warm-up phase (the first ``warm_frac`` of the steps): short windows of copy-heavy text. Attention at
#: initialisation spreads over the whole window, so the gradient towards "attend to the earlier copy" is
#: ~window-length times stronger in short windows; induction heads (needed for every in-context task)
#: form there far sooner than in 256-token windows at the same number of tokens.
WARM_MIXTURE = {"copy": 0.4, "recall": 0.35, "choice": 0.1, "arithmetic": 0.05, "text": 0.05, "chat": 0.05}


def _batch(tok, step: int, batch: int, seq_len: int, seed: int, mixture=None):
    docs = corpus.training_documents(batch, seed=seed, n_chars=seq_len, start=step * batch, mixture=mixture)
    seqs = [tok(d)["input_ids"][: seq_len + 1] for d in docs]
    n = max(len(s) for s in seqs)
    ids = torch.full((batch, n), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((batch, n), -100, dtype=torch.long)
    mask = torch.zeros((batch, n), dtype=torch.long)
    for i, s in enumerate(seqs):
        t = torch.tensor(s)
        ids[i, : len(s)] = t
        labels[i, : len(s)] = t
        mask[i, : len(s)] = 1
    return ids, mask, labels


def _save_ckpt(ckdir: Path, model, opt, step: int, elapsed: float, recipe: dict | None = None) -> None:
    from safetensors.torch import save_file

    ckdir.mkdir(parents=True, exist_ok=True)
    # named_parameters() lists a tied weight once (lm_head shares embed_tokens)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(ckdir / "model.tmp"))
    names = {id(p): n for n, p in model.named_parameters()}
    ost = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                n = names[id(p)]
                ost[f"{n}::exp_avg"] = st["exp_avg"].contiguous()
                ost[f"{n}::exp_avg_sq"] = st["exp_avg_sq"].contiguous()
                ost[f"{n}::step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1)
    save_file(ost, str(ckdir / "optim.tmp"))
    os.replace(ckdir / "model.tmp", ckdir / "model.safetensors")
    os.replace(ckdir / "optim.tmp", ckdir / "optim.safetensors")
    (ckdir / "state.json").write_text(json.dumps({"step": step, "elapsed_s": elapsed, "recipe": recipe}))


def _load_ckpt(ckdir: Path, model, opt, recipe: dict | None = None) -> tuple[int, float]:
    from safetensors.torch import load_file

    if not (ckdir / "state.json").exists():
        return 0, 0.0
    state = json.loads((ckdir / "state.json").read_text())
    if recipe is not None and state.get("recipe") not in (None, recipe):
        raise ValueError(
            f"checkpoint in {ckdir} was written by a different recipe ({state['recipe']}) than this run "
            f"({recipe}); resuming would mix two schedules. Delete or move {ckdir}, or pass matching arguments."
        )
    model.load_state_dict(load_file(str(ckdir / "model.safetensors")), strict=False)
    ost = load_file(str(ckdir / "optim.safetensors"))
    for n, p in model.named_parameters():
        if f"{n}::exp_avg" in ost:
            opt.state[p] = {
                "step": ost[f"{n}::step"].reshape(()),
                "exp_avg": ost[f"{n}::exp_avg"],
                "exp_avg_sq": ost[f"{n}::exp_avg_sq"],
            }
    return int(state["step"]), float(state["elapsed_s"])


def plot_curve(log_path: Path, png_path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [json.loads(x) for x in log_path.read_text().splitlines() if x.strip()]
    tr = [r for r in rows if "loss" in r]
    ev = [r for r in rows if "recall" in r]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    a1.plot([r["step"] for r in tr], [r["loss"] for r in tr])
    a1.set_xlabel("step")
    a1.set_ylabel("train loss (nats/char)")
    a1.set_yscale("log")
    a1.grid(alpha=0.3)
    for k in ("recall", "arithmetic", "choice", "chat"):
        a2.plot([r["step"] for r in ev], [r[k] for r in ev], marker=".", label=k)
    a2.axhline(0.25, color="gray", ls=":", lw=1, label="choice chance")
    a2.set_xlabel("step")
    a2.set_ylabel("eval accuracy")
    a2.set_ylim(-0.02, 1.02)
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=80)
    plt.close(fig)
    return True


def train_member(
    name: str,
    steps: int,
    lr: float,
    batch: int,
    seq_len: int = 256,
    warmup: int = 60,
    seed: int = 0,
    eval_every: int = 100,
    ckpt_every: int = 100,
    n_eval: int = 48,
    runs_dir: Path = Path("runs/zoo"),
    family_dir: Path = FAMILY_DIR,
    weight_decay: float = 0.05,
    force: bool = False,
    warm_frac: float = 0.5,
    warm_seq_len: int = 64,
    warm_batch: int = 64,
    mid_frac: float = 0.2,
) -> dict:
    """Train one member. Three phases with the same number of tokens per step: ``warm_frac`` of the steps
    in ``warm_seq_len`` windows on :data:`WARM_MIXTURE`, then ``mid_frac`` in ``2 * warm_seq_len``
    windows, then ``seq_len`` windows, both on the full :data:`corpus.MIXTURE`."""
    out_dir = family_dir / name
    if (out_dir / "eval.json").exists() and not force:
        print(f"[{name}] already trained ({out_dir}); skipping (use --force to retrain)", flush=True)
        return json.loads((out_dir / "eval.json").read_text())
    from transformers import GenerationConfig, Qwen3ForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(seed)
    cfg = make_config(name)
    model = Qwen3ForCausalLM(cfg)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    ckdir = runs_dir / name
    log_path = ckdir / "log.jsonl"
    recipe = {
        "steps": steps,
        "lr": lr,
        "batch": batch,
        "seq_len": seq_len,
        "warmup": warmup,
        "seed": seed,
        "warm_frac": warm_frac,
        "warm_seq_len": warm_seq_len,
        "warm_batch": warm_batch,
        "mid_frac": mid_frac,
        "weight_decay": weight_decay,
    }
    start, elapsed = _load_ckpt(ckdir, model, opt, recipe)
    if start:
        print(f"[{name}] resumed at step {start} ({elapsed:.0f}s so far)", flush=True)
        # drop log rows past the checkpoint (a crash after the last checkpoint)
        if log_path.exists():
            rows = [x for x in log_path.read_text().splitlines() if x.strip() and json.loads(x)["step"] <= start]
            log_path.write_text("".join(r + "\n" for r in rows))
    elif log_path.exists():
        log_path.unlink()
    ckdir.mkdir(parents=True, exist_ok=True)
    sets = eval_sets(n_eval, seed=1234)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{name}] {n_params:,} params, {steps} steps x {batch} x {seq_len}, lr {lr}", flush=True)

    def log(row):
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    t0 = time.time() - elapsed
    run_loss, run_n = 0.0, 0
    for step in range(start, steps):
        cur = _lr_at(step, steps, lr, warmup)
        for g in opt.param_groups:
            g["lr"] = cur
        if step < warm_frac * steps:
            ids, mask, labels = _batch(tok, step, warm_batch, warm_seq_len, seed, WARM_MIXTURE)
        elif step < (warm_frac + mid_frac) * steps:
            ids, mask, labels = _batch(tok, step, warm_batch // 2, warm_seq_len * 2, seed)
        else:
            ids, mask, labels = _batch(tok, step, batch, seq_len, seed)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        run_loss += float(loss.detach())
        run_n += 1
        s = step + 1
        if s % 25 == 0 or s == steps:
            log(
                {
                    "step": s,
                    "loss": round(run_loss / run_n, 4),
                    "lr": round(cur, 6),
                    "grad_norm": round(float(gn), 3),
                    "time_s": round(time.time() - t0, 1),
                }
            )
            print(f"[{name}] step {s} loss {run_loss / run_n:.4f} lr {cur:.2e} {time.time() - t0:.0f}s", flush=True)
            run_loss, run_n = 0.0, 0
        if s % eval_every == 0 or s == steps:
            ev = evaluate_model(model, tok, sets=sets)
            log({"step": s, **{k: round(v, 4) for k, v in ev.items()}, "time_s": round(time.time() - t0, 1)})
            print(f"[{name}] eval {s}: {ev}", flush=True)
        if s % ckpt_every == 0 or s == steps:
            _save_ckpt(ckdir, model, opt, s, time.time() - t0, recipe)

    wall = time.time() - t0
    # final weights: float32 when small, bfloat16 otherwise (keeps the shipped family well under 30 MB)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = torch.float32 if n_params * 4 <= 8_000_000 else torch.bfloat16
    model.eval()
    model.to(dtype)
    model.config.dtype = dtype
    end_id = tok.convert_tokens_to_ids(corpus.END)  # chat turns end with <|end|>: stop there too
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id,
        eos_token_id=[cfg.eos_token_id, end_id],
        pad_token_id=cfg.pad_token_id,
        do_sample=False,
        max_new_tokens=32,
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    (out_dir / "training_log.jsonl").write_text(log_path.read_text())
    plot_curve(
        out_dir / "training_log.jsonl",
        out_dir / "learning_curve.png",
        f"{name}: {n_params / 1e6:.2f}M params, {steps} steps",
    )
    # final evaluation of the shipped weights (reloaded in float32), on the fixed report set (seed 0)
    reloaded = Qwen3ForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    final = evaluate_model(reloaded, tok, n=200, seed=0)
    result = {
        "name": name,
        "params": n_params,
        "steps": steps,
        "batch": batch,
        "seq_len": seq_len,
        "lr": lr,
        "seed": seed,
        "warm_frac": warm_frac,
        "warm_seq_len": warm_seq_len,
        "warm_batch": warm_batch,
        "mid_frac": mid_frac,
        "train_wall_s": round(wall, 1),
        "weights_dtype": str(dtype).replace("torch.", ""),
        "eval_seed": 0,
        "eval_n": 200,
        "eval": {k: round(v, 4) for k, v in final.items()},
    }
    (out_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"[{name}] done in {wall:.0f}s: {result['eval']}", flush=True)
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", nargs="+", default=["tiny-s", "tiny-l", "tiny-x", "tiny-m"], choices=list(FAMILY))
    ap.add_argument("--steps", type=int, help="override the per-member step count")
    ap.add_argument("--lr", type=float, help="override the per-member peak learning rate")
    ap.add_argument("--batch", type=int, help="override the per-member batch size")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warm-frac", type=float, default=0.5, help="fraction of steps in the warm-up phase")
    ap.add_argument("--warm-seq-len", type=int, default=64, help="window of the warm-up phase")
    ap.add_argument("--warm-batch", type=int, default=64, help="batch size of the warm-up phase")
    ap.add_argument("--mid-frac", type=float, default=0.2, help="fraction of steps in 2x warm-seq-len windows")
    ap.add_argument("--runs-dir", default="runs/zoo")
    ap.add_argument("--family-dir", default=str(FAMILY_DIR))
    ap.add_argument("--force", action="store_true", help="retrain members that already have final weights")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    family_dir = Path(a.family_dir)
    save_tokenizer(family_dir / "tokenizer")
    for name in a.members:
        d = dict(DEFAULTS[name])
        for k in ("steps", "lr", "batch"):
            if getattr(a, k) is not None:
                d[k] = getattr(a, k)
        settings = ("seq_len", "warmup", "seed", "eval_every", "ckpt_every", "warm_frac", "warm_seq_len")
        settings += ("warm_batch", "mid_frac", "force")
        train_member(
            name, runs_dir=Path(a.runs_dir), family_dir=family_dir, **{k: getattr(a, k) for k in settings}, **d
        )


if __name__ == "__main__":
    main()
