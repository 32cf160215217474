"""Pure-torch reference of the TACO codec: the ground truth the Triton kernels reproduce bit for bit.

Every floating-point step is written in an explicit order so that a kernel
can execute the same IEEE fp32 operations: sums are pairwise trees over
adjacent elements, the Walsh-Hadamard transform uses the constant-geometry
butterfly (each stage maps ``v`` to ``[v[0::2] + v[1::2] | v[0::2] - v[1::2]]``,
which after log2(G) stages is the Sylvester-ordered H_G), divisions and
square roots are IEEE-rounded (computed in float64, rounded once to fp32) and
nothing feeds a multiply into an add.

Per group of G values x (fp32), with M the element format's maximum (448 for E4M3, 127 for INT8, 6 for E2M1, 7 for
INT4):

    ASH, scales="dual" (the paper's form):
        s_a = clamp(M / sqrt(sum(x^2)/G + eps), 1e-3, 1e3)    adaptive scale
        y   = H(x) * m,  m = s_a / sqrt(G)                      = H(s_a x)/sqrt(G)
        s_q = max|y| / M ;  q = fp8(clamp(y * (M / max|y|), -M, M))   stores (s_q, s_a)
        (max|y| floored at M * 2^-126, so that M / max|y| stays finite: SCALE_FLOOR_EXPONENT)
        x'  = H(q * (s_q / sqrt(G))) / s_a
    ASH, scales="fp32": s_a cancels against s_q, so it is folded:
        y = H(x) * m,  m = 1 / sqrt(G) ;  s = max|y| / M ;  q = fp8(H(x) * (m * (M / max|y|)))   stores s
        x' = H(q * (s / sqrt(G)))
    1/sqrt(G) is folded into each group's multipliers (rounded once per group), so each element is multiplied
    once on the way in (dual: twice, y first, as m * M / max|y| can overflow there) and once on the way out.
    max|y| = max|H(x)| * m, one rounding: rounding is monotonic, so it equals the max of the rounded products
    H(x) * m (Inf where one overflows).
    scales="e8m0": as "fp32" with s rounded up to a power of two 2^e (q = H(x) * (m * 2^-e));
        stores the byte e + 127.
    scales="e4m3" (4-bit formats, NVFP4's layout): S = max|y| of the message / (M * 448) in fp32, then per
        group the E4M3 byte b = e4m3(amax / M / S) and s = b * S; q = H(x) * (m * (1 / s)), clamped to M.
    transform="none": H is the identity and m = 1 (per-group FP8 without Hadamard).
    INT8 (M = 127): q rounded to the integers (ties to even), the exact product H(x) * (m * inverse) rounded once,
        as the kernels' fused multiply-add does; one two's-complement byte per element.
    4-bit formats (M = 6 for FP4 E2M1, 7 for INT4): the same, with q rounded to the
        E2M1 grid (ties to even) or to the integers (ties to even; INT4 rounds the exact product H(x) * (m *
        inverse) once, as the kernels' fused multiply-add does), coded in 4 bits and packed two per byte
        (element 2i in the low nibble).
    rounding="stochastic" (4-bit): with the grid step d at |q| (INT4: 1; E2M1: 0.5, 1, 2 below 2, 4, 6),
        |q| -> d * floor(|q| / d + u), u uniform in [0, 1) from a hash of (message seed, element index)
        (:func:`uniform_noise`): rounds up with probability equal to the distance, so E[decode] = x.

The sum of N messages (the reduce-scatter's local step) is H(sum_r q_r (s_r / sqrt(G)))
for one-scale modes: one transform instead of N.

A group holding NaN or Inf gets a NaN scale and NaN codes, so it decodes to
NaN (never to silent zeros); an all-zero group decodes to exact zeros.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import torch

from megatron_taco.codec.format import NAN_CODE, CodecSettings, ElementFormat

__all__ = [
    "div_rn",
    "sqrt_rn",
    "inv_sqrt_group",
    "round_to_grid",
    "hash32",
    "uniform_noise",
    "encode_groups",
    "code_values",
    "decode_sum_groups",
]

ADAPTIVE_SCALE_MIN = 1e-3
ADAPTIVE_SCALE_MAX = 1e3
# s_q's floor with fp32 / dual scales, the smallest normal fp32: a group whose max |y| is below M * 2^-126 (5e-36
# for E4M3, 8e-38 for INT4) is scaled as if its max were that. Below about M * 2^-128, M / max overflowed to Inf,
# and Inf * y made every code +-M and 0 * Inf NaN: such a group decoded to NaN or at a relative error of 2.6. The
# floor costs groups in [M * 2^-128, M * 2^-126) up to 2 bits of their codes' range. Exact: s_q = 2^-126 and
# M / (M * 2^-126) = 2^126.
SCALE_FLOOR_EXPONENT = -126
# scales="e4m3": the message scale S's floor. The smallest non-zero group scale is then E4M3's smallest subnormal
# 2^-9 times 2^-117 = 2^-126, so 1 / s_g <= 2^126 stays finite. Below, a message whose max |y| is under M * 448 *
# 2^-117 (about 2e-32 for INT4) gave 1 / s_g = Inf and 0 * Inf = NaN codes for its zeros; the floor only costs such
# messages part of their codes' range.
MESSAGE_SCALE_FLOOR_EXPONENT = -117
E8M0_MIN_EXP = -126
E8M0_MAX_EXP = 126


def pairwise_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by a tree of adjacent pairs."""
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def fwht(v: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform over the last dim, constant-geometry butterflies."""
    for _ in range(v.shape[-1].bit_length() - 1):
        even, odd = v[..., 0::2], v[..., 1::2]
        v = torch.cat([even + odd, even - odd], dim=-1)
    return v


def div_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IEEE-rounded fp32 a / b (via float64: exact before the single rounding to fp32)."""
    return (a.double() / b.double()).float()


def sqrt_rn(a: torch.Tensor) -> torch.Tensor:
    """IEEE-rounded fp32 sqrt (torch's vectorised fp32 sqrt can miss near-ties by one ulp)."""
    return torch.sqrt(a.double()).float()


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=like.device)


