"""Three-way evaluation of a handoff: source alone, target alone, and source prefill -> mapped cache -> target.

Every way runs the same code path: a *builder* model prefills the context, the cache is cut before the final
`hold_back` tokens (or mapped by the mapper, which holds them back), and a *reader* model runs the held-back tokens
and scores or generates. Only who builds, who reads and whether a mapper sits between them changes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ._compat import cache_kwargs, output_cache
from .repair import RepairConfig
from .reporting import jsonl_objects
from .rope import positions_from_attention_mask
from .serving.pipeline import map_and_repair

MODES = ("source", "target", "mapped")
TASK_TYPES = ("exact_match", "choice", "perplexity")


@dataclass
class HandoffEvaluation:
    """The three-way evaluation harness of a (source, target, mapper) triple and the tokenizer they share.

    Args:
        source, target (`PreTrainedModel`): causal LMs of one family.
        mapper ([`MapperModel`], *optional*): maps the source cache into the target's; `mapped` mode needs it.
        tokenizer: the shared tokenizer.
        hold_back (`int`, defaults to 1): final context tokens the reader runs itself.
        target_first_layer (`bool`, defaults to `False`): in `mapped` mode the target computes its first layer from
            the token ids instead of reading it mapped (`MappedCache.from_source(..., first_layer="target")`).
        repair ([`~hf_kvmap.repair.RepairConfig`], *optional*): in `mapped` mode the target then recomputes the
            positions it selects ([`~hf_kvmap.repair.repair_cache`]).
    """

    source: torch.nn.Module
    target: torch.nn.Module
    mapper: torch.nn.Module | None
    tokenizer: object
    hold_back: int = 1
    target_first_layer: bool = False
    repair: RepairConfig | None = None

    def __post_init__(self):
        if self.repair is not None:
            self.repair = RepairConfig.from_dict(self.repair)  # converted once; bad settings raise here

    def mapped_cache(self, cache, ids: torch.Tensor, mask: torch.Tensor | None = None, **kwargs):
        """`MappedCache.from_source` of the source's `cache` of `ids`, as this handoff maps (hold-back, first layer,
        repair)."""
        mapped, _ = map_and_repair(
            self.source,
            self.target,
            self.mapper,
            ids,
            cache,
            attention_mask=mask,
            hold_back=self.hold_back,
            target_first_layer=self.target_first_layer,
            repair=self.repair,
            **kwargs,
        )
        return mapped

    def _models(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}.")
        if mode == "mapped" and self.mapper is None:
            raise ValueError("mode='mapped' needs a mapper.")
        builder = self.target if mode == "target" else self.source
        reader = self.source if mode == "source" else self.target
        return builder, reader

    @torch.no_grad()
    def prefill(self, model, ids: torch.Tensor, mask: torch.Tensor | None = None):
        """The builder's cache of `ids`: a generate-style prefill (with a `mask`, every row from position 0).

        A subclass may take it from elsewhere (a store of earlier prefills) by overriding this method alone, so the
        positions the cache was built at and the positions the mapping strips stay one decision
        ([`position_ids`]).
        """
        kwargs = {} if mask is None else {"attention_mask": mask, "position_ids": self.position_ids(ids, mask)}
        return output_cache(model(input_ids=ids, use_cache=True, **kwargs))

    @staticmethod
    def position_ids(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The positions [`prefill`] builds each row at: from the mask (left padding), or `None` (0..T-1)."""
        return None if mask is None else positions_from_attention_mask(mask, *ids.shape, ids.device)

    @torch.no_grad()
    def context_cache(self, mode: str, ids: torch.Tensor, mask: torch.Tensor | None = None):
        """`(reader, cache)`: the cache of `ids` minus its last `hold_back` tokens, as `mode` builds it."""
        builder, reader = self._models(mode)
        cache = self.prefill(builder, ids, mask)
        if mode == "mapped":
            cache = self.mapped_cache(cache, ids, mask, source_position_ids=self.position_ids(ids, mask))
        else:
            cache.crop(-self.hold_back)
        return reader, cache

    def _encode(self, texts: Sequence[str], special: bool = True) -> list[list[int]]:
        return [self.tokenizer(text, add_special_tokens=special)["input_ids"] for text in texts]

    @torch.no_grad()
    def exact_match(
        self,
        mode: str,
        prompts: Sequence[str],
        answers: Sequence[str],
        stop: str | Sequence[str] = "",
        batch_size: int = 16,
        progress: str | None = None,
    ) -> list[bool]:
        """Greedy `generate` from each prompt (left-padded batches); correct iff it produces `answer + stop`
        (`stop`: one string for every item, or one per item). `progress`: a bar's description (items done), or none."""
        stops = [stop] * len(prompts) if isinstance(stop, str) else list(stop)
        if len(stops) != len(prompts):
            raise ValueError(f"{len(stops)} stops for {len(prompts)} prompts: give one stop, or one per prompt.")
        pad = self.tokenizer.pad_token_id
        results = []
        bar = tqdm(total=len(prompts), desc=progress, unit="item", disable=progress is None, leave=False)
        for start in range(0, len(prompts), batch_size):
            chunk = self._encode(prompts[start : start + batch_size])
            pairs = zip(answers[start : start + batch_size], stops[start : start + batch_size])
            expected = self._encode([answer + end for answer, end in pairs], special=False)
            width = max(map(len, chunk))
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, seq in enumerate(chunk):
                ids[row, width - len(seq) :] = torch.tensor(seq)
                mask[row, width - len(seq) :] = 1
            reader, cache = self.context_cache(mode, ids, mask)
            new = max(map(len, expected))
            out = reader.generate(
                ids,
                attention_mask=mask,
                **cache_kwargs(cache),
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=None,
            )[:, width:]
            results.extend(out[row, : len(exp)].tolist() == exp for row, exp in enumerate(expected))
            bar.update(len(chunk))
        bar.close()
        return results

    @torch.no_grad()
    def choice_logprobs(self, mode: str, context: str, choices: Sequence[str]) -> list[float]:
        """Sum of log-probabilities of each continuation after `context` (context prefilled once)."""
        ctx = torch.tensor([self._encode([context])[0]])
        conts = self._encode(choices, special=False)
        reader, cache = self.context_cache(mode, ctx)
        cache.batch_repeat_interleave(len(conts))
        held = ctx[0, -self.hold_back :].tolist()
        width = self.hold_back + max(map(len, conts))
        ids = torch.full((len(conts), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(conts), cache.get_seq_length() + width, dtype=torch.long)
        mask[:, : cache.get_seq_length()] = 1
        for row, cont in enumerate(conts):
            seq = held + cont
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, cache.get_seq_length() : cache.get_seq_length() + len(seq)] = 1
        logits = reader(input_ids=ids, attention_mask=mask, **cache_kwargs(cache)).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        scores = []
        for row, cont in enumerate(conts):
            positions = torch.arange(self.hold_back - 1, self.hold_back - 1 + len(cont))
            scores.append(logprobs[row, positions, torch.tensor(cont)].sum().item())
        return scores

    @torch.no_grad()
    def continuation_nll(self, mode: str, text: str, prefix_fraction: float = 0.5) -> tuple[float, int]:
        """Perplexity protocol: the prefix's cache comes from `mode`; the reader scores the rest. `(nll_sum, n)`."""
        ids = torch.tensor([self._encode([text])[0]])
        split = max(self.hold_back + 1, int(ids.shape[1] * prefix_fraction))
        reader, cache = self.context_cache(mode, ids[:, :split])
        rest = ids[:, split - self.hold_back :]
        logits = reader(input_ids=rest, **cache_kwargs(cache)).logits.float()
        logprobs = torch.log_softmax(logits[:, self.hold_back - 1 : -1], dim=-1)
        scored = rest[:, self.hold_back :]
        return -logprobs.gather(-1, scored.unsqueeze(-1)).sum().item(), scored.numel()


