"""`query_overlap`: the spans of the prompt that repeat the user's last turn, and the tokens around them, found by
matching token ids (no forward of either model); the rest of the budget goes to a `fill` strategy.

The last `last_tokens` prompt tokens are the query. Every run of consecutive context tokens that also appears, in
order, in the query is scored by what it says and how specific it is: the sum of its tokens' weights, `log(n / (1 +
count))` over the `n` context positions (a token the prompt repeats everywhere, "the", weighs little; a name it holds
once weighs much), times `(log(n / runs) / log(n))^2` where `runs` is how often the run's whole token sequence occurs
in the context (a phrase every paragraph repeats counts little however long; a chat template's turn markers, repeated
only once a turn, are better not matched at all: `skip`). Runs scoring at least `min_share` of the row's best run are
kept; each marks itself, `before` tokens before it and `after` tokens after it (where a fact's value follows the words
that name it) with its score. The query's own positions
score as the best run (every answer reads the question). Marked positions are recomputed first, by score; the rest
of the budget goes to `fill`'s order.

Why: where a prompt holds several similar facts (six registration numbers, four friends' towns), the question names
the fact it wants in the prompt's own words. A strategy that reads attention over the mapped cache can be led to
another fact by the map's error on the very keys that tell the facts apart (`target_attention` at 20 % answered none
of the six long documents of 2K tokens it was tried on); a draft reads the facts the *source* would answer with.
Matching the question's words recomputes the fact it names, and those that share most of its words, whichever the
source would read.

Cost: nothing of either model beyond `fill`'s. It finds nothing where the question repeats no words of the context
(then the whole budget is `fill`'s).
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from ..validation import check_int
from .base import RequestContext, Strategy, percentile_ranks, register_strategy, strategy_from_dict


def run_scores(
    context_ids: list[int], query_ids: list[int], weights: dict[int, float]
) -> list[tuple[int, int, float]]:
    """Every maximal run of `context_ids` that appears in order in `query_ids`: `(start, end, score)` with `end`
    exclusive and `score` the sum of its tokens' `weights` (the best-scoring query alignment of each run end)."""
    previous = [0.0] * (len(query_ids) + 1)  # previous[j + 1]: score of the run ending at the last position and q[j]
    lengths_prev = [0] * (len(query_ids) + 1)
    best: list[tuple[float, int]] = []  # per context position: (score, length) of the best run ending there
    for token in context_ids:
        current = [0.0] * (len(query_ids) + 1)
        lengths = [0] * (len(query_ids) + 1)
        weight = weights.get(token, 0.0)
        for j, query_token in enumerate(query_ids):
            if query_token == token:
                current[j + 1] = previous[j] + weight
                lengths[j + 1] = lengths_prev[j] + 1
        j = max(range(len(current)), key=current.__getitem__)
        best.append((current[j], lengths[j]))
        previous, lengths_prev = current, lengths
    runs = []
    for end, (score, length) in enumerate(best):
        following = best[end + 1][1] if end + 1 < len(best) else 0
        if length and following != length + 1:  # a run ends here (the next position does not extend it)
            runs.append((end - length + 1, end + 1, score))
    return runs


def _specific(runs: list[tuple[int, int, float]], context_ids: list[int]) -> list[tuple[int, int, float]]:
    """`runs` with each score times `(log(n / occurrences) / log(n))^2`, the occurrences of its token sequence in the
    `n` context tokens (a run the context repeats often says little about where the question points)."""
    n = len(context_ids)
    if n < 2:
        return runs
    ids = torch.tensor(context_ids)
    occurrences: dict[tuple[int, ...], int] = {}
    out = []
    for start, end, score in runs:
        key = tuple(context_ids[start:end])
        if key not in occurrences:
            windows = ids.unfold(0, len(key), 1)
            occurrences[key] = int((windows == ids[start:end]).all(dim=1).sum())
        out.append((start, end, score * (math.log(n / occurrences[key]) / math.log(n)) ** 2))
    return out


