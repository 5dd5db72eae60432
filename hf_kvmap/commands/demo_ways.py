"""The ways `hf-kvmap demo` serves one request, and how it times them to the first token.

Every way starts where a handoff starts: the source has prefilled the prompt (not timed: it has already happened).
Each way then builds the cache the target reads and runs the target to its first-token logits; that is its time to
first token. The answer is decoded greedily from there.

- `target`: the target prefills the whole prompt itself.
- `mapped`: `MappedCache.from_source` of the source's cache; the target runs the held-back final token.
- `repaired`: the same with the target's exact first layer (`first_layer="target"`), then `apply_repair` (the target
  recomputes the positions the strategy selects): `handoff(repair=)` builds this cache with `target_first_layer=True`.
- `guarded`: `hf_kvmap.handoff` with the mapper's calibrated guard (its ladder when it has one, or a ladder given to
  the demo): the mapped cache, a repair, or the target's own prefill, per request.

Only public names are used (`hf_kvmap.handoff`, `MappedCache.from_source`, `hf_kvmap.repair.apply_repair`), so the
demo shows what a user's server would run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

WAYS = ("target", "mapped", "repaired", "guarded")


def timed_medians(calls: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median milliseconds of each call over `repeats` timed runs, the calls interleaved (one machine state), after
    `warmup` untimed runs of every call (first-call costs: allocations, kernel selection, lazy initialization)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r}: at least one timed run is needed for a median.")
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in times.items()}


class DemoWays:
    """The four ways of serving a request from `source` to `target` through `mapper` (see the module docstring).

    Args:
        source, target (`PreTrainedModel`): the tiny-family members.
        mapper ([`MapperModel`]): the mapper fitted for them.
        tokenizer: their shared tokenizer.
        repair ([`RepairConfig`]): the repair of the `repaired` way.
        ladder ([`GuardLadder`], *optional*): the ladder the `guarded` way climbs; by default `handoff`'s own choice
            (the mapper's calibrated ladder, or its calibrated probe).
    """

    def __init__(self, source, target, mapper, tokenizer, repair, ladder=None):
        self.source, self.target, self.mapper, self.tokenizer, self.repair = source, target, mapper, tokenizer, repair
        self.ladder = ladder

    # ------------------------------------------------------------------ caches
    def source_cache(self, ids: torch.Tensor):
        from .._compat import output_cache

        return output_cache(self.source(input_ids=ids, use_cache=True))

    def build(self, way: str, ids: torch.Tensor, source_cache) -> tuple[object, str]:
        """`(cache of the prompt but its held-back tokens, rung served)` of `way`; `None` for the target alone."""
        from .. import MappedCache, handoff
        from ..repair import apply_repair

        if way == "target":
            return None, "target"
        if way == "mapped":
            return MappedCache.from_source(source_cache, self.mapper), "mapped"
        if way == "repaired":
            cache = MappedCache.from_source(
                source_cache,
                self.mapper,
                first_layer="target",
                target_model=self.target,
                source_model=self.source,
                input_ids=ids,
            )
            apply_repair(self.target, cache, ids, self.repair, source=self.source, source_cache=source_cache)
            return cache, "repaired"
        if way == "guarded":
            ladder = {} if self.ladder is None else {"ladder": self.ladder}
            cache, report = handoff(
                self.source,
                self.target,
                self.mapper,
                ids,
                source_cache=source_cache,
                tokenizer=self.tokenizer,
                **ladder,
            )
            if report.ladder:
                return cache, report.ladder["rows"][0]["rung"]
            return cache, "mapped" if report.accepted else "fallback"
        raise ValueError(f"way={way!r} is not one of {WAYS}.")

    @torch.no_grad()
    def first_logits(self, way: str, ids: torch.Tensor, source_cache) -> tuple[torch.Tensor, object, str]:
        """`(next-token logits, the target's cache after them, rung)`: the work timed to the first token."""
        from .._compat import cache_kwargs, output_cache

        cache, rung = self.build(way, ids, source_cache)
        if cache is None:
            out = self.target(input_ids=ids, use_cache=True, logits_to_keep=1)
            return out.logits[:, -1], output_cache(out), rung
        rest = ids[:, cache.get_seq_length() :]
        out = self.target(input_ids=rest, use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
        return out.logits[:, -1], cache, rung

    @torch.no_grad()
    def greedy(self, logits: torch.Tensor, cache, new_tokens: int) -> list[int]:
        """`new_tokens` greedy tokens from the first-token `logits`, continuing on the target's `cache`."""
        from .._compat import cache_kwargs

        tokens = [int(logits.argmax(-1))]
        while len(tokens) < new_tokens:
            step = torch.tensor([[tokens[-1]]])
            logits = self.target(input_ids=step, use_cache=True, logits_to_keep=1, **cache_kwargs(cache)).logits
            tokens.append(int(logits[:, -1].argmax(-1)))
        return tokens

    # ------------------------------------------------------------------ one request, one task
    @torch.no_grad()
    def serve(self, way: str, ids: torch.Tensor, expected: list[int], source_cache) -> dict:
        """One request by `way`: `{"correct", "ttft_ms", "rung"}` (time to first token from the source's cache)."""
        start = time.perf_counter()
        logits, cache, rung = self.first_logits(way, ids, source_cache)
        ttft = 1000 * (time.perf_counter() - start)
        return {"correct": self.greedy(logits, cache, len(expected)) == expected, "ttft_ms": ttft, "rung": rung}

    def encode(self, item, stop: str) -> tuple[torch.Tensor, list[int]]:
        """`(prompt ids (1, T), expected answer ids)` of an exact-match item (its own stop first, as in `eval`)."""
        prompt = getattr(item, "prompt", "") or item.context
        ids = torch.tensor([self.tokenizer(prompt)["input_ids"]])
        end = getattr(item, "stop", None) or stop
        return ids, self.tokenizer(item.answer + end, add_special_tokens=False)["input_ids"]

    def warm_up(self, items: Sequence, stop: str) -> None:
        """Run every way once, untimed, so that no timed request pays a first call's costs."""
        ids, expected = self.encode(items[0], stop)
        cache = self.source_cache(ids)
        for way in WAYS:
            self.serve(way, ids, expected, cache)

    def task(self, items: Sequence, stop: str, progress: Callable[[], None] | None = None) -> dict:
        """Every way on every item of one exact-match task: accuracy, median time to first token, and the share of
        requests each rung served (for `guarded`)."""
        rows: dict[str, list[dict]] = {way: [] for way in WAYS}
        for item in items:
            ids, expected = self.encode(item, stop)
            cache = self.source_cache(ids)
            for way in WAYS:  # the source's cache is only read, so every way starts from the same one
                rows[way].append(self.serve(way, ids, expected, cache))
            if progress:
                progress()
        out = {}
        for way, served in rows.items():
            counts: dict[str, int] = {}
            for row in served:
                counts[row["rung"]] = counts.get(row["rung"], 0) + 1
            out[way] = {
                "accuracy": sum(row["correct"] for row in served) / len(served),
                "ttft_ms": statistics.median(row["ttft_ms"] for row in served),
                "rungs": {rung: count / len(served) for rung, count in sorted(counts.items())},
                "n_items": len(served),
            }
        return out

    # ------------------------------------------------------------------ lengths
    def latency(self, lengths: Sequence[int], repeats: int) -> list[dict]:
        """Per context length (random tokens): the mapper alone and the target's body re-prefilling the same tokens
        (`mapper_ms`, `prefill_ms`), and the time to first token of the target alone, the mapped and the repaired
        cache. Every length is run once untimed before any is timed, then each length gets its own warm-up run."""
        vocab = self.target.config.vocab_size
        body = self.target.get_decoder()
        plans = []
        for length in lengths:
            ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(length))
            cache = self.source_cache(ids)
            plans.append((length, self._calls(ids, cache, body)))
        for _, calls in plans:  # first-call costs of every shape, before any timing
            for call in calls.values():
                call()
        rows = []
        for length, calls in plans:
            row = {"tokens": length, **timed_medians(calls, repeats)}
            row["speedup"] = row["prefill_ms"] / row["mapper_ms"]
            rows.append(row)
        return rows

    def _calls(self, ids: torch.Tensor, source_cache, body) -> dict[str, Callable[[], object]]:
        from .. import MappedCache

        def no_grad(fn):
            def call():
                with torch.no_grad():
                    return fn()

            return call

        return {
            "mapper_ms": no_grad(lambda: MappedCache.from_source(source_cache, self.mapper)),
            "prefill_ms": no_grad(lambda: body(input_ids=ids[:, :-1], use_cache=True)),
            **{
                f"ttft_{way}_ms": no_grad(lambda way=way: self.first_logits(way, ids, source_cache))
                for way in WAYS[:3]
            },
        }