def _accuracy(flags: Sequence[bool]) -> float:
    return sum(map(bool, flags)) / max(len(flags), 1)


def evaluate_items(
    handoff: HandoffEvaluation, task_type: str, items: Sequence, mode: str, progress: str | None = None, **kwargs
) -> float:
    """Score `items` of one task type under `mode`.

    `task_type`: `"exact_match"` (items with `.prompt` or `.context`, `.answer`, optional `.stop`, which takes
    precedence over a `stop=` given for the whole task),
    `"choice"` (`.context`, `.choices`, `.label`) -> accuracy; `"perplexity"` (`.text`) -> perplexity.
    `progress`: the description of a bar over the items (none by default).
    """
    if task_type == "exact_match":
        prompts = [getattr(item, "prompt", "") or item.context for item in items]
        default = kwargs.get("stop", "")
        stops = [getattr(item, "stop", None) or default for item in items]  # an item's own stop comes first
        answers = [item.answer for item in items]
        return _accuracy(handoff.exact_match(mode, prompts, answers, stop=stops, progress=progress))
    if task_type not in TASK_TYPES:
        raise ValueError(f"task_type={task_type!r}; expected one of {TASK_TYPES}.")
    items = tqdm(items, desc=progress, unit="item", disable=progress is None, leave=False)
    if task_type == "choice":
        hits = []
        for item in items:
            scores = handoff.choice_logprobs(mode, item.context, item.choices)
            hits.append(max(range(len(scores)), key=scores.__getitem__) == item.label)
        return _accuracy(hits)
    if task_type == "perplexity":
        total, count = 0.0, 0
        for item in items:
            nll, n = handoff.continuation_nll(mode, item.text)
            total, count = total + nll, count + n
        return math.exp(total / count)


