"""Fit, evaluate and save the mappers shipped with the tiny family (`hf_kvmap/zoo/mappers/<src>-to-<tgt>/`).

Each mapper is fitted by the library's own one-pass closed-form ridge on calibration text from the family's corpus
(its own seed stream), evaluated three ways on the tiny-family task set, diagnosed on held-out text, and saved with
`save_pretrained(..., evaluation=results)` so its card carries the results. The rendered cards are copied to
`model_cards/`.

    python examples/fit_tiny_family_mappers.py                      # every shipped direction
    python examples/fit_tiny_family_mappers.py --pairs tiny-s:tiny-l
    python examples/fit_tiny_family_mappers.py --kind mlp --hidden-size 128 --out-root /tmp/mlp-mappers --no-cards
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from hf_kvmap import fit_mapper, flops, zoo
from hf_kvmap.artifacts import content_hash
from hf_kvmap.commands.fit import parse_layer_window
from hf_kvmap.configuration_mapper import OBJECTIVES
from hf_kvmap.diagnostics import diagnose
from hf_kvmap.evaluation import HandoffEvaluation, evaluate_tasks
from hf_kvmap.fit_options import ATTENTION_LOSSES, ATTENTION_SPACES
from hf_kvmap.reporting import environment_info
from hf_kvmap.zoo import corpus

DEFAULT_PAIRS = ("tiny-s:tiny-l", "tiny-l:tiny-s", "tiny-m:tiny-l", "tiny-x:tiny-l")
REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="*", default=list(DEFAULT_PAIRS), help="source:target pairs")
    parser.add_argument("--top-k", type=int, default=None, help="source layers per target layer (default: all)")
    parser.add_argument("--ridge-lambda", type=float, default=0.01)
    parser.add_argument("--kind", choices=("ridge", "mlp"), default="ridge", help="mapper kind (default: ridge)")
    parser.add_argument("--context-window", type=int, default=0, help="earlier positions each map reads")
    parser.add_argument("--input-kinds", choices=("same", "both"), default="same", help="what each map reads")
    parser.add_argument(
        "--layer-window",
        action="append",
        default=[],
        metavar="LAYER:PART=W[:both]",
        help="a context window for one map only (repeatable), e.g. 3:key=3:both",
    )
    parser.add_argument("--key-norm", action="store_true", help="normalise predicted keys with the target's key norm")
    parser.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="mse",
        help="kl: end-to-end fine-tune after the fit; attention: per-layer attention-output fine-tune; attention+kl",
    )
    parser.add_argument("--kl-steps", type=int, default=400, help="most KL fine-tune steps (default: 400)")
    parser.add_argument("--kl-lr", type=float, default=3e-4, help="KL fine-tune learning rate (default: 3e-4)")
    parser.add_argument("--attn-steps", type=int, default=400, help="most attention fine-tune steps (default: 400)")
    parser.add_argument(
        "--attn-lr", type=float, default=1e-3, help="attention fine-tune learning rate (default: 1e-3)"
    )
    parser.add_argument("--attn-patience", type=int, default=6, help="attention fine-tune patience (evaluations)")
    parser.add_argument("--attn-loss", choices=ATTENTION_LOSSES, default="output", help="attention loss (output)")
    parser.add_argument("--attn-space", choices=ATTENTION_SPACES, default="residual", help="attention space")
    parser.add_argument(
        "--kl-docs", type=int, default=256, help="fine-tune sequences (zoo.context_batches; default: 256)"
    )
    parser.add_argument("--kl-length", type=int, default=320, help="tokens per fine-tune sequence (default: 320)")
    parser.add_argument("--stride", type=int, default=1, help="keep every stride-th calibration position")
    parser.add_argument("--hidden-size", type=int, default=128, help="MLP hidden size (default: 128)")
    parser.add_argument("--epochs", type=int, default=20, help="MLP epochs (default: 20)")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="MLP positions per Adam step (default: 4096)")
    parser.add_argument(
        "--save-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype the mapper is evaluated and saved in (bfloat16 halves the shipped size)",
    )
    parser.add_argument("--out-root", type=Path, default=zoo.MAPPERS_DIR, help="where the mapper folders go")
    parser.add_argument("--no-cards", dest="cards", action="store_false", help="do not copy cards to model_cards/")
    parser.add_argument("--docs", type=int, default=256, help="calibration sequences")
    parser.add_argument("--length", type=int, default=512, help="tokens per calibration sequence")
    parser.add_argument("--items", type=int, default=200, help="evaluation items per task")
    parser.add_argument("--seed", type=int, default=1234, help="evaluation seed")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    tokenizer = zoo.load_tokenizer(padding_side="left")
    batches = zoo.calibration_batches(tokenizer, args.docs, args.length, batch_size=16)
    layer_inputs: dict = {}
    for spec in args.layer_window:
        layer, part, entry = parse_layer_window(spec)
        layer_inputs.setdefault(layer, {})[part] = entry
    objective_options = {}
    if args.objective != "mse":
        objective_options = {
            "objective": args.objective,
            "kl_steps": args.kl_steps,
            "kl_lr": args.kl_lr,
            "kl_cache_references": True,  # a few MB for the tiny family
            "attn_steps": args.attn_steps,
            "attn_lr": args.attn_lr,
            "attn_patience": args.attn_patience,
            "attn_loss": args.attn_loss,
            "attn_space": args.attn_space,
            "attn_cache_references": True,
            "kl_calibration": zoo.context_batches(tokenizer, args.kl_docs, args.kl_length, batch_size=16),
        }
    for pair in args.pairs:
        source_name, target_name = pair.split(":")
        started = time.perf_counter()
        source, target = zoo.load_model(source_name), zoo.load_model(target_name)
        mlp_options = (
            {"hidden_size": args.hidden_size, "epochs": args.epochs, "batch_tokens": args.batch_tokens}
            if args.kind == "mlp"
            else {}
        )
        mapper = fit_mapper(
            source,
            target,
            batches,
            kind=args.kind,
            context_window=args.context_window,
            input_kinds=args.input_kinds,
            layer_inputs=layer_inputs or None,
            key_norm=args.key_norm,
            stride=args.stride,
            top_k=args.top_k,
            ridge_lambda=args.ridge_lambda,
            tokenizer=tokenizer,
            **mlp_options,
            **objective_options,
        )
        fit_seconds = time.perf_counter() - started
        mapper = mapper.to(getattr(torch, args.save_dtype))  # evaluate exactly what is saved
        handoff = HandoffEvaluation(source=source, target=target, mapper=mapper, tokenizer=tokenizer)
        results = evaluate_tasks(handoff, zoo.tiny_family_tasks(args.items, args.seed))
        held_out = corpus.make_eval_set("text", 16, seed=args.seed + 1, n_chars=256)
        diagnostics = diagnose(
            source, target, mapper, [torch.tensor([tokenizer(item.text)["input_ids"]]) for item in held_out]
        )
        results["diagnostics"] = diagnostics
        results["diagnostics_summary"] = diagnostics["summary"]
        results["run"] = {
            "source": source_name,
            "target": target_name,
            "task_set": "tiny-family",
            "items_per_task": args.items,
            "seed": args.seed,
            "fit_seconds": fit_seconds,
            "parameters": flops.mapper_parameters(mapper.config),
            "kind": args.kind,
            "dtype": args.save_dtype,
            "mapper_content_hash": content_hash(mapper.state_dict(), mapper.config),
            "layer_inputs": layer_inputs or None,
            "key_norm": args.key_norm,
            "objective": args.objective,
        }
        results["environment"] = environment_info()
        out = args.out_root / f"{source_name}-to-{target_name}"
        mapper.save_pretrained(out, evaluation=results)
        if args.cards:
            card_dir = REPO / "model_cards"
            card_dir.mkdir(exist_ok=True)
            shutil.copy(out / "README.md", card_dir / f"{out.name}.md")
        summary = ", ".join(f"{name} {row['retention']:.2f}" for name, row in results["tasks"].items())
        print(
            f"{pair}: fitted in {fit_seconds:.1f}s, retention {summary}, "
            f"attention cosine {diagnostics['summary']['mean_attention_cosine']:.3f} -> {out}"
        )


if __name__ == "__main__":
    main()
