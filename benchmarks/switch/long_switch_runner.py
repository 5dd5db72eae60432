"""The models, the mapper and the settings a `benchmarks.switch.long_switch` run serves every arm of an item with
(`Runner.measure`), and each arm's score (`score`)."""

from __future__ import annotations

import time

import torch

from hf_kvmap.input_checks import eos_token_ids
from lab.real.context_tasks import CONTEXT_TASKS

from ..decoding import continue_batch, first_token, follow_ups, greedy, rounded, text_nll
from ..sealed.protocol import SPARSE
from .long_switch_args import parse_rung

MODELS = {"0.5b": "qwen2.5-coder-0.5b-instruct", "1.5b": "qwen2.5-coder-1.5b-instruct"}
MAX_NEW = {"long_chat": 12, "long_doc": 12, "humaneval": 320, "continuation": 128}
MAX_NEW.update({name: task.max_new for name, task in CONTEXT_TASKS.items()})  # lab.real.context_tasks


def score(item: dict, text: str, tokens: list[int], reference: list[int] | None) -> dict:
    """An arm's score on one item (the rules: "Scores" in `benchmarks.switch.long_switch`'s docstring)."""
    if item["task"] in ("long_chat", "long_doc"):
        return {"score": float(text.strip() == item["answer"])}
    if item["task"] in CONTEXT_TASKS:  # the family's own rule, on the item's fields (`meta` flattened into it)
        from lab.real.context_tasks import score as context_score
        from lab.real.long_tasks import LongItem

        return {"score": context_score(LongItem(item["task"], "", item["answer"], item), text)}
    if item["task"] == "humaneval":
        from lab.real.humaneval import passes, truncate_completion

        return {"score": float(passes(item["problem"], truncate_completion(text)))}
    agree = sum(a == b for a, b in zip(tokens, reference or tokens)) / len(reference or tokens)
    return {"score": agree}


def target_tokenizer(args):
    """The tokenizer of `--direction`'s target (no model is loaded)."""
    from transformers import AutoTokenizer

    from hf_kvmap.real.obtain import obtained_path

    return AutoTokenizer.from_pretrained(obtained_path(MODELS[args.direction.split(":")[1]], args.cache_dir))