@dataclass
class TaskSpec:
    """One evaluation task: its items, how they are scored (`task_type`, one of `TASK_TYPES`), the chance level, and
    the stop string for generation."""

    name: str
    task_type: str
    items: Sequence
    chance: float = 0.0
    stop: str = ""


@dataclass(frozen=True)
class JsonlItem:
    """One item of a user task file (fields as in the JSONL format of `load_jsonl_tasks`)."""

    prompt: str = ""
    context: str = ""
    answer: str = ""
    choices: tuple = ()
    label: int = -1
    text: str = ""
    stop: str = ""


def _item_problems(row, task_type: str) -> list[str]:
    """What is wrong with one task line (empty when nothing is)."""
    problems = []
    required = {
        "exact_match": ("prompt", "answer"),
        "choice": ("context", "choices", "label"),
        "perplexity": ("text",),
    }
    missing = [field for field in required[task_type] if field not in row]
    if missing:
        return [f"a {task_type} item needs {missing}"]
    for field in ("prompt", "context", "answer", "text", "stop"):
        if field in row and not isinstance(row[field], str):
            problems.append(f"{field} must be a string, got {type(row[field]).__name__}")
    if problems:
        return problems
    if task_type == "exact_match":
        problems += [f"{field} is empty" for field in ("prompt", "answer") if not row[field]]
    elif task_type == "perplexity" and len(row["text"]) < 2:
        problems.append(f"text needs at least 2 characters to score a continuation, got {len(row['text'])}")
    elif task_type == "choice":
        choices, label = row["choices"], row["label"]
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            problems.append("choices must be a list of strings (at least 2, none empty)")
        elif isinstance(label, bool) or not isinstance(label, int):
            problems.append(f"label must be an integer, got {label!r}")
        elif not 0 <= label < len(choices):
            problems.append(f"label {label} is out of range for {len(choices)} choices")
    if "chance" in row and (isinstance(row["chance"], bool) or not isinstance(row["chance"], (int, float))):
        problems.append(f"chance must be a number, got {row['chance']!r}")
    elif "chance" in row and not 0.0 <= row["chance"] <= 1.0:  # NaN included
        problems.append(
            f"chance={row['chance']!r} must be between 0 and 1 (the score of guessing; 1 / choices by default)"
        )
    return problems


def load_jsonl_tasks(path) -> list[TaskSpec]:
    """Tasks from a JSONL file, one item per line; items of one `task` name form one task.

    Line formats (`type` defaults to `exact_match`):

    - `{"task": "qa", "type": "exact_match", "prompt": "...", "answer": "...", "stop": "\\n"}`
    - `{"task": "mc", "type": "choice", "context": "...", "choices": ["...", "..."], "label": 0, "chance": 0.5}`
      (`chance` defaults to 1 / number of choices)
    - `{"task": "ppl", "type": "perplexity", "text": "..."}`

    Every malformed line is reported (`path:line: what is wrong`, all of them in one `ValueError`) before any item
    is used.
    """
    tasks: dict[str, TaskSpec] = {}
    errors: list[str] = []
    for number, row in jsonl_objects(path, errors):
        name, task_type = row.get("task"), row.get("type", "exact_match")
        if not name or not isinstance(name, str):
            errors.append(f"{path}:{number}: every line needs a `task` name.")
            continue
        if task_type not in TASK_TYPES:
            errors.append(f"{path}:{number}: type={task_type!r}; expected one of {TASK_TYPES}.")
            continue
        problems = _item_problems(row, task_type)
        if name in tasks and tasks[name].task_type != task_type:
            problems.append(f"task {name!r} mixes types {tasks[name].task_type} and {task_type}")
        if problems:
            errors.extend(f"{path}:{number}: {problem}." for problem in problems)
            continue
        item = JsonlItem(
            prompt=row.get("prompt", ""),
            context=row.get("context", ""),
            answer=row.get("answer", ""),
            choices=tuple(row.get("choices", ())),
            label=int(row.get("label", -1)),
            text=row.get("text", ""),
            stop=row.get("stop", ""),
        )
        if name not in tasks:
            chance = row.get("chance", 1 / len(item.choices) if task_type == "choice" else 0.0)
            tasks[name] = TaskSpec(name, task_type, [], chance=float(chance))  # each item keeps its own stop
        tasks[name].items.append(item)
    if errors:
        raise ValueError(f"{path}: {len(errors)} malformed line(s):\n" + "\n".join(errors))
    if not tasks:
        raise ValueError(f"{path} holds no task items.")
    return list(tasks.values())


