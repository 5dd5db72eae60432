"""Tiny models built from configs: the registry every architecture-parametrized test runs over."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPTNeoXConfig,
    LlamaConfig,
    Ministral3Config,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _qwen3(**kw):
    return Qwen3Config(**{**COMMON, "head_dim": 16, **kw})


# Architectures whose caches hf-kvmap maps exactly.
SUPPORTED = {
    "qwen3": lambda: _qwen3(),
    "qwen3-yarn": lambda: _qwen3(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    "llama": lambda: LlamaConfig(**COMMON),
    "llama3-scaling": lambda: LlamaConfig(
        **COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    "ministral3-yarn": lambda: Ministral3Config(
        **COMMON,
        head_dim=16,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    ),
    "qwen2-biased-k": lambda: Qwen2Config(**COMMON),
}

# Layouts that must be refused with a clear error, and a fragment of the message.
REFUSED = {
    "mistral-sliding-window": (lambda: MistralConfig(**COMMON, sliding_window=32), "sliding"),
    "qwen3-hybrid-layers": (
        lambda: _qwen3(
            use_sliding_window=True, sliding_window=32, layer_types=["sliding_attention", "full_attention"]
        ),
        "sliding",
    ),
    "gpt-neox-partial-rotary": (
        lambda: GPTNeoXConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
        ),
        "not supported",
    ),
}


def build_model(config, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    # Random init is near-uniform; sharpen the output so greedy decoding is not decided by rounding noise.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model


@pytest.fixture(params=sorted(SUPPORTED))
def arch(request):
    return request.param


@pytest.fixture
def model_and_config(arch):
    config = SUPPORTED[arch]()
    return build_model(config), config


def left_padded_batch(lengths=(9, 14), vocab=128, seed=1):
    """Token ids and attention mask for a left-padded batch of random prompts."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


@pytest.fixture(scope="module")
def one_thread():
    """Small GEMMs: one thread is faster than two and immune to a busy second core (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
