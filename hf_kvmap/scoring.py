"""The one scoring contract of the repair strategies and the probes, as kvpress's `ScorerPress`: the subclass scores,
the base decides.

A [`Scorer`] sets `name` (its registry key), takes its options as keyword arguments (`settings()` gives them back),
says whether it reads the source model (`needs_source`) and implements `score(context)`: higher means more in need
of the target. What is scored, and what the base decides from it, is the subclass family's:

- a repair strategy (`hf_kvmap.repair.Strategy`) scores every cached position, `(batch, length)`, its importance to
  recompute; its base selects the top-k of each row's budget (`Strategy.select`);
- a probe (`hf_kvmap.serving.probes.Probe`) scores every row, `(batch,)`, its risk that the mapped cache changes the
  answer; its base checks the risks (`Probe.risks`) and the serving pipeline holds them against the threshold or the
  ladder's rungs.

Both registries are built by one function, [`from_settings`].
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch


class Scorer:
    r"""
    Base class of everything that scores a request for the target: the repair strategies and the probes.

    Subclasses set `name`, `needs_source` where `score` runs the source model, and implement `score`; `settings`
    returns what [`from_settings`] rebuilds them from (the name and every option).
    """

    name: ClassVar[str] = ""
    #: whether `score` reads the source model and its cache
    needs_source: ClassVar[bool] = False
    #: what one entry is called in messages ("repair strategy", "probe")
    kind: ClassVar[str] = "scorer"

    def settings(self) -> dict[str, Any]:
        """What [`from_settings`] needs to rebuild this scorer (its name and options)."""
        return {"name": self.name}

    def score(self, context) -> torch.Tensor:
        """The scores of `context`; higher means more in need of the target. The shape is the family's."""
        raise NotImplementedError

    def checked_scores(self, context, shape: tuple[int, ...], meaning: str) -> torch.Tensor:
        """`score(context)`, refused unless it has `shape` (`meaning` names it in the error)."""
        scores = self.score(context)
        if tuple(scores.shape) != tuple(shape):
            raise ValueError(
                f"{self.kind[0].upper()}{self.kind[1:]} {self.name!r} returned scores of shape "
                f"{tuple(scores.shape)}; expected {meaning} = {tuple(shape)}."
            )
        return scores

    def __repr__(self) -> str:
        options = ", ".join(f"{key}={value!r}" for key, value in self.settings().items() if key != "name")
        return f"{type(self).__name__}({options})"


def from_settings(
    registry: dict[str, type[Scorer]], settings: dict[str, Any], base: type[Scorer], plural: str
) -> Scorer:
    """The registered scorer `settings["name"]` of `registry` built with the other settings as its options; an
    unknown name or option raises, naming what is registered or what the class takes. `base` is the family's base
    class (its `kind` names an entry in messages), `plural` what the entries are called together."""
    kind = base.kind
    if not isinstance(settings, dict):
        example = {"name": sorted(registry)[0]} if registry else {"name": "..."}
        raise TypeError(
            f"A {kind} is a name, a settings dict or a {base.__name__}; got a {type(settings).__name__} "
            f"({settings!r}). Pass e.g. {example!r}."
        )
    settings = dict(settings)
    name = settings.pop("name", None)
    if name not in registry:
        raise ValueError(f"Unknown {kind} {name!r}; registered {plural}: {', '.join(sorted(registry))}.")
    try:
        return registry[name](**settings)
    except TypeError as err:
        options = [key for key in inspect.signature(registry[name].__init__).parameters if key not in ("self",)]
        options = [key for key in options if key not in ("args", "kwargs")]
        raise TypeError(
            f"{kind[0].upper()}{kind[1:]} {name!r} does not take these options ({err}); its options are {options}."
        ) from None


__all__ = ["Scorer", "from_settings"]
