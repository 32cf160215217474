"""Fused Triton kernels of the narrow-integer wire (:mod:`megatron_taco.codec.narrow_int`): compress and decompress.

``NarrowIntCodec``'s torch code runs about 45 operations per call, each a pass over memory and a launch; here one
program holds BLOCK_T whole tokens as a [BLOCK_T, GROUPS_P2, G] tile (a token's groups padded to a power of two,
the padding masked off), reads them once and writes their rows once. The kernels execute the same IEEE fp32
operations as the torch code, so compress writes the same bytes and decompress the same fp32 values:

* the Hadamard is ``kernels._fwht`` (the butterflies of ``reference.fwht``: the same additions on the same
  operands), then one multiply by G^-0.5 rounded to fp32 (torch's ``tensor * python_float`` in fp32);
* the divisions are IEEE-rounded, subnormal operands kept (``tl.math.div_rn``: Triton's ``/`` is approximate on
  GPUs), and on GPUs the kernels launch with ``enable_fp_fusion=False``: no multiply is fused into the
  butterflies' additions;
* frexp, the step's 3-bit ceiling and ldexp are exact in fp32, so they are done on the bits; ``torch.round`` (to
  nearest, ties to even) is the fp32 adder's rounding at 1.5 * 2^23.

On the CPU the tests run them in Triton's interpreter (TRITON_INTERPRET=1), whose casts to bf16 / fp16 truncate:
there the output is first rounded to the target's grid (``kernels._round_to_grid``), as in ``kernels``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from megatron_taco.codec.kernels import _OUTPUT_GRIDS, _cdiv, _fwht, _grid_constants, _round_to_grid
from megatron_taco.codec.narrow_int import (
    _NONFINITE,
    EXPONENT_SPAN,
    MANTISSA_BITS,
    MIN_STEP_EXPONENT,
    NarrowIntCodec,
)

__all__ = ["compress_rows", "decompress_rows"]

NONFINITE_BYTE = tl.constexpr(_NONFINITE)  # exponent byte of a token that held a NaN or an Inf
SPAN = tl.constexpr(EXPONENT_SPAN)  # a group's step is at least 2^(E - 31)
STEP_BITS = tl.constexpr(MANTISSA_BITS)  # mantissa bits of a step: k in [0, 8)
K_SHIFT = tl.constexpr(23 - MANTISSA_BITS)  # k's place in a step's fp32 bits: [20, 23)
K_CEIL = tl.constexpr(2 ** (23 - MANTISSA_BITS) - 1)  # added before the shift: a ceiling
K_MASK = tl.constexpr(2**MANTISSA_BITS - 1)
K_UNIT = tl.constexpr(2.0**-MANTISSA_BITS)  # 1 / 8
MIN_STEP = tl.constexpr(2.0**MIN_STEP_EXPONENT)  # steps are at least 2^-126
ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2^23: fp32 values in [2^23, 2^24) are the integers
TILE = 2048  # elements per program (BLOCK_T tokens of GROUPS_P2 * G), unless one token holds more
_codec = functools.lru_cache(maxsize=None)(NarrowIntCodec)  # the layout of (width, bits), checked once


@triton.jit
def _offsets(token, row_stride, GROUPS_P2: tl.constexpr, G: tl.constexpr):
    """[BLOCK_T, GROUPS_P2, G] offsets of the tokens' values in rows ``row_stride`` elements apart."""
    group = tl.arange(0, GROUPS_P2)[None, :, None]
    return token.to(tl.int64)[:, None, None] * row_stride + group * G + tl.arange(0, G)[None, None, :]


