"""Saving and loading calibration statistics: `statistics.safetensors` (the sums) and `statistics.json` (everything
else, with the tensors' sha256), swapped in whole. A mixin of [`~hf_kvmap.statistics.CalibrationStatistics`].
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from .artifacts import file_sha256
from .moments import DTYPES, NUM_LIMBS, PER_PART, PartStatistics

STATISTICS_FILE = "statistics.safetensors"
METADATA_FILE = "statistics.json"
FORMAT_VERSION = 1


class SavedStatistics:
    """How [`~hf_kvmap.statistics.CalibrationStatistics`] is written to a folder and read back."""

    def metadata(self) -> dict[str, Any]:
        """The JSON side of `save`: everything but the tensors."""
        return {
            "format_version": FORMAT_VERSION,
            **self._compatibility(),
            "calibration": self.provenance(),
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write `statistics.safetensors` and `statistics.json` (with the tensors' sha256) into folder `path`, swapped
        in whole (`hf_kvmap.atomic`: a kill leaves the previous statistics or the new ones); a folder holding other
        files is refused (statistics get a folder of their own)."""
        from safetensors.torch import save_file

        from .atomic import write_folder_atomically

        if others := sorted(set(os.listdir(path) if os.path.isdir(path) else ()) - {STATISTICS_FILE, METADATA_FILE}):
            raise ValueError(f"{path} holds other files ({', '.join(others[:3])}): give statistics their own folder.")
        state = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}

        def write(folder) -> None:
            save_file(state, os.path.join(folder, STATISTICS_FILE), metadata={"format": "pt"})
            metadata = {**self.metadata(), "sha256": file_sha256(os.path.join(folder, STATISTICS_FILE))}
            with open(os.path.join(folder, METADATA_FILE), "w", encoding="utf-8") as handle:
                handle.write(json.dumps(metadata, indent=2, sort_keys=True) + "\n")

        write_folder_atomically(path, write)

    @classmethod
    def load(
        cls, path: str | os.PathLike, *, device: torch.device | str = "cpu", verify: bool = True
    ) -> SavedStatistics:
        """Load statistics written by `save`. With `verify`, refuse a tensors file whose sha256 does not match."""
        from safetensors.torch import load_file

        from .atomic import recover_folder

        recover_folder(path)  # a save killed between its two renames (where folders cannot be exchanged)
        with open(os.path.join(path, METADATA_FILE), encoding="utf-8") as handle:
            meta = json.load(handle)
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: statistics format_version {meta.get('format_version')} is not {FORMAT_VERSION}."
            )
        tensors_path = os.path.join(path, STATISTICS_FILE)
        if verify and meta.get("sha256") != file_sha256(tensors_path):
            raise ValueError(
                f"{tensors_path} does not match the sha256 recorded in {METADATA_FILE}: refusing to load it."
            )
        stats = cls(
            meta["source_summary" if "source_summary" in meta else "source_config"],  # "*_config": files before 0.1
            meta["target_summary" if "target_summary" in meta else "target_config"],
            parts=meta["parts"] if "parts" in meta else meta["kinds"],  # "kinds": files written before 0.1
            target_layers=meta["target_layers"],
            stride=meta["stride"],
            dtype=DTYPES[meta["dtype"]],
            device=device,
            source_model_id=meta.get("source_model_id"),
            source_revision=meta.get("source_revision"),
            target_model_id=meta.get("target_model_id"),
            target_revision=meta.get("target_revision"),
            tokenizer_fingerprint=meta.get("tokenizer_fingerprint"),
            kernel_settings=meta.get("calibration", {}).get("kernel_settings"),  # files before it: unknown
            allocate=False,
        )
        state = load_file(tensors_path, device=str(torch.device(device)))
        # safetensors hands back views into the file's buffer at the file's offsets, not 64-byte aligned; MKL picks its
        # GEMM code path by the output's alignment, so a calibration resumed into them (`addmm_`) would round otherwise
        # than an uninterrupted one on some CPUs (seen on AMD EPYC). Fresh tensors are allocated 64-byte aligned.
        state = {name: tensor.clone() for name, tensor in state.items()}
        shared = {"tokens": (), "sequences": (), "fingerprint_limbs": (NUM_LIMBS,)}
        expected = {name: (shape, torch.int64) for name, shape in shared.items()}
        empty = PartStatistics.zeros(stats.source_width, stats.target_width, stats.dtype, "meta").tensors()  # shapes
        expected |= {f"{part}.{name}": (tuple(t.shape), t.dtype) for part in stats.parts for name, t in empty.items()}
        if set(state) != set(expected):
            raise ValueError(f"{tensors_path} holds tensors {sorted(state)}; expected {sorted(expected)}.")
        for name, (shape, dtype) in expected.items():
            if tuple(state[name].shape) != shape or state[name].dtype != dtype:
                raise ValueError(
                    f"{tensors_path}: {name} is {tuple(state[name].shape)} {state[name].dtype}; expected {shape} {dtype}."
                )
        for part in stats.parts:
            stats.stats[part] = PartStatistics(**{name: state[f"{part}.{name}"] for name in PER_PART})
        stats.tokens, stats.sequences = state["tokens"], state["sequences"]
        stats.fingerprint_limbs = state["fingerprint_limbs"]
        return stats


__all__ = ["FORMAT_VERSION", "METADATA_FILE", "STATISTICS_FILE", "SavedStatistics"]
