"""An lm-evaluation-harness model that serves every request through a handoff: `--model hf-kvmap`.

```bash
hf-kvmap-eval --model hf-kvmap --model_args source=tiny-m,target=tiny-l,rung=repaired:tail@0.2 \
    --tasks my_task --include_path my_tasks/
```

The target is lm-eval's own `hf` model (`HFLM`: its tokenizer handling, batching of contexts, stop sequences and
truncation); what changes is where the target's cache of each prompt comes from. Each request's prompt (a
loglikelihood request's context, a generation's context, a rolling window's context) goes through
`hf_kvmap.serving.rungs.Rung.serve` (the serving pipeline, `handoff`), and the target scores or generates the rest on
the served cache. Rungs: `target` (the target alone: exactly lm-eval's `hf` model), `mapped`,
`repaired:<strategy>@<fraction>`, `guarded` (the mapper's calibrated probe) and `ladder` (its guard ladder, or the
`ladder=` file). Every request's `HandoffReport` is kept in `handoff_reports` and, with `reports=PATH`, written to that
JSONL file as it is served (lm-eval's results keep only what a model returns).

Importing this module imports lm-eval (the `lm-eval` extra) and registers the model name `hf-kvmap`; `import hf_kvmap`
never imports it. lm-eval 0.4.13's `lm_eval` command does not load external models: run `hf-kvmap-eval` (the same
command line, with this model registered first), or call `lm_eval.simple_evaluate(model="hf-kvmap", ...)` after
importing this module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_eval_utils
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm
from transformers import AutoModelForCausalLM
from transformers.utils import logging

from ._compat import cache_kwargs
from .serving.rungs import parse_rung
from .validation import check_int

logger = logging.get_logger(__name__)


def _member_path(name: str) -> str:
    """A tiny-family member's folder for its name (`tiny-m`), any other id or path as given."""
    from . import zoo

    return str(zoo.model_path(name)) if name in zoo.FAMILY else name


