"""Tiny model shapes for tests and CPU studies (seconds per step on one core)."""

from megatron_taco.training.model import QWEN_ARCHITECTURE, ModelShape

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
    **QWEN_ARCHITECTURE,
)