@functools.lru_cache(maxsize=None)
def inv_sqrt_group(group_size: int) -> float:
    """1/sqrt(G) rounded to fp32 (exact for G = 64, 256)."""
    return float(torch.tensor(group_size, dtype=torch.float64).rsqrt().float())


def _abs_max_and_nonfinite(h: torch.Tensor, multiplier: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per group: max |y| of y = h * multiplier (0 for a non-finite group) and whether y holds NaN or Inf.

    max |y| = max |h| * multiplier (rounding is monotonic). NaN is mapped to Inf before the max (a GPU max
    would skip NaN), so a group is non-finite exactly when that product is Inf or NaN (a NaN multiplier).
    """
    magnitude = torch.where(torch.isnan(h), float("inf"), h.abs())
    amax = magnitude.amax(dim=-1) * multiplier
    nonfinite = torch.isinf(amax) | torch.isnan(amax)
    return torch.where(nonfinite, torch.zeros_like(amax), amax), nonfinite


def _ceil_pow2_exponent(need: torch.Tensor) -> torch.Tensor:
    """Smallest e with 2^e >= need (need >= 0 finite fp32), clamped to the E8M0 range we use."""
    bits = need.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return exponent.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as fp32 for exponents in the normal range, built from bits (exact)."""
    return ((exponent + 127) << 23).to(torch.int32).view(torch.float32)


def round_to_grid(v: torch.Tensor, mantissa_bits: int, min_normal_exp: int) -> torch.Tensor:
    """Round finite fp32 ``v`` to the nearest value of a float format with ``mantissa_bits`` and smallest
    normal 2^min_normal_exp (ties to even), with integer arithmetic on the fp32 bits for normal values and the
    fp32 adder for subnormal ones (the kernels' ``_round_to_grid``, bit for bit)."""
    drop = 23 - mantissa_bits
    bits = v.view(torch.int32)
    sign = bits & -(2**31)
    magnitude = bits & 0x7FFFFFFF
    lsb = (magnitude >> drop) & 1
    normal = (magnitude + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)
    shifter = _f32(1.5 * 2.0 ** (min_normal_exp - mantissa_bits + 23), v)  # its ulp is the subnormal step
    absolute = magnitude.view(torch.float32)
    subnormal = ((absolute + shifter) - shifter).view(torch.int32)
    rounded = torch.where(absolute < 2.0**min_normal_exp, subnormal, normal)
    return (rounded | sign).view(torch.float32)


_MASK32 = 0xFFFFFFFF


def hash32(x):
    """The lowbias32 integer hash of 32-bit values (a Python int or an int64 tensor holding 0..2^32-1): the
    kernels compute the same with wrapping 64-bit products masked to 32 bits."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seed: int, rows: int, row_elements: int, device) -> torch.Tensor:
    """u in [0, 1) (multiples of 2^-24) for element i of row r of one compress call (rows padded to whole groups:
    ``row_elements`` = groups x G): hash32(((r * row_elements + i) mod 2^32) ^ seed), seed = the call's."""
    index = torch.arange(rows * row_elements, dtype=torch.int64, device=device).view(rows, row_elements) & _MASK32
    return (hash32(index ^ seed) >> 8).float() * (1.0 / (1 << 24))


def _stochastic_magnitude(a: torch.Tensor, u: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """|q| rounded down or up to the grid at random (up with probability equal to the distance, in steps)."""
    if fmt.integer:
        rounded = torch.floor(a + u)
    else:
        inverse_step = torch.where(a < 2.0, 2.0, torch.where(a < 4.0, 1.0, 0.5))  # 1 / grid step: exact products
        step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
        rounded = torch.floor(a * inverse_step + u) * step
    return torch.minimum(rounded, _f32(fmt.max_value, a))  # INT4: 7 + u is 8.0 in fp32 for u > 1 - 2^-22 (-8's code)


def _four_bit_codes(q: torch.Tensor, fmt: ElementFormat, noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """4-bit codes (int32 0..15) of q, |q| <= M: the E2M1 bit pattern s|ee|m, or with ``noise`` two's-complement
    INT4 too (INT4 to nearest rounds the unrounded product: :func:`_integer_codes`).

    ``noise``: u in [0, 1) per element for stochastic rounding (None: nearest, ties to even)."""
    if fmt.integer and noise is None:
        raise ValueError("INT4 to nearest rounds the unrounded product: _integer_codes")
    if noise is not None:
        r = _stochastic_magnitude(q.abs(), noise, fmt).copysign(q)  # q's sign bit, -0.0 included (as nearest)
        if fmt.integer:
            return r.to(torch.int32) & 0xF
    else:
        r = round_to_grid(q, fmt.mantissa_bits, fmt.min_normal_exp)
    bits = r.view(torch.int32)
    sign = (bits >> 31) & 1
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa = (bits >> 22) & 1
    magnitude = r.abs()
    code = torch.where(
        magnitude >= 1.0,
        ((exponent + 1) << 1) | mantissa,
        torch.where(magnitude == 0.5, torch.ones_like(bits), torch.zeros_like(bits)),
    )
    return code | (sign << 3)


def _integer_codes(a: torch.Tensor, b: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """INT4 / INT8 codes (int32 0..15 / 0..255: two's complement in the format's bits) of q = a * b rounded to
    nearest: the exact product rounded once to an integer (ties to even; fp64 holds the product of two fp32
    exactly), clamped to +-M. The kernels round it in one fused multiply-add, where rounding q to fp32 first would
    round twice."""
    n = torch.round(a.double() * b.double()).clamp(-fmt.max_value, fmt.max_value)
    return torch.nan_to_num(n).to(torch.int32) & ((1 << fmt.bits) - 1)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[n, G] codes 0..15 -> [n, G / 2] bytes, element 2i in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def code_values(codes: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """The fp32 values [n, G] of a message's codes: [n, G] FP8 or INT8 bytes, or [n, G / 2] packed 4-bit codes."""
    if fmt.bits == 8:
        return codes.view(torch.int8 if fmt.integer else fmt.torch_dtype).float()
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(codes.shape[0], -1).to(torch.int32)
    if fmt.integer:
        return ((nibbles ^ 8) - 8).float()
    exponent = (nibbles >> 1) & 3
    half_steps = (nibbles & 1).float()
    power = ((exponent - 1 + 127).clamp(min=1) << 23).view(torch.float32)  # 2^(e - 1), exact
    magnitude = torch.where(exponent == 0, half_steps * 0.5, power * (1.0 + 0.5 * half_steps))
    return torch.where((nibbles & 8) != 0, -magnitude, magnitude)


def _transform_groups(x: torch.Tensor, settings: CodecSettings) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, m, s_a) of fp32 groups x [n, G]: h = H(x) (x without the transform) and the per-group multiplier m
    with y = h * m the transformed groups (1/sqrt(G), times s_a for "dual"; 1 without the transform); s_a is 1
    except for "dual"."""
    ones = torch.ones(x.shape[0], dtype=torch.float32, device=x.device)
    if settings.transform != "ash":
        return x, ones, ones
    group = settings.group_size
    inv_sqrt = _f32(inv_sqrt_group(group), x)
    if settings.scales != "dual":
        return fwht(x), ones * inv_sqrt, ones
    fp8_max = _f32(settings.format.max_value, x)
    mean_square = pairwise_sum(x * x) * (1.0 / group)  # 1/G is a power of two: exact
    rms = sqrt_rn(mean_square + _f32(settings.eps, x))
    s_a = div_rn(fp8_max, rms).clamp(ADAPTIVE_SCALE_MIN, ADAPTIVE_SCALE_MAX)
    s_a = torch.where(torch.isnan(s_a), _f32(float("nan"), x), s_a)  # one NaN bit pattern
    return fwht(x), s_a * inv_sqrt, s_a


def encode_groups(
    x: torch.Tensor, settings: CodecSettings, noise: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Encode fp32 groups ``x`` of shape [n, G]; return (codes uint8 [n, G] or, 4-bit, [n, G / 2], scales).

    Scales are fp32 [n, 2] (s_q, s_a) for "dual", fp32 [n, 1] for "fp32", uint8 [n, 1] for "e8m0", and for
    "e4m3" 1-D uint8 [n + 4]: the group bytes, then the message scale.
    ``noise`` [n, G]: stochastic rounding's u per element (4-bit formats with rounding="stochastic").
    """
    h, multiplier, s_a = _transform_groups(x, settings)
    fmt = settings.format
    fp8_max = _f32(fmt.max_value, x)
    amax, nonfinite = _abs_max_and_nonfinite(h, multiplier)
    nan = _f32(float("nan"), x)
    # q = h * (multiplier * inverse): one rounded multiplier per group, one multiply per element (a per-element
    # IEEE division is slow on GPU); dual: (h * multiplier) * inverse
    if settings.scales == "e8m0":
        exponent = _ceil_pow2_exponent(div_rn(amax, fp8_max))
        inverse = _pow2(-exponent)
        stored = torch.where(nonfinite, 255, exponent + 127).to(torch.uint8)[:, None]
    elif settings.scales == "e4m3":
        inverse, stored = _e4m3_scaled(amax, nonfinite, fp8_max)
    else:
        floored = torch.maximum(amax, fp8_max * 2.0**SCALE_FLOOR_EXPONENT)
        s_q = torch.where(amax > 0, div_rn(floored, fp8_max), torch.ones_like(amax))
        s_q = torch.where(nonfinite, nan, s_q)
        inverse = torch.where(amax > 0, div_rn(fp8_max, floored), torch.ones_like(amax))
        stored = torch.stack([s_q, s_a], dim=-1) if settings.scales == "dual" else s_q[:, None]
    if settings.scales == "dual":  # y first: m (up to 1e3 / sqrt(G)) times M / s_q can overflow fp32
        a, b = h * multiplier[:, None], inverse[:, None]
    else:  # m = 1/sqrt(G) or 1: m * inverse <= 2^126 (fp32, e8m0 scales; e4m3: 1 / s_g <= 2^126 by S's floor)
        a, b = h, (multiplier * inverse)[:, None]
    if fmt.bits == 4 or fmt.integer:  # a non-finite group's NaN scale decodes it to NaN; its codes are zeros
        if fmt.integer and noise is None:
            codes = _integer_codes(a, b, fmt)
        else:
            codes = _four_bit_codes((a * b).clamp(-fmt.max_value, fmt.max_value), fmt, noise)
        codes = torch.where(nonfinite[:, None], 0, codes)
        return (_pack_nibbles(codes) if fmt.bits == 4 else codes.to(torch.uint8)), stored
    q = (a * b).clamp(-fmt.max_value, fmt.max_value)
    codes = q.to(fmt.torch_dtype).view(torch.uint8)
    codes = torch.where(nonfinite[:, None], torch.full_like(codes, NAN_CODE), codes)
    return codes, stored


E4M3_MAX = 448.0


def _e4m3_scaled(amax: torch.Tensor, nonfinite: torch.Tensor, element_max: torch.Tensor):
    """scales="e4m3" (NVFP4's layout): the message scale S = max_g amax_g / (M * 448) (fp32), each group's
    E4M3 byte b_g = e4m3(amax_g / M / S), its scale s_g = b_g * S, and 1 / s_g (0 where s_g is 0).

    Returns (1 / s_g per group, the stored bytes: [group bytes..., S as 4 little-endian bytes])."""
    row_amax = amax.max()
    floored = torch.maximum(row_amax, element_max * E4M3_MAX * 2.0**MESSAGE_SCALE_FLOOR_EXPONENT)
    message_scale = torch.where(row_amax > 0, div_rn(floored, element_max * E4M3_MAX), torch.ones_like(row_amax))
    ratio = div_rn(div_rn(amax, element_max), message_scale).clamp(max=E4M3_MAX)
    group_bytes = ratio.to(torch.float8_e4m3fn).view(torch.uint8)
    group_bytes = torch.where(nonfinite, torch.full_like(group_bytes, NAN_CODE), group_bytes)
    group_scale = group_bytes.view(torch.float8_e4m3fn).float() * message_scale
    inverse = torch.where(group_scale > 0, div_rn(torch.ones_like(group_scale), group_scale), 0.0)
    stored = torch.cat([group_bytes, message_scale.reshape(1).view(torch.uint8)])
    return inverse, stored


def decode_scale(scales: torch.Tensor, settings: CodecSettings) -> torch.Tensor:
    """Per-group multiplier of the codes: s_q, the folded scale, 2^e (NaN for byte 255), or, for "e4m3", the
    group's E4M3 byte times the message scale (``scales``: the message's whole scale section, 1-D bytes)."""
    if settings.scales == "e4m3":
        message_scale = scales[-4:].clone().view(torch.float32)
        return scales[:-4].view(torch.float8_e4m3fn).float() * message_scale
    if settings.scales == "e8m0":
        exponent = scales[:, 0].to(torch.int32)
        return torch.where(exponent == 255, float("nan"), _pow2(exponent.clamp(1, 254) - 127))
    return scales[:, 0]


def _decode_multiplier(scales: torch.Tensor, settings: CodecSettings) -> torch.Tensor:
    """Per-group multiplier of the codes before the inverse transform: the scale, times 1/sqrt(G) with ASH
    (H / sqrt(G) is its own inverse; folded here, rounded once per group)."""
    scale = decode_scale(scales, settings)
    if settings.transform == "none":
        return scale
    return scale * _f32(inv_sqrt_group(settings.group_size), scale)


def decode_groups(codes: torch.Tensor, scales: torch.Tensor, settings: CodecSettings) -> torch.Tensor:
    """Decode a message's codes (see :func:`code_values`) and their scales back to fp32 groups [n, G]."""
    y = code_values(codes, settings.format) * _decode_multiplier(scales, settings)[:, None]
    if settings.transform == "none":
        return y
    x = fwht(y)
    if settings.scales == "dual":
        x = div_rn(x, scales[:, 1:2])
    return x


def decode_sum_groups(
    codes: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], settings: CodecSettings
) -> torch.Tensor:
    """Sum of the decodes of N messages' groups, in fp32 and in message order.

    The Hadamard is linear, so with one scale per group the products q * s are
    summed first and transformed once: H(sum_r q_r (s_r / sqrt(G))). The dual form
    divides each message by its own s_a after its transform, so it sums decodes.
    """
    if settings.scales == "dual":
        terms = [decode_groups(c, s, settings) for c, s in zip(codes, scales)]
    else:
        terms = [
            code_values(c, settings.format) * _decode_multiplier(s, settings)[:, None] for c, s in zip(codes, scales)
        ]
    acc = terms[0]  # the first term starts the sum, not a zero (the kernels' order: -0.0 stays -0.0)
    for term in terms[1:]:
        acc = acc + term
    if settings.transform == "none" or settings.scales == "dual":
        return acc
    return fwht(acc)
