"""Adding calibration statistics gathered apart: `merge` (two objects, in place) and `all_reduce` (every process of a
`torch.distributed` group), after checking that they are sums of the same thing (`check_compatible`). A mixin of
[`~hf_kvmap.statistics.CalibrationStatistics`]: statistics are sums, so a fit that outgrows one machine adds them.
"""

from __future__ import annotations

from typing import Any

import torch

from .moments import dtype_name
from .reporting import joined_settings


class MergeableStatistics:
    """What [`~hf_kvmap.statistics.CalibrationStatistics`] adds across objects and processes."""

    def _add_settings(self, theirs: str | None, held: bool) -> None:
        """The kernel settings once sums gathered under `theirs` are added; `held`: whether these sums held any
        positions before (empty sums take the other's label)."""
        self.kernel_settings = joined_settings(self.kernel_settings, theirs) if held else theirs

    def _compatibility(self) -> dict[str, Any]:
        return {
            "source_summary": self.source_summary,
            "target_summary": self.target_summary,
            "parts": list(self.parts),
            "target_layers": self.target_layers,
            "stride": self.stride,
            "dtype": dtype_name(self.dtype),
            "source_model_id": self.source_model_id,
            "source_revision": self.source_revision,
            "target_model_id": self.target_model_id,
            "target_revision": self.target_revision,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
        }

    def check_compatible(self, other: MergeableStatistics) -> None:
        """Raise `ValueError` naming the first field in which `other` cannot be summed with `self`."""
        mine, theirs = self._compatibility(), other._compatibility()
        for field, value in mine.items():
            other_value = theirs[field]
            if field.endswith(("_model_id", "_revision", "_fingerprint")) and (value is None or other_value is None):
                continue  # unknown provenance on one side does not block a merge
            if value != other_value:
                raise ValueError(
                    f"Cannot merge calibration statistics: {field} differs ({value!r} here, {other_value!r} in the "
                    "other). Statistics only add up for the same model pair, parts, target_layers, stride and dtype."
                )

    @torch.no_grad()
    def merge(self, other: MergeableStatistics) -> MergeableStatistics:
        """Add `other`'s sums into `self` (in place) after checking compatibility; returns `self`."""
        self.check_compatible(other)
        if int(other.tokens) > 0:
            self._add_settings(other.kernel_settings, int(self.tokens) > 0)
        theirs = other.state_dict()
        for name, tensor in self.state_dict().items():
            tensor += theirs[name].to(tensor.device)
        for side in ("source", "target"):
            for field in ("model_id", "revision"):
                attr = f"{side}_{field}"
                if getattr(self, attr) is None:
                    setattr(self, attr, getattr(other, attr))
        if self.tokenizer_fingerprint is None:
            self.tokenizer_fingerprint = other.tokenizer_fingerprint
        return self

    @torch.no_grad()
    def all_reduce(self, group=None) -> MergeableStatistics:
        """Sum every tensor across the processes of `group` with `torch.distributed`; returns `self`.

        A no-op when `torch.distributed` is not initialized. Every rank must hold compatible statistics (checked
        first, with one `all_gather_object`). With NCCL the statistics must live on the rank's CUDA device.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        world = dist.get_world_size(group)
        if world == 1:
            return self
        gathered: list[Any] = [None] * world
        mine = (self._compatibility(), int(self.tokens) > 0, self.kernel_settings)
        dist.all_gather_object(gathered, mine, group=group)
        for rank, (theirs, _, _) in enumerate(gathered):
            if theirs != self._compatibility():
                diff = sorted(k for k in theirs if theirs[k] != self._compatibility()[k])
                raise ValueError(f"Rank {rank} holds incompatible calibration statistics (differs in {diff}).")
        for tensor in self.state_dict().values():
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        if labels := [settings for _, held, settings in gathered if held]:  # ranks without positions add nothing
            self.kernel_settings = joined_settings(*labels)
        return self

    def to(self, device: torch.device | str) -> MergeableStatistics:
        """Move every tensor to `device` (in place); returns `self`."""
        self.device = torch.device(device)
        for stats in self.stats.values():
            for name, tensor in stats.tensors().items():
                setattr(stats, name, tensor.to(self.device))
        self.tokens, self.sequences = self.tokens.to(self.device), self.sequences.to(self.device)
        self.fingerprint_limbs = self.fingerprint_limbs.to(self.device)
        return self


__all__ = ["MergeableStatistics"]