def _load_source(name: str, dtype: torch.dtype, device):
    """The source model: a tiny-family member as `zoo.load_model` loads it (its id and revision stamped), any other
    id or folder with `from_pretrained`."""
    from . import zoo

    if name in zoo.FAMILY:
        model = zoo.load_model(name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    return model.to(device).eval()


def _stamp_member(model, name: str) -> None:
    """Give a tiny-family member loaded from its folder the id and revision `zoo.load_model` gives it, which its
    shipped mappers record."""
    from . import zoo
    from ._compat import set_model_revision

    if name in zoo.FAMILY:
        model.config.name_or_path = f"hf_kvmap.zoo:{name}"
        set_model_revision(model.config, zoo.weights_revision(name))


@register_model("hf-kvmap")
class HFKVMapLM(HFLM):
    r"""
    lm-eval's `hf` model on the target, with each request's prompt cache served by a handoff from the source.

    Args:
        source (`str`): the source model (a folder, a Hub id, or a tiny-family member's name such as `tiny-m`).
        target (`str`): the target model, loaded by lm-eval's `HFLM` (`pretrained=`), with every `HFLM` option
            (`dtype`, `device`, `max_length`, ...) passed on.
        mapper (`str`, *optional*): the mapper's folder or Hub id; defaults to the shipped mapper when both models are
            tiny-family members.
        rung (`str`, *optional*, defaults to `"target"`): how each request is served (`hf_kvmap.serving.rungs`):
            `target`, `mapped`, `repaired:<strategy>@<fraction>` (e.g. `repaired:draft_attention@0.2`), `guarded`,
            `ladder`.
        ladder (`str`, *optional*): a JSON file of `GuardLadder.to_dict()` for `rung=ladder` (defaults to the mapper
            config's `handoff_ladder`).
        reports (`str`, *optional*): a JSONL file written with one line per served prompt (the request's task,
            document and index, the rung and the `HandoffReport`); the lines are also kept in `handoff_reports`.
        rolling_context (`int`, *optional*, defaults to 1): context tokens of each `loglikelihood_rolling` window
            after the first (lm-eval's windows: 1, which a handoff cannot serve). With `N >= 2`, each later window's
            `N` preceding tokens are handed off and its tokens scored on the served cache.
        same_weights (`bool`, *optional*, defaults to `False`): the models are the weights the mapper was fitted for,
            loaded from another location (`handoff(same_weights=True)`: the gate does not compare model ids).
        tokenizer (`str`, *optional*): defaults to the family's tokenizer for a tiny-family target, else the target's.

    Requests are served one at a time (a `HandoffReport` per request); `batch_size` is not used.

    Example:

    ```python
    >>> import lm_eval, hf_kvmap.lm_eval_model  # doctest: +SKIP
    >>> lm_eval.simple_evaluate(model="hf-kvmap", model_args="source=tiny-m,target=tiny-l,rung=mapped",
    ...                         tasks=["my_task"])  # doctest: +SKIP
    ```
    """

    def __init__(
        self,
        source: str,
        target: str,
        mapper: str | None = None,
        rung: str = "target",
        ladder: str | None = None,
        reports: str | None = None,
        rolling_context: int = 1,
        same_weights: bool = False,
        tokenizer: str | None = None,
        **kwargs,
    ) -> None:
        from . import zoo
        from .modeling_mapper import MapperModel

        if "pretrained" in kwargs:
            raise TypeError("hf-kvmap takes `target=` (the model lm-eval evaluates) instead of `pretrained=`.")
        check_int("rolling_context", rolling_context, 1)
        self.rung = parse_rung(str(rung), ladder=ladder)
        if mapper is None and not self.rung.is_target:
            if source not in zoo.FAMILY or target not in zoo.FAMILY:
                raise ValueError(
                    f"rung={rung!r} needs `mapper=` (a mapper folder or Hub id for {source} -> {target}); only "
                    "tiny-family pairs have a default (the shipped mapper)."
                )
            mapper = str(zoo.mapper_path(source, target))
        if tokenizer is None and target in zoo.FAMILY:
            tokenizer = str(zoo.tokenizer_path())
        # lm-eval's `hf` defaults to device="cuda" even on a machine without one
        kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        # a tiny-family target in float32, as `zoo.load_model` loads it (lm-eval's "auto": the checkpoint's dtype)
        if target in zoo.FAMILY:
            kwargs.setdefault("dtype", "float32")
        super().__init__(pretrained=_member_path(target), tokenizer=tokenizer, **kwargs)
        self.rolling_context = rolling_context
        self.source_model = self.mapper = None
        self.same_weights = bool(same_weights)
        if not self.rung.is_target:
            _stamp_member(self.model, target)
            self.source_model = _load_source(source, self.model.dtype, self.device)
            self.mapper = MapperModel.from_pretrained(mapper).to(self.device)
        self.handoff_reports: list[dict[str, Any]] = []
        self._reports_path = Path(reports) if reports else None
        if self._reports_path is not None:
            self._reports_path.parent.mkdir(parents=True, exist_ok=True)
            self._reports_path.write_text("", encoding="utf-8")
        self._instance = None

    # ------------------------------------------------------------------------------------------------ the handoff

    def serve_prompt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """The served cache of a `(batch, T)` prompt's first `T - 1` tokens (`None`: the target prefills it itself),
        its report recorded for the request being served."""
        cache, report = self.rung.serve(
            self.source_model,
            self.model,
            self.mapper,
            input_ids,
            attention_mask,
            tokenizer=self.tokenizer,
            same_weights=self.same_weights,
        )
        self._record(report, prompt_tokens=int(input_ids.shape[1]))
        return cache

    def _record(self, report: dict[str, Any], **extra) -> None:
        instance = self._instance
        line = {
            "task": getattr(instance, "task_name", None),
            "doc_id": getattr(instance, "doc_id", None),
            "idx": getattr(instance, "idx", None),
            "request_type": getattr(instance, "request_type", None),
            **extra,
            **report,
        }
        self.handoff_reports.append(line)
        if self._reports_path is not None:
            with self._reports_path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(line, default=str) + "\n")

    def _one_at_a_time(self, method, requests, disable_tqdm: bool, what: str) -> list:
        results = []
        for instance in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc=f"hf-kvmap {what}"):
            self._instance = instance
            try:
                results += method([instance], disable_tqdm=True)
            finally:
                self._instance = None
        return results

    # ------------------------------------------------------------------------------------------------ lm-eval's API

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._one_at_a_time(super().loglikelihood, requests, disable_tqdm, "loglikelihood")

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return self._one_at_a_time(super().generate_until, requests, disable_tqdm, "generate_until")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Per string: the sum of the log-likelihoods of its tokens over lm-eval's rolling windows (each window's
        context `rolling_context` tokens; the first window's is the prefix token alone)."""
        totals = []
        for instance in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="hf-kvmap loglikelihood_rolling"):
            self._instance = instance
            (string,) = instance.args
            windows = lm_eval_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=self.rolling_context,
            )
            pairs = [(None, *lm_eval_utils.make_disjoint_window(window)) for window in windows]
            total = sum(logprob for logprob, _ in self._loglikelihood_tokens(pairs, disable_tqdm=True))
            self._instance = None
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return totals

    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, override_bs=None
    ) -> list[tuple[float, bool]]:
        """`(log-likelihood, is greedy)` of each continuation, as `HFLM` computes them (the same window, truncated
        from the left to `max_length + 1` tokens, and the same log-softmax), one request at a time: the context part of
        the window is the prompt a handoff serves, and the target runs the rest on the served cache."""
        results = []
        for request_str, context, continuation in requests:
            window = (context + continuation)[-(self.max_length + 1) :][:-1]
            inputs = torch.tensor([window], dtype=torch.long, device=self.device)
            prompt = len(window) - len(continuation) + 1  # the context tokens in the window: the last predicts cont[0]
            cache = self.serve_prompt(inputs[:, :prompt])
            if cache is None:
                logits = self._model_call(inputs)[0, prompt - 1 :]
            else:
                logits = self.model(input_ids=inputs[:, prompt - 1 :], use_cache=True, **cache_kwargs(cache)).logits[0]
            logprobs = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
            wanted = torch.tensor(continuation, dtype=torch.long, device=self.device)
            answer = (
                float(logprobs.gather(-1, wanted[:, None]).sum()),
                bool((logprobs.argmax(dim=-1) == wanted).all()),
            )
            results.append(answer)
            if request_str is not None:
                self.cache_hook.add_partial("loglikelihood", request_str, answer)
        return results

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """`HFLM`'s generation (its stopping criteria and sampling settings) on the served cache of `context`."""
        cache = self.serve_prompt(context, generation_kwargs.get("attention_mask"))
        if cache is not None:
            generation_kwargs.update(cache_kwargs(cache))
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["hf_kvmap_rung"] = self.rung.text
        if self.mapper is not None:
            info["hf_kvmap_mapper"] = getattr(self.mapper.config, "name_or_path", None)
        return info


def cli_evaluate() -> None:
    """`hf-kvmap-eval`: lm-eval's command line (`lm_eval ...`, the same arguments) with `--model hf-kvmap` known."""
    from lm_eval.__main__ import cli_evaluate as lm_eval_cli

    lm_eval_cli()


__all__ = ["HFKVMapLM", "cli_evaluate"]
