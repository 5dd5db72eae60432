"""Version gates (`hf_kvmap._compat`): the name of the cache argument is the one the installed transformers reads."""

from __future__ import annotations

import inspect

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


def test_an_undeclared_cache_name_is_ignored_silently_so_the_library_never_guesses(tiny):
    """Why the gate exists: on a transformers whose forward declares only `past_key_values`, `cache=` goes into
    `**kwargs` and the model runs without the cache, with no error. The library therefore never passes a name the
    installed forward does not declare."""
    config = tiny.SUPPORTED["qwen3"]()
    model = tiny.model(config)
    other = "cache" if cache_argument() == "past_key_values" else "past_key_values"
    if other in inspect.signature(model.forward).parameters:
        return  # both names declared: nothing is ignored
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        prefix = output_cache(model(ids[:, :-1], use_cache=True))
        ignored = model(ids[:, -1:], **{other: prefix}).logits[:, -1]
    assert not torch.allclose(ignored, full, atol=1e-3)


def test_the_old_and_the_current_name_both_carry_a_mapped_cache_through_generate(tiny):
    config = tiny.SUPPORTED["qwen3"]()
    model = tiny.model(config)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    reference = tiny.greedy(model, ids)
    for kwargs in ({"past_key_values": None}, {}):
        cache = MappedCache.from_source(output_cache(model(ids, use_cache=True)), MapperModel.identity(config))
        kwargs = {**cache_kwargs(cache)} if not kwargs else {"past_key_values": cache}
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, **kwargs)
        assert torch.equal(out, reference)
