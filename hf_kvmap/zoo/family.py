"""Geometry of the tiny family (pure data: importing this module loads no torch)."""

from __future__ import annotations

_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "kv_group",
)

#: name -> geometry; ``kv_group`` says which members share KV geometry (same num_key_value_heads and head_dim)
FAMILY: dict[str, dict] = {
    name: dict(zip(_FIELDS, values))
    for name, values in (
        ("tiny-s", (2, 128, 4, 2, 32, 384, "kv2x32")),
        ("tiny-m", (4, 192, 6, 2, 32, 512, "kv2x32")),
        ("tiny-l", (6, 256, 8, 2, 32, 768, "kv2x32")),
        # mismatched KV geometry: 4 KV heads of dim 16 (same KV width 64 per token and layer, different split)
        ("tiny-x", (4, 192, 12, 4, 16, 512, "kv4x16")),
    )
}

#: members sharing the reference KV geometry (n_kv=2, head_dim=32), smallest first
MATCHED = ("tiny-s", "tiny-m", "tiny-l")
#: the member whose KV geometry differs
MISMATCHED = ("tiny-x",)

VOCAB_SIZE = 64  # tokenizer has 55 entries; padded to 64
MAX_POSITIONS = 1024
ROPE_THETA = 10000.0


def make_config(name: str):
    """A fresh ``Qwen3Config`` for member ``name`` (full attention only, default RoPE)."""
    from transformers import Qwen3Config

    from .corpus import BOS, EOS, PAD
    from .tokenizer import vocab

    g = {k: v for k, v in FAMILY[name].items() if k != "kv_group"}
    v = vocab()
    n = g["num_hidden_layers"]
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=n,
        layer_types=["full_attention"] * n,
        tie_word_embeddings=True,
        attention_bias=False,
        attention_dropout=0.0,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        bos_token_id=v[BOS],
        eos_token_id=v[EOS],
        pad_token_id=v[PAD],
        **g,
    )
