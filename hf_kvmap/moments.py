"""The running sums behind `CalibrationStatistics`: one `PartStatistics` per part (keys, values), and the additive
fingerprint of the calibration token ids."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

# The calibration fingerprint is a sum (mod 2^256) of per-sequence sha256 digests, kept as 16-bit limbs in int64 so
# that it adds like every other statistic (merge, all_reduce) and does not depend on the order of the sequences.
LIMB_BITS = 16
NUM_LIMBS = 256 // LIMB_BITS
#: The sums of one part, by name.
PER_PART = ("count", "source_sum", "target_sum", "target_sumsq", "gram", "cross")
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    """`"float64"` or `"float32"`: the accumulation dtypes statistics support."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype={dtype} is not supported for statistics; use torch.float64 or torch.float32.")


def sequence_digest(ids: torch.Tensor) -> int:
    """sha256 of one sequence's token ids (little-endian int64), as an integer."""
    data = ids.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes()
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


def limbs(value: int) -> torch.Tensor:
    """A 256-bit integer as `NUM_LIMBS` int64 limbs of `LIMB_BITS` bits (least significant first)."""
    mask = (1 << LIMB_BITS) - 1
    return torch.tensor([(value >> (LIMB_BITS * i)) & mask for i in range(NUM_LIMBS)], dtype=torch.int64)


@dataclass
class PartStatistics:
    """The running sums of one part (`"key"` or `"value"`); see the module docstring for the meaning of each."""

    count: torch.Tensor  # () int64
    source_sum: torch.Tensor  # (F_s,)
    target_sum: torch.Tensor  # (F_t,)
    target_sumsq: torch.Tensor  # (F_t,)
    gram: torch.Tensor  # (F_s, F_s)
    cross: torch.Tensor  # (F_s, F_t)

    @classmethod
    def zeros(cls, source_width: int, target_width: int, dtype: torch.dtype, device) -> PartStatistics:
        def z(*shape):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            count=torch.zeros((), dtype=torch.int64, device=device),
            source_sum=z(source_width),
            target_sum=z(target_width),
            target_sumsq=z(target_width),
            gram=z(source_width, source_width),
            cross=z(source_width, target_width),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in PER_PART}

    @torch.no_grad()
    def update(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Add feature rows `source` `(N, F_s)` and `target` `(N, F_t)` (already in the statistics dtype/device).

        Raises `ValueError` (and adds nothing) if either holds NaN or inf, e.g. from a half-precision overflow.
        """
        for side, features in (("source", source), ("target", target)):
            if not bool(torch.isfinite(features).all()):
                raise ValueError(
                    f"The {side} features of this batch contain NaN or inf; refusing to accumulate them (the "
                    "statistics are unchanged). Check the model's dtype (fp16 overflow?) and the calibration batch."
                )
        self.count += source.shape[0]
        self.source_sum += source.sum(0)
        self.target_sum += target.sum(0)
        self.target_sumsq += target.square().sum(0)
        self.gram.addmm_(source.T, source)
        self.cross.addmm_(source.T, target)


def fingerprint_hex(fingerprint_limbs: torch.Tensor) -> str:
    """The hex digest (mod 2^256) that summed limbs stand for."""
    value = sum(int(limb) << (LIMB_BITS * i) for i, limb in enumerate(fingerprint_limbs.tolist()))
    return f"{value % (1 << 256):064x}"
