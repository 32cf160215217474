"""Baseline quantizers the TACO codec is compared against (same compress/decompress interface).

- :class:`PerTensorFP8`: one scale for the whole tensor, what Transformer
  Engine's current-scaling quantizer does (TE is used when importable).
- per-group FP8 without Hadamard: ``TacoCodec(transform="none")``.
- per-group INT8 without Hadamard (the format that suffers "zero collapse" on activations clustered near
  zero): ``TacoCodec(fmt="int8", transform="none")``.

Their buffers carry no header: they are for the numerics study, not the wire.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from megatron_taco.codec.format import FP8_FORMATS

__all__ = ["PerTensorFP8"]


def _transformer_engine_quantizer(fmt: str, device: torch.device):
    """TE's Float8CurrentScalingQuantizer, or None when TE is not installed."""
    try:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer
    except ImportError:
        return None
    te_dtype = tex.DType.kFloat8E4M3 if fmt == "e4m3" else tex.DType.kFloat8E5M2
    return Float8CurrentScalingQuantizer(te_dtype, device)


class PerTensorFP8:
    """x -> fp8(x * M / max|x|) with one fp32 scale_inv. Wire: [codes (numel) | scale_inv (4 B)]."""

    def __init__(self, fmt: str = "e4m3") -> None:
        self.format = FP8_FORMATS[fmt]
        self.fmt = fmt

    def compressed_nbytes(self, numel: int) -> int:
        return numel + 4

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        quantizer = _transformer_engine_quantizer(self.fmt, x.device) if x.is_cuda else None
        if quantizer is not None:
            q = quantizer(flat.unsqueeze(0))
            codes, scale_inv = q._data.reshape(-1), q._scale_inv.float().reshape(1)
        else:
            fp8_max = torch.tensor(self.format.max_value, device=x.device)
            amax = flat.float().abs().amax() if flat.numel() else torch.zeros((), device=x.device)
            scale_inv = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax)).reshape(1)
            q = (flat.float() / scale_inv).clamp(-self.format.max_value, self.format.max_value)
            codes = q.to(self.format.torch_dtype).view(torch.uint8)
        return torch.cat([codes, scale_inv.view(torch.uint8)])

    def decompress(self, buf: torch.Tensor, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        numel = math.prod(shape)
        scale_inv = buf[numel:].view(torch.float32)
        return (buf[:numel].view(self.format.torch_dtype).float() * scale_inv).to(dtype).view(shape)
