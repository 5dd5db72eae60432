"""Version gates (`hf_kvmap._compat`): the name of the cache argument is the one the installed transformers reads."""

from __future__ import annotations

import ast
import inspect
import warnings
from pathlib import Path

import pytest
import torch

from hf_kvmap import MappedCache, MapperModel
from hf_kvmap._compat import cache_argument, cache_kwargs, output_cache


def test_the_cache_argument_is_the_one_the_installed_forward_declares(tiny):
    config = tiny.SUPPORTED["qwen3"]()
    model = tiny.model(config)
    assert cache_argument() in inspect.signature(model.forward).parameters
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        prefix = output_cache(model(ids[:, :-1], use_cache=True))
        step = model(ids[:, -1:], **cache_kwargs(prefix)).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)  # the cache was read, not ignored


def test_the_name_the_installed_forward_does_not_declare_is_never_safe_to_pass(tiny):
    """Why the gate exists, on both ends of the supported range: where `forward` declares only `past_key_values`
    (5.23), `cache=` goes into `**kwargs` and the model runs without the cache, with no error; where it declares
    `cache` (5.24), `past_key_values=` still works but raises a FutureWarning (removal in 6.0). The library therefore
    passes only the name the installed forward declares."""
    config = tiny.SUPPORTED["qwen3"]()
    model = tiny.model(config)
    declared = inspect.signature(model.forward).parameters
    other = "cache" if cache_argument() == "past_key_values" else "past_key_values"
    assert cache_argument() in declared and other not in declared
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        prefix = output_cache(model(ids[:, :-1], use_cache=True))
        if other == "cache":  # transformers 5.23
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                ignored = model(ids[:, -1:], cache=prefix).logits[:, -1]
            assert not torch.allclose(ignored, full, atol=1e-3)  # silently read without the cache
        else:  # transformers 5.24 and later
            with pytest.warns(FutureWarning, match="past_key_values"):
                step = model(ids[:, -1:], past_key_values=prefix).logits[:, -1]
            torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)  # read, but deprecated


def test_the_library_and_benchmarks_name_the_cache_only_through_compat():
    """No module of hf_kvmap (but `_compat`) or of benchmarks/ passes `past_key_values=` or reads
    `.past_key_values`: the name moved in transformers 5.24, and `_compat.cache_kwargs` / `output_cache` follow it."""
    root = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted([*(root / "hf_kvmap").rglob("*.py"), *(root / "benchmarks").rglob("*.py")]):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named = (isinstance(node, ast.keyword) and node.arg == "past_key_values") or (
                isinstance(node, ast.Attribute) and node.attr == "past_key_values"
            )
            if named:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == []


def test_the_old_and_the_current_name_both_carry_a_mapped_cache_through_generate(tiny):
    config = tiny.SUPPORTED["qwen3"]()
    model = tiny.model(config)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    reference = tiny.greedy(model, ids)
    for name in ("past_key_values", cache_argument()):
        cache = MappedCache.from_source(output_cache(model(ids, use_cache=True)), MapperModel.identity(config))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, **{name: cache})
        assert torch.equal(out, reference)
        deprecated = [
            w for w in caught if issubclass(w.category, FutureWarning) and "past_key_values" in str(w.message)
        ]
        assert bool(deprecated) == (name != cache_argument()), name  # the old name warns where it is not declared
