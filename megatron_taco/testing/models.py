"""Tiny model shapes for tests and CPU studies (seconds per step on one core)."""

from megatron_taco.training.model import ModelShape

__all__ = ["TINY_GPT", "TINY_QWEN"]

TINY_GPT = ModelShape(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=256,
    vocab_size=200,
    seq_length=32,
)

TINY_QWEN = ModelShape(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=200,
    seq_length=32,
    normalization="RMSNorm",
    activation="swiglu",
    position_embedding="rope",
    rotary_base=1000000,
    add_bias_linear=False,
    add_qkv_bias=True,
    norm_epsilon=1e-6,
)
