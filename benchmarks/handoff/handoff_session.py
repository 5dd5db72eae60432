"""Multi-turn drift: one conversation answered by two models in turn (`HandoffSession`), against each model's own
prefill of the same transcript.

For each pair, `--conversations` chat conversations of the tiny family (`corpus.make_conversation`, `--exchanges`
user turns each, so `--exchanges - 1` switches), the models alternate turn by turn (conversation `i` starts with model
`i % 2`). At every turn the answering model syncs its cache (the tokens the other model processed since its last turn
are mapped, the new user turn it prefills itself) and answers greedily. The reference is the same model after its own
prefill of the same transcript: the benchmark reports, per switch index, how often the session's answer equals the
reference's, the KL divergence of the first answer token (reference || session), and the task accuracy of both on the
turns whose answer the conversation fixes (recalls of facts, arithmetic, "ok" acknowledgements, story questions). A
direction without a mapper prefills the other model's tokens instead (no mapping, no drift).

    OMP_NUM_THREADS=1 python -m benchmarks.handoff.handoff_session

Writes `benchmarks/results/handoff_session.json`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from hf_kvmap import HandoffSession, MapperModel, cache_kwargs, zoo
from hf_kvmap.reporting import environment_info, write_json
from hf_kvmap.serving.pipeline import target_prefill
from hf_kvmap.zoo import corpus, mapper_path

REPO = Path(__file__).resolve().parents[2]
PAIRS = (("tiny-s", "tiny-l"), ("tiny-m", "tiny-l"), ("tiny-x", "tiny-l"))


def load_mappers(pair: tuple[str, str]) -> dict:
    mappers = {}
    for source, target in (pair, pair[::-1]):
        if (zoo.MAPPERS_DIR / f"{source}-to-{target}" / "config.json").exists():  # mapper_path raises when absent
            mappers[(source, target)] = MapperModel.from_pretrained(str(mapper_path(source, target))).eval()
    return mappers


@torch.no_grad()
def reference(model, ids: torch.Tensor, steps: int, end: int) -> tuple[list[int], torch.Tensor, float]:
    start = time.perf_counter()
    cache = target_prefill(model, ids)
    prefill_s = time.perf_counter() - start
    out = model.generate(
        ids,
        **cache_kwargs(cache),
        max_new_tokens=steps,
        do_sample=False,
        eos_token_id=end,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    return out.sequences[0, ids.shape[1] :].tolist(), out.scores[0][0].float(), prefill_s


def run_pair(pair, args, tokenizer) -> dict:
    from tqdm.auto import tqdm

    models = {name: zoo.load_model(name) for name in pair}
    mappers = load_mappers(pair)
    end = tokenizer.convert_tokens_to_ids(corpus.END)
    per_switch: dict[int, dict[str, list]] = {}
    switches = []
    for conv in tqdm(range(args.conversations), desc="-".join(pair), leave=False):
        turns = corpus.make_conversation(args.exchanges, seed=args.seed + conv)
        session = HandoffSession(models, mappers)
        for exchange in range(args.exchanges):
            (_, user), (_, gold) = turns[2 * exchange], turns[2 * exchange + 1]
            text = corpus.format_chat([("user", user)], add_generation_prompt=True)
            session.append(tokenizer(text, add_special_tokens=exchange == 0)["input_ids"])
            name = pair[(exchange + conv) % 2]
            before = session.input_ids.clone()
            turn = session.respond(name, args.max_new_tokens, eos_token_id=end, pad_token_id=0)
            ref_tokens, ref_logits, prefill_s = reference(models[name], before, args.max_new_tokens, end)
            gold_ids = tokenizer(gold + corpus.END, add_special_tokens=False)["input_ids"]
            logp_ref = ref_logits.log_softmax(-1)
            logp_session = turn.first_logits.log_softmax(-1)
            row = per_switch.setdefault(exchange, {"same": [], "kl": [], "session_ok": [], "own_ok": []})
            row["same"].append(turn.tokens == ref_tokens)
            row["kl"].append(float((logp_ref.exp() * (logp_ref - logp_session)).sum()))
            row["session_ok"].append(turn.tokens == gold_ids)
            row["own_ok"].append(ref_tokens == gold_ids)
            if exchange:
                switches.append(
                    {
                        "direction": f"{turn.mapped_from or pair[(exchange + conv + 1) % 2]}-to-{name}",
                        "mapped": turn.mapped_from is not None,
                        "mapped_tokens": turn.mapped_tokens,
                        "window_tokens": turn.window_tokens,
                        "prefilled_tokens": turn.prefilled_tokens,
                        "transcript_tokens": before.shape[1],
                        "sync_ms": 1000 * (turn.timings.get("map", 0.0) + turn.timings.get("prefill", 0.0)),
                        "own_prefill_ms": 1000 * prefill_s,
                        "same": turn.tokens == ref_tokens,
                    }
                )
    summary = {
        str(exchange): {
            "turns": len(row["same"]),
            "same_as_own_prefill": sum(row["same"]) / len(row["same"]),
            "first_token_kl_mean": sum(row["kl"]) / len(row["kl"]),
            "session_accuracy": sum(row["session_ok"]) / len(row["session_ok"]),
            "own_prefill_accuracy": sum(row["own_ok"]) / len(row["own_ok"]),
        }
        for exchange, row in sorted(per_switch.items())
    }
    by_direction = {}
    for record in switches:
        entry = by_direction.setdefault(
            record["direction"],
            {"mapped": record["mapped"], "switches": 0, "same": 0, "mapped_tokens": 0, "prefilled_tokens": 0},
        )
        entry["switches"] += 1
        entry["same"] += record["same"]
        entry["mapped_tokens"] += record["mapped_tokens"]
        entry["prefilled_tokens"] += record["prefilled_tokens"]
        entry.setdefault("sync_ms", []).append(record["sync_ms"])
        entry.setdefault("own_prefill_ms", []).append(record["own_prefill_ms"])
    for entry in by_direction.values():
        entry["same_as_own_prefill"] = entry.pop("same") / entry["switches"]
        entry["mean_sync_ms"] = sum(entry["sync_ms"]) / len(entry.pop("sync_ms"))
        entry["mean_own_prefill_ms"] = sum(entry["own_prefill_ms"]) / len(entry.pop("own_prefill_ms"))
    return {
        "models": list(pair),
        "mappers": [f"{s}-to-{t}" for s, t in mappers],
        "per_exchange": summary,
        "per_direction": by_direction,
        "all_turns": {
            "same_as_own_prefill": sum(sum(r["same"]) for r in per_switch.values())
            / sum(len(r["same"]) for r in per_switch.values()),
        },
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--exchanges", type=int, default=8, help="user turns per conversation (switches + 1)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=500)
    parser.add_argument("--pairs", default=",".join("+".join(p) for p in PAIRS))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "handoff_session.json"))
    args = parser.parse_args(argv)
    if args.exchanges < 5:
        raise SystemExit("--exchanges must be at least 5 (4 switches)")
    torch.set_num_threads(1)
    tokenizer = zoo.load_tokenizer()
    pairs = [tuple(p.split("+")) for p in args.pairs.split(",")]
    result = {
        "run": {
            "command": "python -m benchmarks.handoff.handoff_session "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "conversations": args.conversations,
            "exchanges": args.exchanges,
            "switches_per_conversation": args.exchanges - 1,
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
        },
        "pairs": {},
        "environment": environment_info(),
    }
    for pair in pairs:
        result["pairs"]["+".join(pair)] = run_pair(pair, args, tokenizer)
        write_json(args.out, result)
        print(pair, result["pairs"]["+".join(pair)]["per_direction"], flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