@register_strategy
class QueryOverlapStrategy(Strategy):
    """Scores the spans that repeat the prompt's last `last_tokens` tokens (and `before`/`after` tokens around them)
    above every other position, which `fill` orders.

    Args:
        last_tokens (`int`, *optional*, defaults to 32): final prompt tokens read as the query.
        before (`int`, *optional*, defaults to 4): tokens before a matched run marked with it.
        after (`int`, *optional*, defaults to 12): tokens after a matched run marked with it.
        min_share (`float`, *optional*, defaults to 0.5): runs scoring less than this share of the row's best are
            ignored (single common words).
        fill (`str` or `dict`, *optional*, defaults to `"tail"`): the strategy (name or settings) that orders the
            positions no kept run marks.
        skip (`list[int]`, *optional*): token ids that never match (a chat template's markup, [`markup_ids`]): a run
            ends at one. The turn markers every turn repeats otherwise match the query's own, and in a short
            conversation (few turns, so little repetition to discount them) outscore the fact the question names.
    """

    name = "query_overlap"

    def __init__(
        self,
        last_tokens: int = 32,
        before: int = 4,
        after: int = 12,
        min_share: float = 0.5,
        fill: str | dict = "tail",
        skip: list[int] | tuple[int, ...] = (),
    ):
        check_int("last_tokens", last_tokens, 1)
        check_int("before", before, 0)
        check_int("after", after, 0)
        if isinstance(min_share, bool) or not isinstance(min_share, (int, float)) or not 0 < min_share <= 1:
            raise ValueError(f"min_share={min_share!r} must be a number in (0, 1].")
        if (fill if isinstance(fill, str) else dict(fill).get("name")) == self.name:
            raise ValueError("query_overlap cannot fill with itself.")
        self.last_tokens, self.before, self.after, self.min_share = last_tokens, before, after, float(min_share)
        if not isinstance(skip, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in skip
        ):
            raise ValueError(
                f"skip={skip!r} must be a list of token ids (ints); hf_kvmap.repair.markup_ids(tokenizer) gives a chat "
                "template's markup."
            )
        self.skip = sorted(set(skip))
        self.fill = strategy_from_dict(fill)
        self.needs_source = self.fill.needs_source

    def settings(self) -> dict:
        fill = self.fill.settings()
        return {
            "name": self.name,
            "last_tokens": self.last_tokens,
            "before": self.before,
            "after": self.after,
            "min_share": self.min_share,
            "fill": fill["name"] if len(fill) == 1 else fill,
            **({"skip": list(self.skip)} if self.skip else {}),
        }

    def marks(self, context: RequestContext) -> torch.Tensor:
        """`(batch, length)` the kept runs' scores spread over their windows (0 where none marks a position)."""
        out = torch.zeros(context.batch, context.length, dtype=torch.float32)
        ids, mask = context.input_ids.cpu(), context.attention_mask.cpu()
        candidates = context.candidates.cpu()
        skip = set(self.skip)
        for row in range(context.batch):
            tokens = ids[row][mask[row].bool()].tolist()
            offset = ids.shape[1] - len(tokens)  # left padding
            query_start = max(0, len(tokens) - self.last_tokens)
            query = [-2 if token in skip else token for token in tokens[query_start:]]  # -2 and -1 never match
            pool = candidates[row].nonzero().squeeze(-1).tolist()
            context_positions = [p for p in pool if p - offset < query_start]
            if not context_positions:
                continue
            # runs are matched over the contiguous context before the query (candidates start at `start`)
            first, last = context_positions[0], context_positions[-1] + 1
            context_ids = [-1 if token in skip else token for token in ids[row, first:last].tolist()]
            counts = Counter(context_ids)
            n = len(context_ids)
            weights = {token: max(0.0, math.log(n / (1 + count))) for token, count in counts.items()}
            runs = _specific(run_scores(context_ids, query, weights), context_ids)
            top = max((score for *_, score in runs), default=0.0)
            if top <= 0:
                continue
            for start, end, score in runs:
                if score >= self.min_share * top:
                    lo, hi = max(0, first + start - self.before), min(context.length, first + end + self.after)
                    out[row, lo:hi] = torch.clamp(out[row, lo:hi], min=score)
            out[row, max(first, offset + query_start) : context.length] = top
        return out * candidates

    def score(self, context: RequestContext) -> torch.Tensor:
        marks = self.marks(context)
        rest = percentile_ranks(self.fill.score(context).cpu(), context.candidates.cpu())  # in (0, 1]
        scale = marks.amax(dim=1, keepdim=True).clamp(min=1e-9)
        return torch.where(marks > 0, 1.0 + marks / scale, rest)


def markup_ids(tokenizer) -> list[int]:
    """The ids of `tokenizer`'s special tokens (its added tokens marked special, a chat template's turn markers among
    them): `QueryOverlapStrategy(skip=markup_ids(tokenizer))` matches what was said, not how turns are marked."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return sorted(
        set(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}
    )


def resolve_markup(settings, tokenizer):
    """Strategy settings (a dict, or a name returned as it is) with `"skip": "markup"` anywhere in them (a nested
    `fill`'s too) read as `markup_ids(tokenizer)`: how a command line names a chat template's markup before the
    tokenizer is loaded (`query_overlap:skip=markup`, `{"name": "query_overlap", "skip": "markup"}`). With `tokenizer`
    `None` the markup reads as no ids: settings checked before any tokenizer is loaded."""
    if not isinstance(settings, dict):
        return settings
    out = {
        key: resolve_markup(value, tokenizer) if isinstance(value, dict) else value for key, value in settings.items()
    }
    if out.get("skip") == "markup":
        out["skip"] = [] if tokenizer is None else markup_ids(tokenizer)
    return out


__all__ = ["QueryOverlapStrategy", "markup_ids", "resolve_markup", "run_scores"]
