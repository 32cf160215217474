"""Fused Triton kernels of the TACO codec: compress, and decompress-and-sum.

They execute the same IEEE fp32 operations, in the same order, as the torch
reference (:mod:`megatron_taco.codec.reference`), so they write the same bytes:

* sums are pairwise trees over adjacent elements (``_pairwise_sum``);
* the Walsh-Hadamard transform (``_fwht``) runs the in-place butterfly stages on index bit 0, 1, ...,
  log2(G) - 1 (stage b maps the pair (i, i + 2^b) to (a + b, a - b)): the same additions, on the same
  operands, as the reference's constant-geometry butterfly, which only stores them in another order;
* divisions and square roots are IEEE-rounded (``div_rn``, ``sqrt_rn``), and
  kernels launch with ``enable_fp_fusion=False`` so no multiply is fused
  into an add;
* narrowing casts (fp32 -> FP8, bf16, fp16) round to nearest even: on a GPU the hardware conversion does
  (``HW_ROUNDING``); Triton's CPU interpreter rounds fp32 -> fp8 wrongly (it loses the carry across a
  binade and truncates subnormals), so there the value is first rounded to the target grid in fp32
  (``_round_to_grid``) and then converts exactly; FP4 E2M1 codes come from |q| rounded in
  integer and fp32 arithmetic (``_e2m1_codes``), ties to the even code; INT8 / INT4 codes from the exact
  product rounded once to an integer (``_integer_biased``).

One program handles BLOCK_G consecutive groups of G elements: a [BLOCK_G, G]
tile, loaded once and written once (a single pass over the input). Each thread holds E contiguous elements
of one group (the launch's elements per thread; THREADS = G / E threads share a group), read and written as
accesses of 16 contiguous bytes of each tensor it reads (X_VEC input elements, CODE_VEC codes). A
butterfly stage on an index bit inside a thread is one addition per element, with no exchange between threads:
with E = 32, five of the seven stages of G = 128. Each tensor moves through memory as [THREADS, BLOCK_G, K, VEC]
(``_tile_offsets``), BLOCK_G = 32 * warps / THREADS: Triton lays a warp's lanes along axis 0, then axis 1
(the axes whose addresses are not contiguous are taken in index order), so the lanes and warps cover the
first two axes exactly and the third stays in each thread's registers. Triton 3.6 (the H200 machine's)
compiles it so; 3.9 moves parts through shared memory (benchmarks/results/logs/kernels_exploration_2026-12-01/
sass_counts.log). A layout changes the speed, never the bytes.
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch
import triton
import triton.language as tl

from megatron_taco.codec import reference
from megatron_taco.codec.format import NAN_CODE, CodecSettings, header_words

__all__ = ["LAUNCH_CONFIG", "compress_rows", "decompress_rows", "transform_rows"]

_SCALE_MODE_IDS = {"fp32": 0, "dual": 1, "e8m0": 2, "e4m3": 3}
SCALE_FLOOR = tl.constexpr(2.0**reference.SCALE_FLOOR_EXPONENT)  # s_q >= this with fp32 / dual scales
MESSAGE_SCALE_FLOOR = tl.constexpr(2.0**reference.MESSAGE_SCALE_FLOOR_EXPONENT)  # S >= this with e4m3 scales
# 1.5 * 2^23 (+ 8): fp32 values in [2^23, 2^24) are the integers, so adding it to |q| < 2^22 rounds q to an integer n
# (ties to even: the constant is even) and leaves the bits 0x4B400000 + n (INT8: the low byte is n's two's
# complement) or 0x4B400008 + n (INT4: the low nibble is n + 8)
INT8_BIAS = tl.constexpr(12582912.0)
INT4_BIAS = tl.constexpr(12582920.0)
# GPU launch shape, per kernel: (warps, elements per thread E; at least one access, at most G). Chosen from the sweep
# in benchmarks/kernels.py (see benchmarks/results/kernels.md).
LAUNCH_CONFIG = {"compress": (2, 32), "decompress_sum": (2, 32)}


@triton.jit
def _tile_offsets(groups, UNITS: tl.constexpr, THREADS: tl.constexpr, W: tl.constexpr):
    """Offsets [THREADS, BLOCK_G, K, W] of the groups' units (elements, or packed bytes), UNITS per group:
    thread t of a group holds units [t * K * W, (t + 1) * K * W) as K accesses of W contiguous units."""
    K: tl.constexpr = UNITS // (THREADS * W)
    t = tl.arange(0, THREADS)[:, None, None, None] * (K * W)
    k = tl.arange(0, K)[None, None, :, None] * W
    c = tl.arange(0, W)[None, None, None, :]
    return groups.to(tl.int64)[None, :, None, None] * UNITS + (t + k + c)


@triton.jit
def _to_rows(v, BLOCK_G: tl.constexpr, UNITS: tl.constexpr):
    """A tile in memory order [THREADS, BLOCK_G, K, W] -> [BLOCK_G, UNITS], each group's units in order."""
    return tl.reshape(tl.permute(v, (1, 0, 2, 3)), (BLOCK_G, UNITS))