class Runner:
    """The models, the mapper and the settings one run serves every arm with (`tokenizer`: the target's, where the
    caller loaded it already)."""

    def __init__(self, args, tokenizer=None):
        from transformers import AutoModelForCausalLM

        from hf_kvmap import MapperModel
        from hf_kvmap.real.obtain import obtained_path

        dtype = getattr(torch, args.dtype)
        source_name, target_name = (MODELS[side] for side in args.direction.split(":"))
        self.tokenizer = tokenizer if tokenizer is not None else target_tokenizer(args)
        self.source = AutoModelForCausalLM.from_pretrained(obtained_path(source_name, args.cache_dir), dtype=dtype)
        self.target = AutoModelForCausalLM.from_pretrained(obtained_path(target_name, args.cache_dir), dtype=dtype)
        self.source.eval(), self.target.eval()
        self.mapper = MapperModel.from_pretrained(args.mapper, dtype=dtype)
        self.batch = not args.no_batch
        self.eos = {self.tokenizer.convert_tokens_to_ids("<|im_end|>"), self.tokenizer.eos_token_id}
        self.eos |= set(eos_token_ids(self.target))

    def _stop(self, task: str):
        if task != "humaneval" and not (task in CONTEXT_TASKS and CONTEXT_TASKS[task].code):
            return lambda tokens: False
        from lab.real.humaneval import STOP_SEQUENCES

        return lambda tokens: any(s in self.tokenizer.decode(tokens) for s in STOP_SEQUENCES)

    @torch.no_grad()
    def measure(self, item: dict, arms: list[str], rungs: dict, done: dict) -> dict:
        """Every arm of `arms` not in `done` on one item; returns `{arm: record}`."""
        from hf_kvmap import MappedCache, output_cache
        from hf_kvmap.repair import DecodeRefresh, RepairConfig, repair_cache, select_repair, sparse_prefill

        ids = torch.tensor([item["ids"]])
        last = ids[:, -1:]
        max_new, stop = MAX_NEW[item["task"]], self._stop(item["task"])
        reference = done.get("target", {}).get("tokens")
        out: dict[str, dict] = {}

        def record_of(model, cache, tokens, prepare, first) -> dict:
            text = self.tokenizer.decode([t for t in tokens if t not in self.eos])
            record = {"tokens": tokens, "text": text, "prepare_s": prepare, "ttft_s": prepare + first}
            if item["task"] == "continuation":
                record["nll"] = text_nll(model, cache, last, item["continuation_ids"])
            return record

        def finish(arm: str, model, cache, prepare: float, refresh=None) -> None:
            """Decode `arm` alone (the source, a refreshing rung, or every arm with `batch=False`)."""
            step = None
            if refresh is not None:  # called as generate calls a logits processor
                step = lambda tokens: refresh(torch.tensor([item["ids"] + tokens]), None)  # noqa: E731
            margins: list[float] = []
            tokens, first, rest = greedy(model, cache, last, max_new, stop, self.eos, step, margins)
            out[arm], kept[arm] = record_of(model, cache, tokens, prepare, first), (model, cache)
            out[arm]["answer_s"] = prepare + first + rest  # the whole answer, a refresh's recomputes included
            out[arm]["margins"] = rounded(margins)
            if refresh is not None:
                info = cache.mapping_info["refresh"]
                out[arm]["refresh"] = {
                    k: info[k] for k in ("refreshes", "recomputed", "recomputed_fraction", "seconds")
                }

        batched: list[tuple] = []  # (arm, cache, prepare, first token, its seconds, margins): decoded together below
        kept: dict[str, tuple] = {}  # arm -> (model, its served cache of the prompt): what follow-ups are asked on

        def start(arm: str, cache, prepare: float, refresh=None) -> None:
            if refresh is not None or not self.batch:
                finish(arm, self.target, cache, prepare, refresh)
            else:
                margins: list[float] = []
                token, seconds = first_token(self.target, cache, last, margins)
                batched.append((arm, cache, prepare, token, seconds, margins))

        if "target" in arms and "target" not in done:
            began = time.perf_counter()
            cache = output_cache(self.target(input_ids=ids[:, :-1], use_cache=True))
            start("target", cache, time.perf_counter() - began)
        mapped_arms = [a for a in arms if a not in done and a not in ("source", "target")]
        source_cache = None
        if mapped_arms or ("source" in arms and "source" not in done):
            source_cache = output_cache(self.source(input_ids=ids, use_cache=True))  # paid before a switch
            selections: dict[str, tuple] = {}  # repair label -> (its selection, the seconds it took)

            def selection_of(label: str):
                """The positions rung `label` recomputes, selected once for it and its sparse peer (timed)."""
                if label not in selections:
                    _, settings, fraction, _ = rungs.get(label) or parse_rung(label)
                    began = time.perf_counter()
                    chosen = select_repair(
                        self.target,
                        ids,
                        RepairConfig(settings, fraction=fraction),
                        length=ids.shape[1] - 1,
                        source=self.source,
                        source_cache=source_cache,
                    )
                    selections[label] = (chosen, time.perf_counter() - began)
                return selections[label]

            for arm in mapped_arms:
                refresh_settings = None
                if arm.startswith(SPARSE):
                    (positions, _), select_s = selection_of(arm[len(SPARSE) :])
                    began = time.perf_counter()
                    cache = sparse_prefill(self.target, ids, positions[0], length=ids.shape[1] - 1)
                    finish(arm, self.target, cache, select_s + time.perf_counter() - began)  # a layout of its own
                    out[arm]["selected"] = int(positions.shape[1])
                    continue
                began = time.perf_counter()
                if arm == "mapped":
                    cache = MappedCache.from_source(source_cache, self.mapper)
                    prepare = time.perf_counter() - began
                else:
                    _, settings, fraction, refresh_settings = rungs[arm]
                    if settings is None:  # mapped+refresh
                        cache = MappedCache.from_source(source_cache, self.mapper)
                        prepare = time.perf_counter() - began
                    else:
                        selection, select_s = selection_of(arm)
                        began = time.perf_counter()
                        cache = MappedCache.from_source(
                            source_cache,
                            self.mapper,
                            first_layer="target",
                            target_model=self.target,
                            input_ids=ids,
                            source_model=self.source,
                        )
                        repair_cache(
                            self.target, cache, ids, RepairConfig(settings, fraction=fraction), selection=selection
                        )
                        prepare = select_s + time.perf_counter() - began
                refresh = None if refresh_settings is None else DecodeRefresh(self.target, cache, **refresh_settings)
                start(arm, cache, prepare, refresh)
        if batched:
            caches = [entry[1] for entry in batched]
            margins = [e[5] for e in batched]
            decoded, seconds = continue_batch(
                self.target, caches, [e[3] for e in batched], max_new, stop, self.eos, margins
            )
            for i in range(len(batched)):
                arm, cache, prepare, _, first, _ = batched[i]
                cache.crop(-last.shape[1])  # back to the prompt's cache, for the NLL
                out[arm], kept[arm] = record_of(self.target, cache, decoded[i], prepare, first), (self.target, cache)
                out[arm]["margins"] = rounded(margins[i])
                out[arm]["decoded_with"] = len(batched)  # rows of the batch that decoded it (its seconds shared)
                out[arm]["batch_s"] = seconds
        if source_cache is not None and "source" in arms and "source" not in done:
            source_cache.crop(-1)
            finish("source", self.source, source_cache, 0.0)
        reference = out["target"]["tokens"] if "target" in out else reference  # continuations agree with it
        for arm, record in out.items():
            record.update(score(item, record["text"], record["tokens"], reference if arm != "target" else None))
        if reference and item["task"] != "continuation":  # the 1.5B's own answer read through each arm's cache
            for arm, (model, cache) in kept.items():  # (nats a token): finer than right or wrong, for choosing maps
                if arm != "source":  # the 0.5B reads with other weights: its NLL is not comparable
                    out[arm]["answer_nll"] = text_nll(model, cache, last, reference)
        if len(item.get("questions", [])) > 1:  # the next questions, asked on the cache each arm served
            for arm, (model, cache) in kept.items():
                replies = follow_ups(model, self.tokenizer, cache, last, item["questions"], max_new, stop, self.eos)
                for reply, question in zip(replies, item["questions"][1:]):
                    reply.update(score({**item, "answer": question["answer"]}, reply["text"], reply["tokens"], None))
                out[arm]["followups"] = replies
        return {arm: out[arm] for arm in arms if arm in out}
