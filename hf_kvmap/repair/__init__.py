"""Selective repair: the target recomputes the keys/values of the cached positions that matter, attending to the
mapped cache of the rest (between serving a mapped cache and the target's own full prefill).

```python
from hf_kvmap.repair import RepairConfig, repair_cache

cache = MappedCache.from_source(source_cache, mapper)
repair_cache(target, cache, input_ids, RepairConfig(strategy="tail", fraction=0.2))
```

One file per strategy, each one class registered in `SELECTORS` (`base.register_selector`). One door to the recompute,
`apply_repair`: every change of a cache's keys/values by the target goes through it (`repair_cache`, `DecodeRefresh`,
the serving pipeline and, deprecated until 0.2, `MappedCache.from_source(repair=)`).
"""

from ..drafting import Draft, greedy_draft
from .base import SELECTORS, RepairContext, Selector, register_selector, selector_from_dict
from .draft_attention import DraftAttentionSelector
from .draft_branches import DraftBranchesSelector
from .draft_coverage import DraftCoverageSelector
from .early_deviation import EarlyDeviationSelector
from .mix import MixSelector
from .oracle import OracleSelector
from .query_overlap import QueryOverlapSelector, markup_ids, resolve_markup
from .recompute import recompute_positions
from .refresh import DecodeRefresh
from .repair import RepairConfig, apply_repair, repair_cache, select_repair
from .source_attention import SourceAttentionSelector
from .sparse import SparseCache, SparseLayer, sparse_prefill
from .tail import TailSelector
from .target_attention import TargetAttentionSelector

__all__ = [
    "SELECTORS",
    "Draft",
    "DecodeRefresh",
    "DraftAttentionSelector",
    "DraftBranchesSelector",
    "DraftCoverageSelector",
    "EarlyDeviationSelector",
    "MixSelector",
    "OracleSelector",
    "QueryOverlapSelector",
    "RepairConfig",
    "RepairContext",
    "Selector",
    "SourceAttentionSelector",
    "SparseCache",
    "SparseLayer",
    "TailSelector",
    "TargetAttentionSelector",
    "apply_repair",
    "greedy_draft",
    "markup_ids",
    "recompute_positions",
    "register_selector",
    "repair_cache",
    "resolve_markup",
    "select_repair",
    "selector_from_dict",
    "sparse_prefill",
]