@triton.jit
def _code_offsets(token, GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr):
    """[BLOCK_T, GROUPS_P2, G / 8, 8] offsets of the code bytes: word w (8 codes, BITS bytes) of group g of a token
    at 1 + GROUPS + (g G / 8 + w) BITS, its byte j at + j (j < BITS; the rest of the 8 is masked off)."""
    TOKEN_BYTES: tl.constexpr = 1 + GROUPS + GROUPS * G * BITS // 8
    group = tl.arange(0, GROUPS_P2)[None, :, None, None]
    word = tl.arange(0, G // 8)[None, None, :, None]
    byte = tl.arange(0, 8)[None, None, None, :]
    return token.to(tl.int64)[:, None, None, None] * TOKEN_BYTES + 1 + GROUPS + (group * (G // 8) + word) * BITS + byte


@triton.jit
def _rotate(v, BLOCK_T: tl.constexpr, GROUPS_P2: tl.constexpr, G: tl.constexpr, INV_SQRT_G: tl.constexpr):
    """The orthonormal Hadamard of each group of a [BLOCK_T, GROUPS_P2, G] tile: H v (Sylvester order), times
    G^-0.5 rounded to fp32, as ``NarrowIntCodec._rotate``."""
    ROWS: tl.constexpr = BLOCK_T * GROUPS_P2
    LOG2G: tl.constexpr = G.bit_length() - 1
    h = _fwht(tl.reshape(v, (ROWS, G)), ROWS, G, LOG2G)
    return tl.reshape(h, (BLOCK_T, GROUPS_P2, G)) * INV_SQRT_G


@triton.jit
def _compress_kernel(
    x_ptr,  # [tokens, GROUPS * G] values (fp32, bf16 or fp16), unit column stride
    out_ptr,  # [tokens * TOKEN_BYTES] uint8: the message
    tokens,
    x_row_stride,
    G: tl.constexpr,  # values per group: 32, or 16 where the width is not a multiple of 32
    GROUPS: tl.constexpr,  # groups per token
    GROUPS_P2: tl.constexpr,  # GROUPS rounded up to a power of two (the tile's axis)
    BLOCK_T: tl.constexpr,  # tokens per program
    BITS: tl.constexpr,  # bits per code: 5 or 6
    INV_SQRT_G: tl.constexpr,  # G^-0.5 rounded to fp32
):
    """Tokens [pid * BLOCK_T, (pid + 1) * BLOCK_T) -> their rows [exponent byte][GROUPS scale bytes][codes]."""
    TOKEN_BYTES: tl.constexpr = 1 + GROUPS + GROUPS * G * BITS // 8
    MAX_CODE: tl.constexpr = (1 << (BITS - 1)) - 1  # M
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    group = tl.arange(0, GROUPS_P2)
    group_ok = (token < tokens)[:, None] & (group < GROUPS)[None, :]
    offsets = _offsets(token, x_row_stride, GROUPS_P2, G)
    if x_ptr.dtype.element_ty == tl.bfloat16:  # bf16 is fp32's top half: widened as bits (the interpreter's cast
        # of bf16 subnormals is inexact)
        bits = tl.load(x_ptr.to(tl.pointer_type(tl.uint16)) + offsets, mask=group_ok[:, :, None], other=0)
        x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + offsets, mask=group_ok[:, :, None], other=0.0).to(tl.float32)

    # y = H x / sqrt(G). The torch code zeroes a token holding a NaN or an Inf before rotating; rotated as it is,
    # such a token's y is not finite either (every y of a group adds every x of it), and it is zeroed below.
    y = _rotate(x, BLOCK_T, GROUPS_P2, G, INV_SQRT_G)
    finite = tl.min(tl.min((tl.abs(y) < float("inf")).to(tl.int32), axis=2), axis=1) == 1  # NaN < inf is False
    y = tl.where(finite[:, None, None], y, 0.0)  # a rotation can overflow fp32 (values near 1e38) too

    # need = max |y| / M, at least 2^-126: a normal (1 + f 2^-23) 2^(b - 127), frexp's m = (1 + f 2^-23) / 2.
    # step = (1 + k / 8) 2^(b - 127), k = ceil(8 (2m - 1)) = ceil(f / 2^20) in [0, 8]; k = 8 is 2^(b - 126).
    need = tl.math.div_rn(tl.max(tl.abs(y), axis=2), tl.full((BLOCK_T, GROUPS_P2), MAX_CODE, tl.float32))
    need = tl.maximum(need, MIN_STEP).to(tl.int32, bitcast=True)
    k = ((need & 0x7FFFFF) + K_CEIL) >> K_SHIFT
    exponent = (need >> 23) - 127 + (k >> STEP_BITS)
    k = k & K_MASK
    top = tl.max(exponent, axis=1)  # E (padding groups have the least exponent, -126)
    floor = top[:, None] - SPAN
    k = tl.where(exponent < floor, 0, k)  # a group further below takes the step 2^(E - 31)
    exponent = tl.maximum(exponent, floor)
    step = (((exponent + 127) << 23) | (k << K_SHIFT)).to(tl.float32, bitcast=True)  # exact: e >= -126

    # codes rint(y / step) + 2^(b - 1): adding 1.5 * 2^23 + 2^(b - 1) (even) rounds q to an integer n, ties to
    # even, leaving the bits 0x4B400000 + n + 2^(b - 1). No clamp: step >= need >= max |y| / M (1 - 2^-24), so
    # |q| <= M (1 + 2^-23) rounds to at most M.
    q = tl.math.div_rn(y, step[:, :, None])
    codes = (q + (ROUNDER + (1 << (BITS - 1)))).to(tl.int32, bitcast=True) - 0x4B400000
    # 8 codes in one little-endian word of BITS bytes, code i in bits [i BITS, (i + 1) BITS)
    codes = tl.reshape(codes, (BLOCK_T, GROUPS_P2, G // 8, 8)).to(tl.int64)
    shifts = (tl.arange(0, 8) * BITS).to(tl.int64)[None, None, None, :]
    words = tl.sum(codes << shifts, axis=3)
    byte = tl.arange(0, 8)[None, None, None, :]
    packed = ((words[:, :, :, None] >> (byte * 8)) & 0xFF).to(tl.uint8)
    tl.store(
        out_ptr + _code_offsets(token, GROUPS, GROUPS_P2, G, BITS),
        packed,
        mask=group_ok[:, :, None, None] & (byte < BITS),
    )
    scale_bytes = ((top[:, None] - exponent) << STEP_BITS) | k  # (E - e) << 3 | k
    row = token.to(tl.int64) * TOKEN_BYTES
    tl.store(out_ptr + row[:, None] + 1 + group[None, :], scale_bytes.to(tl.uint8), mask=group_ok)
    exponent_byte = tl.where(finite, top + 127, NONFINITE_BYTE)
    tl.store(out_ptr + row, exponent_byte.to(tl.uint8), mask=token < tokens)


@triton.jit
def _decompress_kernel(
    buf_ptr,  # [tokens * TOKEN_BYTES] uint8: the message
    out_ptr,  # [tokens, GROUPS * G] fp32, bf16 or fp16, unit column stride
    tokens,
    out_row_stride,
    G: tl.constexpr,  # values per group: 32, or 16 where the width is not a multiple of 32
    GROUPS: tl.constexpr,  # groups per token
    GROUPS_P2: tl.constexpr,  # GROUPS rounded up to a power of two (the tile's axis)
    BLOCK_T: tl.constexpr,  # tokens per program
    BITS: tl.constexpr,  # bits per code: 5 or 6
    INV_SQRT_G: tl.constexpr,  # G^-0.5 rounded to fp32
    OUT_MANTISSA_BITS: tl.constexpr,  # the output's grid (``kernels._round_to_grid``), for the interpreter
    OUT_MIN_NORMAL: tl.constexpr,
    OUT_SUBNORMAL_SHIFTER: tl.constexpr,
    HW_ROUNDING: tl.constexpr,  # True on a GPU: the cast to the output's dtype rounds to nearest even in hardware
):
    """The rows of tokens [pid * BLOCK_T, (pid + 1) * BLOCK_T) -> their values: H (codes * steps) / sqrt(G) in
    fp32, NaN for a token whose exponent byte is 255, cast to the output's dtype."""
    TOKEN_BYTES: tl.constexpr = 1 + GROUPS + GROUPS * G * BITS // 8
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = token < tokens
    group = tl.arange(0, GROUPS_P2)
    group_ok = token_ok[:, None] & (group < GROUPS)[None, :]
    row = token.to(tl.int64) * TOKEN_BYTES
    top = tl.load(buf_ptr + row, mask=token_ok, other=0).to(tl.int32)  # E + 127
    scale_bytes = tl.load(buf_ptr + row[:, None] + 1 + group[None, :], mask=group_ok, other=0).to(tl.int32)

    # step = ldexp(1 + k / 8, e), torch's (1 + k / 8) * pow(2, e) with one rounding: 2^e is exact from its bits,
    # normal down to 2^-126, subnormal down to 2^-149, then 0 (e < -126 only in rows compress does not write)
    e = top[:, None] - 127 - (scale_bytes >> STEP_BITS)
    subnormal = tl.where(e >= -149, 1 << tl.maximum(e + 149, 0), 0)
    power = tl.where(e >= -126, (e + 127) << 23, subnormal).to(tl.float32, bitcast=True)
    step = (1.0 + (scale_bytes & K_MASK).to(tl.float32) * K_UNIT) * power

    # 8 codes from each little-endian word of BITS bytes, code i in bits [i BITS, (i + 1) BITS), less 2^(b - 1)
    byte = tl.arange(0, 8)[None, None, None, :]
    packed = tl.load(
        buf_ptr + _code_offsets(token, GROUPS, GROUPS_P2, G, BITS),
        mask=group_ok[:, :, None, None] & (byte < BITS),
        other=0,
    )
    words = tl.sum(packed.to(tl.int64) << (byte * 8).to(tl.int64), axis=3)
    codes = (words[:, :, :, None] >> (byte * BITS).to(tl.int64)) & ((1 << BITS) - 1)
    codes = tl.reshape(codes, (BLOCK_T, GROUPS_P2, G)).to(tl.int32) - (1 << (BITS - 1))

    values = _rotate(codes.to(tl.float32) * step[:, :, None], BLOCK_T, GROUPS_P2, G, INV_SQRT_G)
    values = tl.where((top == NONFINITE_BYTE)[:, None, None], float("nan"), values)
    if OUT_MANTISSA_BITS < 23 and not HW_ROUNDING:  # bf16 / fp16 output: the interpreter's cast truncates
        values = _round_to_grid(values, OUT_MANTISSA_BITS, OUT_MIN_NORMAL, OUT_SUBNORMAL_SHIFTER)
    offsets = _offsets(token, out_row_stride, GROUPS_P2, G)
    mask = group_ok[:, :, None]
    if out_ptr.dtype.element_ty == tl.bfloat16 and not HW_ROUNDING:  # the rounded fp32's top half, as bits (the
        # interpreter's cast stores bf16 subnormals inexactly)
        bits = (values.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)
        tl.store(out_ptr.to(tl.pointer_type(tl.uint16)) + offsets, bits, mask=mask)
    else:
        tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _launch(width: int, bits: int, tokens_p2: int, on_gpu: bool) -> dict:
    """The constexprs and launch options for tokens of ``width`` values in ``bits``-bit codes, ``tokens_p2`` (the
    call's token count rounded up to a power of two) capping the tokens per program."""
    codec = _codec(width, bits)
    groups_p2 = triton.next_power_of_2(codec.groups)
    block_t = max(1, min(TILE // (groups_p2 * codec.group), tokens_p2))
    elements = block_t * groups_p2 * codec.group
    return dict(
        G=codec.group,
        GROUPS=codec.groups,
        GROUPS_P2=groups_p2,
        BLOCK_T=block_t,
        BITS=bits,
        INV_SQRT_G=float(torch.tensor(codec.group**-0.5, dtype=torch.float32)),
        **(dict(num_warps=min(16, max(4, elements // 512)), enable_fp_fusion=False) if on_gpu else {}),
    )


def _on(device: torch.device):
    """Launches on ``device``'s GPU (not the current one), or nothing to do on the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _tokens_p2(tokens: int) -> int:
    """``tokens`` rounded up to a power of two."""
    return 1 << max(0, tokens - 1).bit_length()


def _tokens_checked(function: str, values: torch.Tensor, message: torch.Tensor, width: int, bits: int) -> int:
    """The token count, after checking what the kernels address: ``values`` [tokens, width] with unit column stride
    and ``message`` contiguous uint8 [tokens * token_bytes], on one device."""
    tokens = values.shape[0]
    if values.shape[1:] != (width,) or values.stride(1) != 1:
        raise ValueError(f"{function}: values must be [tokens, {width}], unit column stride; got {tuple(values.shape)}")
    nbytes = tokens * _codec(width, bits).token_bytes
    if message.dtype != torch.uint8 or message.shape != (nbytes,) or message.stride() != (1,):
        raise ValueError(
            f"{function}: the message must be contiguous uint8 [{nbytes}]; got {message.dtype} {tuple(message.shape)}"
        )
    if message.device != values.device:
        raise ValueError(f"{function}: the message is on {message.device}, the values on {values.device}")
    return tokens


def compress_rows(x: torch.Tensor, out: torch.Tensor, width: int, bits: int) -> None:
    """``out`` (uint8 [tokens * token_bytes]) <- the message of the tokens ``x`` [tokens, width] (fp32, bf16 or
    fp16, unit column stride): the bytes ``NarrowIntCodec(width, bits).compress(x)`` returns."""
    tokens = _tokens_checked("compress_rows", x, out, width, bits)
    if tokens == 0:
        return
    constants = _launch(width, bits, _tokens_p2(tokens), x.is_cuda)
    with _on(x.device):
        _compress_kernel[(_cdiv(tokens, constants["BLOCK_T"]),)](x, out, tokens, x.stride(0), **constants)


def decompress_rows(buf: torch.Tensor, out: torch.Tensor, width: int, bits: int) -> None:
    """``out`` [tokens, width] (fp32, bf16 or fp16, unit column stride) <- the tokens of the message ``buf`` (uint8
    [tokens * token_bytes]): ``NarrowIntCodec(width, bits).decompress(buf, out.shape, out.dtype, validate=False)``.
    The codes are not checked (the torch path checks the first message)."""
    if out.dtype not in _OUTPUT_GRIDS:
        raise ValueError(f"decompress_rows: out must be fp32, bf16 or fp16, got {out.dtype}")
    tokens = _tokens_checked("decompress_rows", out, buf, width, bits)
    if tokens == 0:
        return
    constants = _launch(width, bits, _tokens_p2(tokens), buf.is_cuda)
    with _on(buf.device):
        _decompress_kernel[(_cdiv(tokens, constants["BLOCK_T"]),)](
            buf,
            out,
            tokens,
            out.stride(0),
            HW_ROUNDING=buf.is_cuda,
            **_grid_constants(*_OUTPUT_GRIDS[out.dtype], prefix="OUT_"),
            **constants,
        )
