"""Transformer Engine's FP8 block quantizer as the cast of TACO's compress (``TacoCodec(backend="te")``).

TE 2.x's ``Float8BlockQuantizer`` with 1 x 128 blocks and fp32 (not power-of-two) scales computes what TACO's
plain per-group FP8 mode does: per block ``amax``, ``scale = M / amax``, codes = round-to-nearest-even of
``x * scale`` (measured on H200: bit-identical codes; the stored ``scale_inv = 1 / scale`` is within one fp32
ulp of TACO's ``amax / M``). So a TE-encoded message has TACO's layout and decodes with TACO's kernels, and TACO
decodes it to within one ulp of the scale: ranks with different backends exchange messages correctly. Not for
groups whose max is below M * 2^-126: TACO floors their scale there (``reference.SCALE_FLOOR_EXPONENT``) and TE does
not, so their codes differ (each message carries its own scales, so both still decode).

What TE does not have stays in Triton: the Hadamard (``fp8-ash``: a Triton pass writes ``y = H(x) / sqrt(G)`` in
fp32, TE casts ``y``; TACO's own compress rounds ``H(x) * (m * M / amax)`` with m = 1/sqrt(G) folded in, so with the
Hadamard a code can differ from TE's by one step: 5 of 16.7M codes of Gaussian groups in a CPU emulation of TE's
arithmetic) and the codec's non-finite rule (the same pass writes NaN over every group that holds a
NaN or an Inf; TE alone would saturate Inf to +-448 x scale, a wrong finite number). TE covers FP8 E4M3 / E5M2,
group size 128, fp32 scales, nearest rounding; other settings are refused by name (``check_te_settings``).
The header's encoder nibble says the message was encoded by TE (``format.ENCODERS``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from megatron_taco.codec.format import HEADER_BYTES, CodecSettings

__all__ = ["TE_GROUP_SIZE", "te_unavailable_reason", "check_te_settings", "compress_rows_te"]

TE_GROUP_SIZE = 128  # Float8BlockQuantizer's 1 x 128 blocks


@functools.lru_cache(maxsize=1)
def te_unavailable_reason() -> Optional[str]:
    """None when Transformer Engine's PyTorch quantizers import here, else why not (one line)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
        import transformer_engine_torch  # noqa: F401
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer  # noqa: F401
    except Exception as exc:  # ImportError, or TE's own check of the CUDA / driver set-up
        return f"import transformer_engine failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def check_te_settings(settings: CodecSettings) -> None:
    """Raise ValueError naming what TE's block quantizer does not cover."""
    if settings.fmt not in ("e4m3", "e5m2") or settings.group_size != TE_GROUP_SIZE or settings.scales != "fp32":
        raise ValueError(
            f"backend 'te' (Transformer Engine's 1 x 128 block quantizer) covers FP8 e4m3/e5m2 with group size "
            f"{TE_GROUP_SIZE} and fp32 scales, transform ash or none; not {settings.describe()}: use backend triton"
        )


def _te_extension():
    """TE's C++ extension module (``transformer_engine_torch``): importable once ``transformer_engine.pytorch`` has
    loaded it, not before."""
    import transformer_engine.pytorch  # noqa: F401
    import transformer_engine_torch

    return transformer_engine_torch


@functools.lru_cache(maxsize=None)
def _quantizer(fmt: str):
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    tex = _te_extension()

    dtype = {"e4m3": tex.DType.kFloat8E4M3, "e5m2": tex.DType.kFloat8E5M2}[fmt]
    return Float8BlockQuantizer(
        dtype, rowwise=True, columnwise=False, block_scaling_dim=1, force_pow_2_scales=False, amax_epsilon=0.0
    )


def compress_rows_te(rows: torch.Tensor, out: torch.Tensor, settings: CodecSettings, header: torch.Tensor) -> None:
    """Each row of ``rows`` [R, m] (CUDA) -> its message in ``out`` [R, nbytes]: Triton transform, TE cast."""
    tex = _te_extension()
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage,
    )

    from megatron_taco.codec import kernels

    n_rows, numel = rows.shape
    n_groups, codes_at, scales_at = settings.layout(numel)
    g = settings.group_size
    out[:, :HEADER_BYTES] = header
    if n_groups == 0:  # an empty tensor: the header alone
        return
    transformed = torch.empty(n_rows, n_groups * g, dtype=torch.float32, device=rows.device)
    kernels.transform_rows(rows, transformed, settings)  # y (zero-padded), NaN over non-finite groups
    quantizer = _quantizer(settings.fmt)
    scale_inv = torch.empty(1, -(-n_groups // 4) * 4, dtype=torch.float32, device=rows.device)
    for r in range(n_rows):
        codes = out[r, codes_at:scales_at].view(n_groups, g)
        target = Float8BlockwiseQTensorStorage(codes, scale_inv, None, None, quantizer.dtype, quantizer, False)
        tex.quantize(transformed[r].view(n_groups, g), quantizer, target, None)
        out[r, scales_at:].view(torch.float32).copy_(scale_inv[0, :n_groups])
