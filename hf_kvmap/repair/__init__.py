"""Selective repair: the target recomputes the keys/values of the cached positions that matter, attending to the
mapped cache of the rest (between serving a mapped cache and the target's own full prefill).

```python
from hf_kvmap.repair import RepairConfig, repair_cache

cache = MappedCache.from_source(source_cache, mapper)
repair_cache(target, cache, input_ids, RepairConfig(strategy="tail", fraction=0.2))
```

One file per strategy, each one class registered in `STRATEGIES` (`base.register_strategy`). ("Strategy" is the one
word: the names that said "selector", `SELECTORS`, `Selector`, `register_selector`, `selector_from_dict` and each
`<Name>Selector` class, still resolve here with a `DeprecationWarning` until 0.2, as does `RepairContext`, now the
one `hf_kvmap.request_context.RequestContext` of every scorer.) One door to the recompute,
`apply_repair`: every change of a cache's keys/values by the target goes through it (`repair_cache`, `DecodeRefresh`,
the serving pipeline and, deprecated until 0.2, `MappedCache.from_source(repair=)`).
"""

from ..deprecation import deprecated_names
from ..drafting import Draft, greedy_draft
from .base import DEPRECATED_NAMES as _BASE_DEPRECATED
from .base import STRATEGIES, RequestContext, Strategy, register_strategy, strategy_from_dict
from .draft_attention import DraftAttentionStrategy
from .draft_branches import DraftBranchesStrategy
from .draft_coverage import DraftCoverageStrategy
from .early_deviation import EarlyDeviationStrategy
from .mix import MixStrategy
from .oracle import OracleStrategy
from .query_overlap import QueryOverlapStrategy, markup_ids, resolve_markup
from .recompute import recompute_positions
from .refresh import DecodeRefresh
from .repair import RepairConfig, apply_repair, repair_cache, select_repair
from .source_attention import SourceAttentionStrategy
from .sparse import SparseCache, SparseLayer, sparse_prefill
from .tail import TailStrategy
from .target_attention import TargetAttentionStrategy

__all__ = [
    "STRATEGIES",
    "Draft",
    "DecodeRefresh",
    "DraftAttentionStrategy",
    "DraftBranchesStrategy",
    "DraftCoverageStrategy",
    "EarlyDeviationStrategy",
    "MixStrategy",
    "OracleStrategy",
    "QueryOverlapStrategy",
    "RepairConfig",
    "RequestContext",
    "Strategy",
    "SourceAttentionStrategy",
    "SparseCache",
    "SparseLayer",
    "TailStrategy",
    "TargetAttentionStrategy",
    "apply_repair",
    "greedy_draft",
    "markup_ids",
    "recompute_positions",
    "register_strategy",
    "repair_cache",
    "resolve_markup",
    "select_repair",
    "strategy_from_dict",
    "sparse_prefill",
]

#: the names before "strategy" was the one word (deprecated, go in 0.2)
DEPRECATED_NAMES = {
    **_BASE_DEPRECATED,  # the registry's own old names, kept in one place (`repair.base`)
    **{
        name.replace("Strategy", "Selector"): name
        for name in __all__
        if name.endswith("Strategy") and name != "Strategy"
    },
}
__getattr__ = deprecated_names(__name__, globals(), DEPRECATED_NAMES)
