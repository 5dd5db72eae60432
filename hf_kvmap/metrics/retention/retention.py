"""Retention of task accuracy when a target model reads a mapped cache instead of its own.

Raw retention = mapped / target. Floor-normalized retention = (mapped - chance) / (target - chance).
Generation tasks (chance 0 and scored by exact match, e.g. GSM8K) are reported on their own and kept out of the
averages, because averages hide their collapse.

Retention is measurable only where the target alone beats chance: with the item count of each task, a one-sided
exact binomial test of the target's successes against chance at the 5 % level (for a task with chance 0, the null
is one lucky success among the items, `1 / n`). Elsewhere both retentions are NaN (`null` in JSON, "not
measurable" in tables and cards) and the task is left out of the averages.
"""

import math

import datasets
import evaluate

_DESCRIPTION = __doc__

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[float]`): accuracy of the handoff (source prefill -> mapped cache -> target), one per task.
    references (`list[float]`): accuracy of the target alone on the same tasks.
    chance (`list[float]`, *optional*): chance accuracy per task (defaults to 0).
    task_names (`list[str]`, *optional*): names of the tasks (defaults to task_0, task_1, ...).
    generation_tasks (`list[str]`, *optional*): names of the generation tasks, reported apart from the averages.
    n_items (`list[int]`, *optional*): items per task; with them, retention is NaN wherever the target does not beat
        chance (`target_beats_chance`).
Returns:
    retention (`float`): mean raw retention over the non-generation tasks (nan if there are none).
    floor_normalized_retention (`float`): mean floor-normalized retention over the non-generation tasks.
    per_task (`dict`): `{name: {"retention": r, "floor_normalized_retention": f}}` for every task, plus
        `retention_measurable` and `target_vs_chance_p` (the test's p-value) when `n_items` is given.
    generation (`dict`): the same for the generation tasks alone.
Examples:
    >>> metric = Retention()
    >>> metric.compute(predictions=[0.5, 0.45], references=[0.75, 0.9], chance=[0.25, 0.0],
    ...                task_names=["choice", "gsm"], generation_tasks=["gsm"])["floor_normalized_retention"]
    0.5
"""


#: Significance level of the test that the target beats chance.
ALPHA = 0.05


def binomial_tail(successes: int, trials: int, p: float) -> float:
    """`P(X >= successes)` for `X ~ Binomial(trials, p)`, exact (summed in log space)."""
    if successes <= 0:
        return 1.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    terms = [
        math.lgamma(trials + 1) - math.lgamma(k + 1) - math.lgamma(trials - k + 1) + k * math.log(p)
        + (trials - k) * math.log1p(-p)
        for k in range(successes, trials + 1)
    ]  # fmt: skip
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def target_beats_chance(target: float, n_items: int | None, chance: float, alpha: float = ALPHA):
    """`(beats, p_value)`: whether the target's accuracy over `n_items` items beats `chance` by a one-sided exact
    binomial test at level `alpha` (null: `max(chance, 1 / n_items)`). `(False, None)` without an item count."""
    if not n_items or target is None or (isinstance(target, float) and math.isnan(target)):
        return False, None
    successes = round(target * n_items)
    p_value = binomial_tail(successes, int(n_items), max(chance or 0.0, 1.0 / n_items))
    return p_value < alpha, p_value


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def _mean(values):
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Retention(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Heo et al., Cross-Model KV Cache Transfer in LLM Families (2026)",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("float64")}
            ),
        )

    def _compute(self, predictions, references, chance=None, task_names=None, generation_tasks=None, n_items=None):
        n = len(predictions)
        chance = [0.0] * n if chance is None else list(chance)
        task_names = [f"task_{i}" for i in range(n)] if task_names is None else list(task_names)
        if len(chance) != n or len(task_names) != n:
            raise ValueError(
                f"chance has {len(chance)} and task_names {len(task_names)} entries; expected one per task ({n})."
            )
        generation = set(generation_tasks or ())
        unknown = generation - set(task_names)
        if unknown:
            raise ValueError(f"generation_tasks {sorted(unknown)} are not among task_names {task_names}.")
        if n_items is not None and len(n_items) != n:
            raise ValueError(f"n_items has {len(n_items)} entries; expected one per task ({n}).")
        per_task = {}
        for index, (name, mapped, target, floor) in enumerate(zip(task_names, predictions, references, chance)):
            row = {
                "retention": _ratio(mapped, target),
                "floor_normalized_retention": _ratio(mapped - floor, target - floor),
            }
            if n_items is not None:
                beats, p_value = target_beats_chance(target, n_items[index], floor)
                row.update(retention_measurable=beats, target_vs_chance_p=p_value)
                if not beats:
                    row.update(retention=float("nan"), floor_normalized_retention=float("nan"))
            per_task[name] = row
        others = [per_task[name] for name in task_names if name not in generation]
        return {
            "retention": _mean([row["retention"] for row in others]),
            "floor_normalized_retention": _mean([row["floor_normalized_retention"] for row in others]),
            "per_task": per_task,
            "generation": {name: per_task[name] for name in task_names if name in generation},
        }
