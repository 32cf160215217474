"""TACO codec: Adaptive Scale-Hadamard transform + dual-scale FP8, its wire format and baselines."""

from megatron_taco.codec.format import CodecSettings, WireFormatError
from megatron_taco.codec.taco import TacoCodec

__all__ = ["TacoCodec", "CodecSettings", "WireFormatError"]