def evaluate_tasks(handoff: HandoffEvaluation, tasks: Sequence[TaskSpec], progress: bool = True) -> dict:
    """Run every task three ways; return `{"tasks": ..., "summary": ..., "perplexity": ...}`.

    Retention comes from the package's `evaluate` module (`hf_kvmap.metrics`): per task raw and floor-normalized,
    averaged over the non-generation tasks, with the generation tasks (exact match, chance 0) reported apart; it is
    NaN (`null` in JSON) with `retention_measurable: false` wherever the target does not beat chance over the task's
    items.
    """
    results: dict = {"tasks": {}, "perplexity": {}}
    bar = tqdm(total=len(tasks) * len(MODES), desc="evaluating", disable=not progress)
    for task in tasks:
        scores = {}
        for mode in MODES:
            kwargs = {"stop": task.stop} if task.task_type == "exact_match" else {}
            scores[mode] = evaluate_items(handoff, task.task_type, task.items, mode, **kwargs)
            bar.update(1)
        if task.task_type == "perplexity":
            results["perplexity"][task.name] = {**scores, "n_items": len(task.items)}
        else:
            results["tasks"][task.name] = {
                **scores,
                "chance": task.chance,
                "n_items": len(task.items),
                "task_type": task.task_type,
            }
    bar.close()
    return summarize_retention(results)


def summarize_retention(results: dict) -> dict:
    """Add each task's retention (raw and floor-normalized, "not measurable" where the target does not beat chance
    over `n_items`) and the summary over the tasks to a three-way `results` dict, in place; returns it.

    Args:
        results (`dict`): `{"tasks": {name: {"source", "target", "mapped", "chance", "n_items", "task_type"}}, ...}`.
    """
    from .metrics import load_retention

    scored = results["tasks"]
    if scored:
        names = list(scored)
        metric = load_retention().compute(
            predictions=[scored[n]["mapped"] for n in names],
            references=[scored[n]["target"] for n in names],
            chance=[scored[n]["chance"] for n in names],
            task_names=names,
            n_items=[scored[n]["n_items"] for n in names],
            generation_tasks=[
                n for n in names if scored[n]["task_type"] == "exact_match" and scored[n]["chance"] == 0
            ],
        )
        for name in names:
            scored[name].update(metric["per_task"][name])
        results["summary"] = {
            "retention": metric["retention"],
            "floor_normalized_retention": metric["floor_normalized_retention"],
            "generation_tasks": sorted(metric["generation"]),
        }
    return results


def _timed(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


@torch.no_grad()
def measure_latency(
    handoff: HandoffEvaluation, lengths: Sequence[int], repeats: int = 5, warmup: int = 1, first_token: bool = False
) -> list[dict]:
    """Median wall time of the handoff's mapping (`HandoffEvaluation.mapped_cache`: `MappedCache.from_source`) vs the target's
    body re-prefilling the same tokens.

    The two are timed interleaved in one run (same machine state); the body excludes the LM head. With
    `first_token=True` the whole handoff to the first token is timed beside them: mapping, the target reading its
    held-back tokens over the mapped cache and its next-token logits (`first_token_handoff_ms`), against the target
    prefilling the whole prompt to the same logits (`first_token_prefill_ms`).
    """
    rows = []
    vocab = handoff.target.config.vocab_size
    body = handoff.target.get_decoder()

    def handoff_first_token(ids, source_cache):
        cache = handoff.mapped_cache(source_cache, ids)
        handoff.target(input_ids=ids[:, -handoff.hold_back :], logits_to_keep=1, **cache_kwargs(cache))

    for length in lengths:
        ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(length))
        source_cache = output_cache(handoff.source(input_ids=ids, use_cache=True))
        prefix = ids[:, : length - handoff.hold_back]
        times: dict[str, list[float]] = {}
        for trial in range(warmup + repeats):
            timed = {
                "mapper_ms": _timed(handoff.mapped_cache, source_cache, ids),
                "prefill_ms": _timed(body, input_ids=prefix, use_cache=True),
            }
            if first_token:
                timed["first_token_handoff_ms"] = _timed(handoff_first_token, ids, source_cache)
                timed["first_token_prefill_ms"] = _timed(handoff.target, input_ids=ids, logits_to_keep=1)
            if trial >= warmup:
                for name, seconds in timed.items():
                    times.setdefault(name, []).append(1000 * seconds)
        row = {"tokens": length, **{name: sorted(values)[repeats // 2] for name, values in times.items()}}
        row["speedup"] = row["prefill_ms"] / row["mapper_ms"]
        if first_token:
            row["first_token_speedup"] = row["first_token_prefill_ms"] / row["first_token_handoff_ms"]
        rows.append(row)
    return rows
