"""The narrow-integer wire format: each token's values as 5- or 6-bit integers after a group Hadamard transform.

MAPL's ``--mapl-wire int5`` sends z (r values per token) and dL/dz this way. At the same bytes per token as the FP8
wire it keeps 1.5x the rank (8x at d = 512: r = 192 against 128), and rank is what the boundary's loss follows: on
the GPU model (1500 steps, 5 seeds) 16x ended 0.87% lower than with the FP8 wire in every seed, 8x 0.50% lower in 4
of 5 (benchmarks/results/mapl_loopback.md). A token's r values become one row of the message::

    row    = [exponent byte][r / G scale bytes][r b / 8 code bytes]
    groups G = 32 consecutive values (16 where r is not a multiple of 32), each rotated by the orthonormal
           Hadamard y = H x / sqrt(G) (Sylvester order, ``reference.fwht``)
    step   s = max |y| / M of the group (M = 2^(b-1) - 1), at least 2^-126, rounded up to 3 mantissa bits, so no
           value clips: s = (1 + k / 8) 2^e
    exponent byte  E + 127, E the largest e of the token (255: the token held a NaN or an Inf, or its rotation
                   overflowed; it decodes as NaN)
    scale byte     (E - e) << 3 | k, E - e in [0, 31]; a group whose e is lower takes the step 2^(E - 31)
    codes  rint(y / s) (ties to even) in [-M, M], stored as code + 2^(b-1) in b bits, 8 codes in b bytes, the
           first code in the lowest bits (little-endian)

Decoding multiplies the codes by their steps and rotates back (H is its own inverse up to G). The gradient goes back
in the same format. On CUDA tensors fused Triton kernels (``codec.narrow_int_kernels``) do both, with the bytes and
values of the torch operations below as they compute on the CPU (on CUDA torch divides by M as a multiply by its
reciprocal, so the torch code there can differ from them in a step's last bit); elsewhere the torch operations.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from megatron_taco.codec import reference
from megatron_taco.codec.interface import TokenRowCodec

__all__ = ["NarrowIntCodec", "narrow_int_rank"]

MANTISSA_BITS = 3  # of each group's step
EXPONENT_SPAN = 31  # binades a group's step may sit below its token's largest (5 bits of the scale byte)
MIN_STEP_EXPONENT = -126  # steps are at least 2^-126 (the smallest normal fp32): a token of zeros decodes as zeros
_NONFINITE = 255  # exponent byte of a token that held a NaN or an Inf


def narrow_int_rank(byte_budget: float, bits: int) -> int:
    """The largest r, a multiple of 16, whose bytes per token (``NarrowIntCodec.token_bytes``) fit
    ``byte_budget`` (0 when not even 16 values fit)."""
    candidates = range(16, int(byte_budget * 8 / bits) + 17, 16)
    fits = [r for r in candidates if NarrowIntCodec(r, bits).token_bytes <= byte_budget]
    return max(fits, default=0)


class NarrowIntCodec(TokenRowCodec):
    """Per token of ``width`` values: ``bits``-bit integers (5 or 6) under one 3-mantissa-bit step per group of 32
    (or 16) Hadamard-rotated values. compress: [..., width] -> uint8 [tokens * token_bytes]; decompress: back.
    ``compressed_nbytes`` / ``compress`` / ``decompress`` are what MAPL's P2P wire uses of a wire codec."""

    wire = "narrow-integer wire"

    def __init__(self, width: int, bits: int, backend: str = "auto") -> None:
        """``backend``: "auto" (the Triton kernels on CUDA tensors, torch otherwise), "torch" or "triton" (also on
        CPU tensors under TRITON_INTERPRET=1). The kernels take fp32 / bf16 / fp16 values; others go through the
        torch code."""
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"narrow-integer wire: backend {backend!r}; choose auto, torch or triton")
        if bits not in (5, 6):
            raise ValueError(f"narrow-integer wire: {bits} bits per value; choose 5 or 6")
        if width <= 0 or width % 16:
            raise ValueError(f"narrow-integer wire: {width} values per token; needs a positive multiple of 16")
        self.width, self.bits, self.backend = width, bits, backend
        self.group = 32 if width % 32 == 0 else 16
        self.groups = width // self.group
        self.max_code = 2 ** (bits - 1) - 1
        self.code_bytes = width * bits // 8
        self.token_bytes = 1 + self.groups + self.code_bytes

    def _rotate(self, groups: torch.Tensor) -> torch.Tensor:
        """The orthonormal Hadamard of each group (its own inverse)."""
        return reference.fwht(groups) * self.group**-0.5

    def _kernels(self, x: torch.Tensor):
        """The Triton kernels' module for this tensor, or None for the torch code."""
        if self.backend == "torch" or (self.backend == "auto" and not x.is_cuda):
            return None
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("narrow-integer wire: backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1)")
        from megatron_taco.codec import narrow_int_kernels  # imports this module's format constants

        return narrow_int_kernels

    def compress(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` [..., width] -> one uint8 message (written to ``out`` [nbytes] if given)."""
        tokens = self._tokens(x.numel())
        kernels = self._kernels(x)
        if kernels is not None and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            target = self._message_buffer(tokens, out, x.device)
            rows = x.detach().reshape(tokens, self.width)
            rows = rows if rows.stride(1) == 1 else rows.contiguous()
            direct = target.is_contiguous() and target.device == x.device
            message = target if direct else torch.empty(target.shape, dtype=torch.uint8, device=x.device)
            kernels.compress_rows(rows, message, self.width, self.bits)
            return target if direct else target.copy_(message)
        rows = x.detach().reshape(tokens, self.groups, self.group).float()
        finite = torch.isfinite(rows).flatten(1).all(-1)
        y = self._rotate(torch.where(finite[:, None, None], rows, torch.zeros((), device=rows.device)))
        finite &= torch.isfinite(y).flatten(1).all(-1)  # a rotation can overflow fp32 (values near 1e38)
        y = torch.where(finite[:, None, None], y, torch.zeros((), device=y.device))
        need = torch.clamp(y.abs().amax(-1) / self.max_code, min=2.0**MIN_STEP_EXPONENT)
        # need = m 2^f, m in [0.5, 1): the step (1 + k / 8) 2^(f - 1) with k = ceil(8 (2m - 1)); k = 8 is 2^f
        mantissa, exponent = torch.frexp(need)
        k = torch.ceil((2 * mantissa - 1) * 2**MANTISSA_BITS).to(torch.int32)  # exact in fp32
        exponent = exponent - 1 + (k >> MANTISSA_BITS)
        k = k & (2**MANTISSA_BITS - 1)
        top = exponent.amax(-1, keepdim=True)
        below = exponent < top - EXPONENT_SPAN  # the step floor 2^(E - 31)
        k = torch.where(below, 0, k)
        exponent = torch.where(below, top - EXPONENT_SPAN, exponent)
        step = torch.ldexp(1 + k.float() / 2**MANTISSA_BITS, exponent.float())
        codes = torch.round(y / step[..., None]).clamp(-self.max_code, self.max_code).to(torch.int64)
        message = torch.cat(
            [
                torch.where(finite, top[:, 0] + 127, _NONFINITE)[:, None].to(torch.uint8),
                (((top - exponent) << MANTISSA_BITS) | k).to(torch.uint8),
                self._pack(codes.view(tokens, self.width) + 2 ** (self.bits - 1)),
            ],
            dim=1,
        )
        return self._message(message, out)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        """[T, width] codes of ``bits`` bits -> [T, code_bytes] uint8: each 8 codes one little-endian word of
        ``bits`` bytes, code i in bits [i b, (i + 1) b)."""
        shifts = torch.arange(8, device=codes.device) * self.bits
        words = (codes.view(codes.shape[0], self.width // 8, 8) << shifts).sum(-1)
        byte_shifts = torch.arange(self.bits, device=codes.device) * 8
        return ((words[..., None] >> byte_shifts) & 0xFF).to(torch.uint8).flatten(1)

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`_pack`."""
        byte_shifts = torch.arange(self.bits, device=packed.device) * 8
        words = (packed.view(packed.shape[0], self.width // 8, self.bits).to(torch.int64) << byte_shifts).sum(-1)
        shifts = torch.arange(8, device=packed.device) * self.bits
        return ((words[..., None] >> shifts) & (2**self.bits - 1)).flatten(1)

    def decompress(
        self, buf: torch.Tensor, shape: Sequence[int], dtype: torch.dtype = torch.float32, validate: bool = True
    ) -> torch.Tensor:
        """One message -> [shape] in ``dtype``; ``validate``: check the codes lie in [-M, M] (the one unused
        pattern, -M - 1, means the bytes are not this format's), by the torch code's unpacking even where the
        kernels decode: MAPL's wire checks its first message only."""
        rows = self._rows(buf, shape)
        tokens = rows.shape[0]
        kernels = self._kernels(buf)
        if validate or kernels is None:
            codes = self._unpack(rows[:, 1 + self.groups :]) - 2 ** (self.bits - 1)
            if validate and bool((codes < -self.max_code).any()):
                raise ValueError(f"narrow-integer wire: a code outside [-{self.max_code}, {self.max_code}]")
        if kernels is not None:
            direct = dtype in (torch.float32, torch.bfloat16, torch.float16)
            out = torch.empty(tokens, self.width, dtype=dtype if direct else torch.float32, device=buf.device)
            kernels.decompress_rows(buf.reshape(-1).contiguous(), out, self.width, self.bits)
            return out.view(*shape).to(dtype)
        top = rows[:, :1].to(torch.int32) - 127
        scale_bytes = rows[:, 1 : 1 + self.groups].to(torch.int32)
        exponent = top - (scale_bytes >> MANTISSA_BITS)
        step = torch.ldexp(1 + (scale_bytes & (2**MANTISSA_BITS - 1)).float() / 2**MANTISSA_BITS, exponent.float())
        decoded = self._rotate(codes.view(tokens, self.groups, self.group).float() * step[..., None])
        decoded = torch.where((rows[:, :1] == _NONFINITE)[:, :, None], float("nan"), decoded)
        return decoded.view(*shape).to(dtype)