@triton.jit
def _to_tile(v, BLOCK_G: tl.constexpr, UNITS: tl.constexpr, THREADS: tl.constexpr, W: tl.constexpr):
    """[BLOCK_G, UNITS] -> the memory order [THREADS, BLOCK_G, K, W] of ``_tile_offsets`` (``_to_rows`` undone)."""
    return tl.permute(tl.reshape(v, (BLOCK_G, THREADS, UNITS // (THREADS * W), W)), (1, 0, 2, 3))


@triton.jit
def _load_groups(
    x_ptr,
    groups,
    numel,
    BLOCK_G: tl.constexpr,
    G: tl.constexpr,
    THREADS: tl.constexpr,
    X_VEC: tl.constexpr,
    X_WORDS: tl.constexpr,
):
    """The groups' input elements as fp32 [BLOCK_G, G], zero past ``numel``.

    X_WORDS (bf16 input, rows 4-byte aligned, ``numel`` even): read as 32-bit words of two elements and widened
    with one bit operation each, element 2j = word << 16 and 2j + 1 = word & 0xFFFF0000 (bf16 is fp32's top half),
    where the cast took 1.5 instructions per element (a byte permute and a shift for each high half)."""
    if X_WORDS:
        offsets = _tile_offsets(groups, G // 2, THREADS, X_VEC // 2)
        words = tl.load(x_ptr.to(tl.pointer_type(tl.uint32)) + offsets, mask=offsets < numel // 2, other=0)
        even = (words << 16).to(tl.float32, bitcast=True)
        odd = (words & 0xFFFF0000).to(tl.float32, bitcast=True)
        x = tl.reshape(tl.join(even, odd), (THREADS, BLOCK_G, G // (THREADS * X_VEC), X_VEC))
    else:
        offsets = _tile_offsets(groups, G, THREADS, X_VEC)
        if x_ptr.dtype.element_ty == tl.bfloat16:  # as bits, the same widening (the interpreter's cast of bf16
            # subnormals is inexact, and would make its bytes depend on the rows' alignment)
            bits = tl.load(x_ptr.to(tl.pointer_type(tl.uint16)) + offsets, mask=offsets < numel, other=0)
            x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
    return _to_rows(x, BLOCK_G, G)


@triton.jit
def _pack_nibble_words(values, BLOCK_G: tl.constexpr, G: tl.constexpr):
    """[BLOCK_G, G] uint32 -> [BLOCK_G, G / 8] uint32: sum of values[8w + i] << 4i, wrapping (element 8w in the
    low nibble, as the wire's bytes 4w..4w+3 read little-endian). Three levels of v_lo + (v_hi << k), one
    shift-and-add (LEA) each per pair: 7 instructions per 8 elements. A value's bits above its nibble carry
    into the next nibbles; a caller whose values are c_i + B (c_i < 16, B the same for all) subtracts
    B * 0x11111111 once per word."""
    v = tl.reshape(values, (BLOCK_G, G // 2, 2))
    lo, hi = tl.split(v)
    v = tl.reshape(lo + (hi << 4), (BLOCK_G, G // 4, 2))
    lo, hi = tl.split(v)
    v = tl.reshape(lo + (hi << 8), (BLOCK_G, G // 8, 2))
    lo, hi = tl.split(v)
    return lo + (hi << 16)


@triton.jit
def _word_bytes(words):
    """words [..., n] -> [..., n, 2, 2]: each word's 4 bytes in little-endian order, by joins (in each thread's
    registers), each in the low 8 bits of its value with the word's higher bits left above it (a cast to uint8, or
    a caller that reads only the low bits, drops them)."""
    halves = tl.join(words, words >> 16)
    return tl.join(halves, halves >> 8)


@triton.jit
def _pairwise_sum(v, BLOCK_G: tl.constexpr, G: tl.constexpr, LOG2G: tl.constexpr):
    """[BLOCK_G, G] -> [BLOCK_G]: v[2i] + v[2i+1], repeated log2(G) times."""
    for stage in tl.static_range(LOG2G):
        v = tl.reshape(v, (BLOCK_G, G >> (stage + 1), 2))
        even, odd = tl.split(v)
        v = even + odd
    return tl.reshape(v, (BLOCK_G,))


@triton.jit
def _fwht(v, BLOCK_G: tl.constexpr, G: tl.constexpr, LOG2G: tl.constexpr):
    """Unnormalised Walsh-Hadamard transform along axis 1 (Sylvester order), in-place butterflies.

    Stage b views each group as [G / 2^(b+1), 2, 2^b] and replaces the pair (a, b) on the size-2 axis by
    (a + b, a - b): each element fetches its partner once (``tl.flip`` of the pair axis, an exchange of bits:
    exact) and adds itself times +1, or -1 in the upper half, in one fused multiply-add: fma(a, 1, b) = b + a
    = a + b and fma(b, -1, a) = a - b, each rounded once as the reference's addition is (the product by +-1
    is exact). No permute of the tile. Where a pair sits in two threads that is one exchange and one
    instruction per element (a select of -v and an add before).
    """
    sign = tl.where(tl.arange(0, 2) == 1, -1.0, 1.0)[None, :, None]  # -1 on the second element of each pair
    for b in tl.static_range(LOG2G):
        pairs = tl.reshape(v, (BLOCK_G * (G // (2 << b)), 2, 1 << b))
        pairs = tl.fma(pairs, sign, tl.flip(pairs, 1))
        v = tl.reshape(pairs, (BLOCK_G, G))
    return v


@triton.jit
def _round_to_grid(x, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_SHIFTER: tl.constexpr):
    """Round fp32 to the nearest value of a narrower float format (ties to even), keeping the sign.

    Used for FP8 codes and for bf16/fp16 outputs; finite values of the target's range are
    rounded, NaN and Inf pass through unchanged.

    Normal range: round the fp32 mantissa to MANTISSA_BITS with integer arithmetic.
    Subnormal range: adding SUBNORMAL_SHIFTER (1.5 * 2^k, whose ulp is the FP8
    subnormal step) makes the fp32 adder round to that step.
    Non-finite: NVIDIA's NaN is 0x7FFFFFFF, whose mantissa round-up would carry into
    the sign bit (NaN -> -0.0), so values with an all-ones exponent are kept as they are.
    """
    DROP: tl.constexpr = 23 - MANTISSA_BITS
    HALF_MINUS_ONE: tl.constexpr = (1 << (DROP - 1)) - 1
    KEEP: tl.constexpr = 0xFFFFFFFF ^ ((1 << DROP) - 1)
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    magnitude = bits & 0x7FFFFFFF
    lsb = (magnitude >> DROP) & 1
    normal = (magnitude + HALF_MINUS_ONE + lsb) & KEEP
    ax = magnitude.to(tl.float32, bitcast=True)
    subnormal = ((ax + SUBNORMAL_SHIFTER) - SUBNORMAL_SHIFTER).to(tl.uint32, bitcast=True)
    rounded = tl.where(ax < MIN_NORMAL, subnormal, normal)
    rounded = tl.where(magnitude >= 0x7F800000, magnitude, rounded)  # NaN / Inf unchanged
    return (rounded | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_codes(a, signed):
    """4-bit E2M1 codes (s|ee|m) of a = |q| (<= 6) rounded to nearest on the grid 0, 0.5, 1, 1.5, 2, 3, 4, 6,
    ties to the even code (``reference._four_bit_codes``), with the sign bit of ``signed`` (q's, -0.0
    included). From 1 up the code is a's exponent and top mantissa bit after rounding the mantissa to 1 bit
    (integer arithmetic, ties to even; a carry moves to the next exponent): (biased exponent << 1 | m) - 252.
    Below 1 it is 2a rounded to an integer, ties to even (one fused multiply-add with 1.5 * 2^23: 2a is exact,
    so one rounding: 0, 1 or 2, the last being 1.0's code)."""
    bits = a.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252
    below_one = tl.fma(a, 2.0, 12582912.0).to(tl.uint32, bitcast=True) & 0x3
    magnitude = tl.where(a < 1.0, below_one, normal).to(tl.int32)
    sign = ((signed.to(tl.uint32, bitcast=True) >> 28) & 8).to(tl.int32)
    return magnitude | sign


@triton.jit
def _integer_biased(a, b, BIAS: tl.constexpr, HW_ROUNDING: tl.constexpr):
    """rint(a * b) + BIAS in fp32 (INT8_BIAS or INT4_BIAS): the exact product rounded once to an
    integer (ties to even), in one fused multiply-add (``reference._integer_codes``). The interpreter's fma may round
    twice, so there in fp64, where the product of two fp32 is exact and adding 1.5 * 2^52 rounds it to an integer."""
    if HW_ROUNDING:
        return tl.fma(a, b, BIAS)
    product = a.to(tl.float64) * b.to(tl.float64)
    return ((product + 6755399441055744.0) - 6755399441055744.0).to(tl.float32) + BIAS


@triton.jit
def _uniform_noise(index):
    """u in [0, 1) from int64 ``index`` (0..2^32-1): lowbias32 in wrapping 64-bit products masked to 32 bits,
    then its top 24 bits (``reference.uniform_noise``)."""
    x = index ^ (index >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return (x >> 8).to(tl.float32) * (1.0 / (1 << 24))


@triton.jit
def _stochastic_magnitude(a, u, INTEGER: tl.constexpr, MAX: tl.constexpr):
    """|q| rounded down or up to the 4-bit grid at random (``reference._stochastic_magnitude``)."""
    if INTEGER:
        rounded = tl.floor(a + u)
    else:
        inverse_step = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
        step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
        rounded = tl.floor(a * inverse_step + u) * step
    return tl.minimum(rounded, MAX)  # INT4: 7 + u rounds to 8.0 in fp32 for u > 1 - 2^-22 (nibble 8 is -8)


@triton.jit
def _four_bit_values(codes, INTEGER: tl.constexpr):
    """fp32 values of 4-bit codes in the low 4 bits of 32-bit ``codes`` (bits above ignored): INT4 two's
    complement (sign-extended from bit 3: one bit-field extract), or E2M1 (``reference.code_values``)."""
    if INTEGER:
        return ((codes.to(tl.int32, bitcast=True) << 28) >> 28).to(tl.float32)
    # s|ee|m into an fp32's sign, the bottom of its exponent and the top of its mantissa: 2^(e - 127) (1 + m / 2)
    # = value * 2^-126 for e > 0, and the subnormal m 2^-127 = value * 2^-126 for e = 0; times 2^126, exact
    bits = ((codes & 7) << 22) | ((codes & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37


@triton.jit
def _max_keeping_nan(a, b):
    """max(a, b), NaN if either is (a GPU's plain max returns the other operand)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _transform_and_amax(
    x,
    eps,
    G: tl.constexpr,
    LOG2G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    ASH: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INV_SQRT_G: tl.constexpr,
):
    """(h, m, s_a, amax, nonfinite) of a [BLOCK_G, G] tile (``reference._transform_groups``): h = H(x) (x without
    the transform) and the per-group multiplier m of the transformed groups y = h * m (1 / sqrt(G), times s_a in
    the paper's dual-scale form; 1 without the transform), per group max |y| = max |h| * m (one rounding per group:
    rounding is monotonic; 0 for a non-finite group) and whether y holds NaN or Inf."""
    fp8_max = tl.full((BLOCK_G,), FP8_MAX, tl.float32)
    s_a = tl.full((BLOCK_G,), 1.0, tl.float32)
    multiplier = tl.full((BLOCK_G,), 1.0, tl.float32)
    h = x
    if ASH:
        multiplier = tl.full((BLOCK_G,), INV_SQRT_G, tl.float32)
        if SCALE_MODE == 1:
            mean_square = _pairwise_sum(x * x, BLOCK_G, G, LOG2G) * (1.0 / G)
            rms = tl.sqrt_rn(mean_square + eps)
            raw = tl.math.div_rn(fp8_max, rms)
            # clamp, with one NaN bit pattern for NaN as in the reference (GPU min/max drop NaN)
            s_a = tl.where(raw != raw, float("nan"), tl.minimum(tl.maximum(raw, 1e-3), 1e3))
            multiplier = s_a * INV_SQRT_G
        h = _fwht(x, BLOCK_G, G, LOG2G)
    # max |y|, NaN if any is: a group is non-finite iff that max is Inf (an overflow of h * m included) or NaN.
    amax = tl.reduce(tl.abs(h), 1, _max_keeping_nan) * multiplier
    nonfinite = (amax == float("inf")) | (amax != amax)
    amax = tl.where(nonfinite, 0.0, amax)
    return h, multiplier, s_a, amax, nonfinite


@triton.jit
def _first_pass_kernel(
    x_ptr,
    out_ptr,
    x_row_stride,
    numel,
    n_groups,
    eps,
    G: tl.constexpr,
    LOG2G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    ASH: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INV_SQRT_G: tl.constexpr,
    WRITE_Y: tl.constexpr,  # True: out = y [R, n_groups * G]; False: out = per-group max [R, n_groups]
    THREADS: tl.constexpr,  # threads per group (``_tile_offsets``)
    X_VEC: tl.constexpr,  # input elements per access (16 bytes)
    X_WORDS: tl.constexpr,  # bf16 input read as words of two elements (``_load_groups``)
    Y_VEC: tl.constexpr,  # fp32 outputs per access (4)
):
    """What the compress kernel computes before its scale, written out for a pass that needs it first.

    WRITE_Y=False: out[row, group] = max |y| of the group (0 if non-finite): the first pass of scales="e4m3",
    whose message scale needs the whole row's maximum before any group is quantized.
    WRITE_Y=True: out[row] = y (H(x) / sqrt(G) with ASH, else x) in fp32, zero-padded to whole groups, NaN over
    every group that holds a NaN or an Inf: what another encoder (Transformer Engine's cast) quantizes.
    """
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    groups = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    x = _load_groups(x_ptr + row * x_row_stride, groups, numel, BLOCK_G, G, THREADS, X_VEC, X_WORDS)
    h, multiplier, _, amax, nonfinite = _transform_and_amax(
        x, eps, G, LOG2G, BLOCK_G, ASH, SCALE_MODE, FP8_MAX, INV_SQRT_G
    )
    if WRITE_Y:
        y = _to_tile(tl.where(nonfinite[:, None], float("nan"), h * multiplier[:, None]), BLOCK_G, G, THREADS, Y_VEC)
        tl.store(
            out_ptr + row * n_groups * G + _tile_offsets(groups, G, THREADS, Y_VEC),
            y,
            mask=(groups < n_groups)[None, :, None, None],
        )
    else:
        tl.store(out_ptr + row * n_groups + groups, amax, mask=groups < n_groups)


@triton.jit
def _compress_kernel(
    x_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    numel,
    n_groups,
    scales_offset,
    head0,
    head1,
    head2,
    head3,
    eps,
    seed,  # stochastic rounding: this call's seed (``TacoCodec.compress_rows``)
    row_amax_ptr,  # scales="e4m3": each row's max |y| (the first pass); unused otherwise
    G: tl.constexpr,
    LOG2G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    ASH: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    CODE_KIND: tl.constexpr,  # 0: FP8 E4M3, 1: FP8 E5M2, 2: FP4 E2M1, 3: INT4, 4: INT8
    STOCHASTIC: tl.constexpr,  # 4-bit codes: round up with probability equal to the distance (else nearest)
    FP8_MAX: tl.constexpr,  # the element format's largest value M (448, 57344, 6, 7, 127)
    MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUBNORMAL_SHIFTER: tl.constexpr,
    INV_SQRT_G: tl.constexpr,
    NAN_BYTE: tl.constexpr,
    E4M3_MIN_NORMAL: tl.constexpr,  # the E4M3 grid of scales="e4m3"'s group bytes
    E4M3_SUBNORMAL_SHIFTER: tl.constexpr,
    HW_ROUNDING: tl.constexpr,  # True on a GPU: casts round to nearest even in hardware (else _round_to_grid)
    THREADS: tl.constexpr,  # threads per group (``_tile_offsets``)
    X_VEC: tl.constexpr,  # input elements per access (16 bytes)
    X_WORDS: tl.constexpr,  # bf16 input read as words of two elements (``_load_groups``)
    CODE_VEC: tl.constexpr,  # codes per access (16 bytes; at most G)
    CODE_WORDS: tl.constexpr,  # 4-bit codes stored as 32-bit words (output rows 4-byte aligned)
):
    """Row program_id(1) of x (``numel`` elements each) -> row program_id(1) of out (one message each)."""
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    x_ptr += row * x_row_stride
    out_ptr += row * out_row_stride
    if pid == 0:  # the 16-byte header (magic, settings, element count), bytewise: rows need no alignment
        index = tl.arange(0, 16)
        word = tl.where(index < 4, head0, tl.where(index < 8, head1, tl.where(index < 12, head2, head3)))
        tl.store(out_ptr + index, ((word >> ((index % 4) * 8)) & 0xFF).to(tl.uint8))

    groups = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    group_ok = groups < n_groups
    x = _load_groups(x_ptr, groups, numel, BLOCK_G, G, THREADS, X_VEC, X_WORDS)
    fp8_max = tl.full((BLOCK_G,), FP8_MAX, tl.float32)

    h, multiplier, s_a, amax, nonfinite = _transform_and_amax(
        x, eps, G, LOG2G, BLOCK_G, ASH, SCALE_MODE, FP8_MAX, INV_SQRT_G
    )

    # Quantization scale: s_q = amax / M, its power-of-two ceiling 2^e for E8M0, or an E4M3 byte times the
    # message scale S = (max over the row) / (M * 448) for "e4m3" (``reference._e4m3_scaled``).
    if SCALE_MODE == 3:
        row_amax = tl.load(row_amax_ptr + row)
        floored_row = tl.maximum(row_amax, FP8_MAX * 448.0 * MESSAGE_SCALE_FLOOR)  # 1 / s_g stays finite
        message_scale = tl.where(row_amax > 0, tl.math.div_rn(floored_row, FP8_MAX * 448.0), 1.0)
        ratio = tl.minimum(tl.math.div_rn(tl.math.div_rn(amax, fp8_max), message_scale), 448.0)
        if not HW_ROUNDING:
            ratio = _round_to_grid(ratio, 3, E4M3_MIN_NORMAL, E4M3_SUBNORMAL_SHIFTER)
        group_bytes = tl.where(nonfinite, NAN_BYTE, ratio.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
        group_scale = group_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * message_scale
        inverse = tl.where(group_scale > 0, tl.math.div_rn(tl.full((BLOCK_G,), 1.0, tl.float32), group_scale), 0.0)
    elif SCALE_MODE == 2:
        need_bits = tl.math.div_rn(amax, fp8_max).to(tl.int32, bitcast=True)
        exponent = ((need_bits >> 23) & 0xFF) - 127 + ((need_bits & 0x7FFFFF) != 0).to(tl.int32)
        exponent = tl.minimum(tl.maximum(exponent, -126), 126)
        inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    else:
        floored = tl.maximum(amax, fp8_max * SCALE_FLOOR)  # M / amax stays finite (``reference.SCALE_FLOOR_EXPONENT``)
        s_q = tl.where(amax > 0, tl.math.div_rn(floored, fp8_max), 1.0)
        s_q = tl.where(nonfinite, float("nan"), s_q)
        inverse = tl.where(amax > 0, tl.math.div_rn(fp8_max, floored), 1.0)  # one IEEE division per group
    # one multiply per element by the group's m * inverse (rounded once per group; dual: y = h * m first, as m *
    # inverse can overflow there); NaN over a non-finite group, which a GPU's FP8 cast writes as NAN_BYTE
    if SCALE_MODE == 1:
        a = h * multiplier[:, None]
        b = tl.where(nonfinite, float("nan"), inverse)
    else:
        a = h
        b = tl.where(nonfinite, float("nan"), multiplier * inverse)
    if CODE_KIND == 4:
        # INT8 to nearest, as INT4 below: the bits 0x4B400000 + rint(q), |rint(q)| <= M = 127 (no clamp: the
        # scale is at least amax / M), whose low byte is rint(q)'s two's complement. A non-finite group's codes are
        # zeros, stored over them below (its NaN scale decodes it to NaN).
        codes = _integer_biased(a, b[:, None], INT8_BIAS, HW_ROUNDING).to(tl.uint32, bitcast=True).to(tl.uint8)
    elif CODE_KIND == 3 and not STOCHASTIC:
        # INT4 to nearest: t = rint(a * b) + 1.5 * 2^23 + 8 (one fused multiply-add), bits 0x4B400008 + rint(q):
        # 8 + the code's value in the low nibble. Clamped to +-M in t where the scale can round down (e4m3:
        # rounding is monotonic and M an integer); with a scale of at least amax / M (fp32, dual: s_q = max(amax,
        # M 2^-126) / M; e8m0: its power-of-two ceiling) |q| <= M (1 + 2^-22), which rounds to +-M.
        t = _integer_biased(a, b[:, None], INT4_BIAS, HW_ROUNDING)
        if SCALE_MODE == 3:
            t = tl.minimum(tl.maximum(t, INT4_BIAS - FP8_MAX), INT4_BIAS + FP8_MAX)
        # the bits are 0x4B400000 + (n + 8): packed, the 0x4B400000 of every nibble sums to 0x3F400000 (mod 2^32),
        # and n + 8 xor 8 is n's two's complement nibble
        words = (_pack_nibble_words(t.to(tl.uint32, bitcast=True), BLOCK_G, G) - 0x3F400000) ^ 0x88888888
    else:
        q = a * b[:, None]
        # No clamp where none can change a code: a GPU's FP8 cast saturates (satfinite) to the same +-M; E2M1
        # rounded to nearest takes min(|q|, M) below.
        if (CODE_KIND >= 2 or not HW_ROUNDING) and not (CODE_KIND == 2 and not STOCHASTIC):
            q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
        if STOCHASTIC:
            offsets = _to_rows(_tile_offsets(groups, G, THREADS, X_VEC), BLOCK_G, G)
            index = (row * (n_groups * G) + offsets) & 0xFFFFFFFF  # element of this call, rows padded to groups
            magnitude = _stochastic_magnitude(tl.abs(q), _uniform_noise(index ^ seed), CODE_KIND == 3, FP8_MAX)
            if CODE_KIND == 3:
                nibbles = tl.where(q < 0, -magnitude, magnitude).to(tl.int32) & 0xF
            else:  # the sign bit straight from q's bits (the H200's mismatches fit +0 codes from a select on q < 0)
                nibbles = _e2m1_codes(magnitude, q)
            words = _pack_nibble_words(nibbles.to(tl.uint32), BLOCK_G, G)
        elif CODE_KIND == 2:  # |clamp(q, -M, M)| in one instruction, the sign from q
            words = _pack_nibble_words(_e2m1_codes(tl.minimum(tl.abs(q), FP8_MAX), q).to(tl.uint32), BLOCK_G, G)
    if CODE_KIND == 2 or CODE_KIND == 3:  # words of 8 codes; a non-finite group's NaN scale decodes it to NaN
        # a non-finite group's codes are zeros: the same thread stores them over its own (a store predicated per
        # group, in program order), one instruction per thread where a select per byte cost 16
        words = _to_tile(words, BLOCK_G, G // 8, THREADS, CODE_VEC // 8)
        if CODE_WORDS:  # rows 4-byte aligned: the words as they are
            word_offsets = _tile_offsets(groups, G // 8, THREADS, CODE_VEC // 8)
            word_ptr = (out_ptr + 16).to(tl.pointer_type(tl.uint32))
            tl.store(word_ptr + word_offsets, words, mask=group_ok[None, :, None, None])
            tl.store(word_ptr + word_offsets, tl.zeros_like(words), mask=(group_ok & nonfinite)[None, :, None, None])
        else:  # bytewise: the words' 4 bytes, little-endian
            shape: tl.constexpr = (THREADS, BLOCK_G, G // (THREADS * CODE_VEC), CODE_VEC // 2)
            packed = tl.reshape(_word_bytes(words), shape).to(tl.uint8)
            packed_offsets = _tile_offsets(groups, G // 2, THREADS, CODE_VEC // 2)
            tl.store(out_ptr + 16 + packed_offsets, packed, mask=group_ok[None, :, None, None])
            tl.store(
                out_ptr + 16 + packed_offsets, tl.zeros_like(packed), mask=(group_ok & nonfinite)[None, :, None, None]
            )
    else:  # one byte per code
        if CODE_KIND != 4:
            if not HW_ROUNDING:
                q = _round_to_grid(q, MANTISSA_BITS, MIN_NORMAL, SUBNORMAL_SHIFTER)
            if CODE_KIND == 0:
                codes = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            else:
                codes = q.to(tl.float8e5).to(tl.uint8, bitcast=True)
            if not HW_ROUNDING:  # the interpreter's cast of NaN may keep its sign
                codes = tl.where(nonfinite[:, None], NAN_BYTE, codes)
        codes = _to_tile(codes, BLOCK_G, G, THREADS, CODE_VEC)
        code_offsets = _tile_offsets(groups, G, THREADS, CODE_VEC)
        tl.store(out_ptr + 16 + code_offsets, codes, mask=group_ok[None, :, None, None])
        if CODE_KIND == 4:  # a non-finite group's codes are zeros: the same thread stores them over its own
            # (needed on GPUs, whose NaN 0x7FFFFFFF has the low byte 0xFF; the interpreter's NaN has 0, so only the
            # compiled tests see this store: benchmarks/results/logs/mutation_int8_nonfinite_gpu_2026-12-04.log)
            tl.store(
                out_ptr + 16 + code_offsets, tl.zeros_like(codes), mask=(group_ok & nonfinite)[None, :, None, None]
            )

    if SCALE_MODE == 3:
        tl.store(out_ptr + scales_offset + groups, group_bytes, mask=group_ok)
        if pid == 0:  # the message scale, as 4 little-endian bytes after the group bytes (no alignment needed)
            word = message_scale.to(tl.uint32, bitcast=True)
            shifts = tl.arange(0, 4) * 8
            tl.store(out_ptr + scales_offset + n_groups + tl.arange(0, 4), ((word >> shifts) & 0xFF).to(tl.uint8))
    elif SCALE_MODE == 2:
        stored = tl.where(nonfinite, 255, exponent + 127).to(tl.uint8)
        tl.store(out_ptr + scales_offset + groups, stored, mask=group_ok)
    else:
        scale_ptr = (out_ptr + scales_offset).to(tl.pointer_type(tl.float32))
        if SCALE_MODE == 1:
            tl.store(scale_ptr + 2 * groups, s_q, mask=group_ok)
            tl.store(scale_ptr + 2 * groups + 1, s_a, mask=group_ok)
        else:
            tl.store(scale_ptr + groups, s_q, mask=group_ok)


@triton.jit
def _message_term(
    buf,
    groups,
    group_ok,
    n_groups,
    scales_offset,
    G: tl.constexpr,
    LOG2G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    ASH: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    CODE_KIND: tl.constexpr,
    INV_SQRT_G: tl.constexpr,
    THREADS: tl.constexpr,
    CODE_VEC: tl.constexpr,
    CODE_WORDS: tl.constexpr,
):
    """One message's term of the decompress-sum [BLOCK_G, G]: its codes times the group multipliers, q * (s /
    sqrt(G)), or with dual scales its whole decode (``reference.decode_sum_groups``)."""
    tile_mask = group_ok[None, :, None, None]
    if CODE_KIND == 2 or CODE_KIND == 3:
        # elements 2i, 2i + 1 of each byte by joins (unpacking by a broadcast shift made INT4 sums of N >= 2
        # messages 10x slower); from words, 7 shifts per 8 codes, the bits above each code's own left in place
        if CODE_WORDS:
            offsets = _tile_offsets(groups, G // 8, THREADS, CODE_VEC // 8)
            words = tl.load((buf + 16).to(tl.pointer_type(tl.uint32)) + offsets, mask=tile_mask, other=0)
            packed = tl.reshape(_word_bytes(_to_rows(words, BLOCK_G, G // 8)), (BLOCK_G, G // 2))
        else:
            offsets = _tile_offsets(groups, G // 2, THREADS, CODE_VEC // 2)
            packed = _to_rows(tl.load(buf + 16 + offsets, mask=tile_mask, other=0).to(tl.int32), BLOCK_G, G // 2)
        nibbles = tl.reshape(tl.join(packed, packed >> 4), (BLOCK_G, G))
        y = _four_bit_values(nibbles, CODE_KIND == 3)
    else:
        offsets = _tile_offsets(groups, G, THREADS, CODE_VEC)
        codes = _to_rows(tl.load(buf + 16 + offsets, mask=tile_mask, other=0), BLOCK_G, G)
        if CODE_KIND == 0:
            y = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif CODE_KIND == 1:
            y = codes.to(tl.float8e5, bitcast=True).to(tl.float32)
        else:  # INT8: the byte sign-extended
            y = codes.to(tl.int8, bitcast=True).to(tl.float32)
    if SCALE_MODE == 3:
        group_byte = tl.load(buf + scales_offset + groups, mask=group_ok, other=0)
        message_bytes = tl.load(buf + scales_offset + n_groups + tl.arange(0, 4)).to(tl.uint32)
        word = tl.sum(message_bytes << (tl.arange(0, 4) * 8), axis=0)
        scale = group_byte.to(tl.float8e4nv, bitcast=True).to(tl.float32) * word.to(tl.float32, bitcast=True)
        scale = tl.where((group_byte & 0x7F) == 0x7F, float("nan"), scale)  # E4M3's NaN (the interpreter: 448)
    elif SCALE_MODE == 2:
        exponent = tl.load(buf + scales_offset + groups, mask=group_ok, other=127).to(tl.int32)
        scale = (tl.minimum(tl.maximum(exponent, 1), 254) << 23).to(tl.float32, bitcast=True)
        scale = tl.where(exponent == 255, float("nan"), scale)
    else:
        scale_ptr = (buf + scales_offset).to(tl.pointer_type(tl.float32))
        stride: tl.constexpr = 2 if SCALE_MODE == 1 else 1
        scale = tl.load(scale_ptr + stride * groups, mask=group_ok, other=1.0)
    if ASH:  # 1 / sqrt(G) folded into the group's multiplier (``reference._decode_multiplier``)
        scale = scale * INV_SQRT_G
    y = y * scale[:, None]
    if SCALE_MODE == 1:  # dual: each message is transformed and divided by its own s_a
        s_a = tl.load(scale_ptr + 2 * groups + 1, mask=group_ok, other=1.0)
        return tl.math.div_rn(_fwht(y, BLOCK_G, G, LOG2G), s_a[:, None])
    return y  # one scale per group: the sum of q * s is transformed once, after the last message


@triton.jit
def _decompress_sum_kernel(
    bufs_ptr,
    out_ptr,
    n_bufs,
    buf_stride,
    out_row_stride,
    numel,
    n_groups,
    scales_offset,
    G: tl.constexpr,
    LOG2G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    ASH: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    CODE_KIND: tl.constexpr,  # 0: FP8 E4M3, 1: FP8 E5M2, 2: FP4 E2M1, 3: INT4, 4: INT8
    INV_SQRT_G: tl.constexpr,
    OUT_MANTISSA_BITS: tl.constexpr,
    OUT_MIN_NORMAL: tl.constexpr,
    OUT_SUBNORMAL_SHIFTER: tl.constexpr,
    HW_ROUNDING: tl.constexpr,  # True on a GPU: the output cast rounds to nearest even in hardware
    THREADS: tl.constexpr,  # threads per group (``_tile_offsets``)
    CODE_VEC: tl.constexpr,  # codes per access (16 bytes; at most G)
    CODE_WORDS: tl.constexpr,  # 4-bit codes read as 32-bit words (message rows 4-byte aligned)
):
    """out = sum over r of decode(bufs[r]) in fp32, in order r = 0, 1, ...

    With one scale per group the transform is linear in the sum: H(sum_r q_r (s_r / sqrt(G))),
    one Hadamard instead of N (``reference.decode_sum_groups`` defines the same order).
    Output row program_id(1) sums messages [row * n_bufs, (row + 1) * n_bufs).
    """
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    bufs_ptr += row * n_bufs * buf_stride
    out_ptr += row * out_row_stride
    groups = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    group_ok = groups < n_groups
    # the first message's term starts the sum (nothing to add it to: one addition per element less than from zero)
    acc = _message_term(
        bufs_ptr, groups, group_ok, n_groups, scales_offset,
        G, LOG2G, BLOCK_G, ASH, SCALE_MODE, CODE_KIND, INV_SQRT_G, THREADS, CODE_VEC, CODE_WORDS,
    )  # fmt: skip
    buf = bufs_ptr
    for _ in range(1, n_bufs):
        buf += buf_stride  # pointer arithmetic is 64-bit: no overflow past 2 GiB
        acc += _message_term(
            buf, groups, group_ok, n_groups, scales_offset,
            G, LOG2G, BLOCK_G, ASH, SCALE_MODE, CODE_KIND, INV_SQRT_G, THREADS, CODE_VEC, CODE_WORDS,
        )  # fmt: skip
    if ASH and SCALE_MODE != 1:
        acc = _fwht(acc, BLOCK_G, G, LOG2G)
    if OUT_MANTISSA_BITS < 23 and not HW_ROUNDING:  # bf16/fp16 output: the interpreter truncates
        acc = _round_to_grid(acc, OUT_MANTISSA_BITS, OUT_MIN_NORMAL, OUT_SUBNORMAL_SHIFTER)
    # Stored as a plain [BLOCK_G, G] tile: Triton moves it through shared memory so that neighbouring threads
    # write neighbouring 16 bytes. Stored from the registers (E contiguous elements per thread, each 16 bytes a
    # separate store: 88ae99a) plain FP8 decompress ran at 0.45 of copy bandwidth on the H200, 0.96 before.
    out_offsets = groups.to(tl.int64)[:, None] * G + tl.arange(0, G)[None, :]
    if out_ptr.dtype.element_ty == tl.bfloat16 and not HW_ROUNDING:  # the top half of the rounded fp32, as bits:
        # the interpreter's cast stores bf16 subnormals inexactly (2^-128 as 0)
        bits = (acc.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)
        tl.store(out_ptr.to(tl.pointer_type(tl.uint16)) + out_offsets, bits, mask=out_offsets < numel)
    else:
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_offsets < numel)


def _grid_constants(mantissa_bits: int, min_normal_exp: int, prefix: str = "") -> dict:
    """Constexprs of ``_round_to_grid`` for a float format (mantissa bits, smallest normal exponent)."""
    subnormal_step_exp = min_normal_exp - mantissa_bits
    return {
        prefix + "MANTISSA_BITS": mantissa_bits,
        prefix + "MIN_NORMAL": 2.0**min_normal_exp,
        prefix + "SUBNORMAL_SHIFTER": 1.5 * 2.0 ** (subnormal_step_exp + 23),
    }


_OUTPUT_GRIDS = {torch.float32: (23, -126), torch.bfloat16: (7, -126), torch.float16: (10, -14)}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # not triton.cdiv: a JIT function, ~9 us per call from Python


# Everything a launch passes besides its tensors and sizes, built once per (settings, launch shape, device kind):
# a TP step launches hundreds of these kernels, and the host's time per launch adds up on fast links.
@functools.lru_cache(maxsize=None)
def _common(settings: CodecSettings, launch: Tuple[int, int], on_gpu: bool, accesses: Tuple[int, ...]) -> dict:
    """The constexprs every kernel shares, and the launch options (warps; no multiply fused into an add on GPUs
    but the butterflies' explicit ``tl.fma``, exact). ``accesses``: elements per 16-byte access of each tensor
    the kernel reads or writes; a thread holds at least one of each."""
    g = settings.group_size
    per_thread = min(g, max(launch[1], *accesses))
    return dict(
        G=g,
        LOG2G=g.bit_length() - 1,
        BLOCK_G=32 * launch[0] * per_thread // g,  # THREADS * BLOCK_G = the launch's threads
        THREADS=g // per_thread,
        ASH=settings.transform == "ash",
        SCALE_MODE=_SCALE_MODE_IDS[settings.scales],
        INV_SQRT_G=reference.inv_sqrt_group(g),
        FP8_MAX=settings.format.max_value,
        **(dict(num_warps=launch[0], enable_fp_fusion=False) if on_gpu else {}),
    )


def _access(bits: int, group_size: int) -> int:
    """Elements of ``bits`` bits in a 16-byte access, at most a group."""
    return min(group_size, 128 // bits)


def _compress_accesses(settings: CodecSettings, x_bits: int) -> Tuple[int, int]:
    """(input elements, codes) per access of the compress kernel and of its first pass: one grid for both."""
    return _access(x_bits, settings.group_size), _access(settings.format.bits, settings.group_size)


@functools.lru_cache(maxsize=None)
def _compress_constants(settings: CodecSettings, launch: Tuple[int, int], on_gpu: bool, x_bits: int) -> dict:
    """The compress kernel's constexprs; its first pass (``_first_pass_constants``) shares its grid."""
    fmt = settings.format
    accesses = _compress_accesses(settings, x_bits)
    return dict(
        _common(settings, launch, on_gpu, accesses),
        X_VEC=accesses[0],
        CODE_VEC=accesses[1],
        CODE_KIND=fmt.code_id,  # 0: E4M3, 1: E5M2, 2: E2M1, 3: INT4, 4: INT8 (the wire's format id)
        STOCHASTIC=settings.rounding == "stochastic",
        HW_ROUNDING=on_gpu,
        NAN_BYTE=NAN_CODE,
        **_grid_constants(fmt.mantissa_bits, fmt.min_normal_exp),
        **{f"E4M3_{k}": v for k, v in _grid_constants(3, -6).items() if k != "MANTISSA_BITS"},
    )


@functools.lru_cache(maxsize=None)
def _first_pass_constants(settings: CodecSettings, launch: Tuple[int, int], on_gpu: bool, x_bits: int) -> dict:
    """The first pass's constexprs, on the compress kernel's grid (the same accesses, so the same BLOCK_G)."""
    accesses = _compress_accesses(settings, x_bits)
    return dict(_common(settings, launch, on_gpu, accesses), X_VEC=accesses[0], Y_VEC=_access(32, settings.group_size))


@functools.lru_cache(maxsize=None)
def _decompress_constants(
    settings: CodecSettings, launch: Tuple[int, int], on_gpu: bool, out_dtype: torch.dtype
) -> dict:
    g = settings.group_size
    code_vec = _access(settings.format.bits, g)
    constants = dict(
        _common(settings, launch, on_gpu, (code_vec,)),
        CODE_VEC=code_vec,
        CODE_KIND=settings.format.code_id,
        HW_ROUNDING=on_gpu,
    )
    del constants["FP8_MAX"]
    return dict(constants, **_grid_constants(*_OUTPUT_GRIDS[out_dtype], prefix="OUT_"))


def _bf16_words(x: torch.Tensor) -> bool:
    """Whether bf16 rows ``x`` [R, m] read as 32-bit words of two elements: 4-byte aligned, m and the row stride even."""
    rows, numel = x.shape
    return (
        x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0 and numel % 2 == 0 and (rows <= 1 or x.stride(0) % 2 == 0)
    )


def _rows_word_aligned(out: torch.Tensor) -> bool:
    """Whether byte rows ``out`` [R, n] all start 4-byte aligned."""
    return out.data_ptr() % 4 == 0 and (out.shape[0] <= 1 or out.stride(0) % 4 == 0)


def compress_rows(x: torch.Tensor, out: torch.Tensor, settings: CodecSettings, seed: int = 0) -> None:
    """Compress each row of ``x`` [R, m] (unit column stride) into the rows of ``out`` [R, nbytes]; ``seed``:
    this call's stochastic-rounding seed (unused with rounding="nearest")."""
    rows, numel = x.shape
    n_groups, _, scales_offset = settings.layout(numel)
    launch = LAUNCH_CONFIG["compress"]
    x_bits = x.element_size() * 8
    constants = _compress_constants(settings, launch, x.is_cuda, x_bits)
    grid = (max(1, _cdiv(n_groups, constants["BLOCK_G"])), rows)
    x_words = _bf16_words(x)
    row_amax = x  # a placeholder pointer: read only by scales="e4m3"
    if settings.scales == "e4m3":  # first pass: every group's max, then the row's
        group_amax = torch.empty(rows, n_groups, dtype=torch.float32, device=x.device)
        _first_pass_kernel[grid](
            x,
            group_amax,
            x.stride(0),
            numel,
            n_groups,
            settings.eps,
            WRITE_Y=False,
            X_WORDS=x_words,
            **_first_pass_constants(settings, launch, x.is_cuda, x_bits),
        )
        row_amax = group_amax.amax(dim=1)
    _compress_kernel[grid](
        x,
        out,
        x.stride(0),
        out.stride(0),
        numel,
        n_groups,
        scales_offset,
        *header_words(settings, numel),
        settings.eps,
        seed,
        row_amax,
        X_WORDS=x_words,
        CODE_WORDS=_rows_word_aligned(out),
        **constants,
    )


def transform_rows(x: torch.Tensor, y: torch.Tensor, settings: CodecSettings) -> None:
    """y [R, n_groups * G] fp32 (contiguous) <- each row of x [R, m] as the compress kernel sees it before its
    scale: transformed (ASH) or not, zero-padded, NaN over non-finite groups (``codec.te_cast``)."""
    rows, numel = x.shape
    n_groups = settings.num_groups(numel)
    constants = _first_pass_constants(settings, LAUNCH_CONFIG["compress"], x.is_cuda, x.element_size() * 8)
    _first_pass_kernel[(max(1, _cdiv(n_groups, constants["BLOCK_G"])), rows)](
        x, y, x.stride(0), numel, n_groups, settings.eps, WRITE_Y=True, X_WORDS=_bf16_words(x), **constants
    )


def decompress_rows(bufs: torch.Tensor, out: torch.Tensor, settings: CodecSettings) -> None:
    """out[r] = fp32 sum of the decodes of messages bufs[r * N : (r + 1) * N], N = len(bufs) / len(out).

    ``out`` is [R, m] with unit column stride (row stride free: slices of a larger tensor work).
    """
    rows, numel = out.shape
    if numel == 0 or rows == 0:
        return
    if bufs.shape[0] == 0:
        raise ValueError("decompress_rows got no messages to decode")
    if bufs.shape[0] % rows:
        raise ValueError(f"{bufs.shape[0]} messages do not split evenly over {rows} output rows")
    n_groups, _, scales_offset = settings.layout(numel)
    constants = _decompress_constants(settings, LAUNCH_CONFIG["decompress_sum"], bufs.is_cuda, out.dtype)
    _decompress_sum_kernel[(_cdiv(n_groups, constants["BLOCK_G"]), rows)](
        bufs,
        out,
        bufs.shape[0] // rows,
        bufs.stride(0),
        out.stride(0),
        numel,
        n_groups,
        scales_offset,
        CODE_WORDS=_rows_word_aligned(bufs),
        **constants,
    )
