"""Retention of task accuracy when a target model reads a mapped cache instead of its own.

Raw retention = mapped / target. Floor-normalized retention = (mapped - chance) / (target - chance).
Generation tasks (chance 0 and scored by exact match, e.g. GSM8K) are reported on their own and kept out of the
averages, because averages hide their collapse.
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
Returns:
    retention (`float`): mean raw retention over the non-generation tasks (nan if there are none).
    floor_normalized_retention (`float`): mean floor-normalized retention over the non-generation tasks.
    per_task (`dict`): `{name: {"retention": r, "floor_normalized_retention": f}}` for every task.
    generation (`dict`): the same for the generation tasks alone.
Examples:
    >>> metric = Retention()
    >>> metric.compute(predictions=[0.5, 0.45], references=[0.75, 0.9], chance=[0.25, 0.0],
    ...                task_names=["choice", "gsm"], generation_tasks=["gsm"])["floor_normalized_retention"]
    0.5
"""


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

    def _compute(self, predictions, references, chance=None, task_names=None, generation_tasks=None):
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
        per_task = {
            name: {
                "retention": _ratio(mapped, target),
                "floor_normalized_retention": _ratio(mapped - floor, target - floor),
            }
            for name, mapped, target, floor in zip(task_names, predictions, references, chance)
        }
        others = [per_task[name] for name in task_names if name not in generation]
        return {
            "retention": _mean([row["retention"] for row in others]),
            "floor_normalized_retention": _mean([row["floor_normalized_retention"] for row in others]),
            "per_task": per_task,
            "generation": {name: per_task[name] for name in task_names if name in generation},
        }
