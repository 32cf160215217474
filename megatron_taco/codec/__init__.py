"""Wire codecs: the interface the collectives depend on (WireCodec) and TACO's formats (Adaptive Scale-Hadamard
+ FP8 / INT8 / FP4 / INT4), their wire format, torch reference, Triton kernels and baselines."""

from megatron_taco.codec.format import CodecSettings, WireFormatError
from megatron_taco.codec.interface import WireCodec
from megatron_taco.codec.taco import TacoCodec

__all__ = ["WireCodec", "TacoCodec", "CodecSettings", "WireFormatError"]
