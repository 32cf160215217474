"""An independent float64 model of the TACO codec, and the checks tests hold the codec to.

Written from the wire format (``megatron_taco.codec.format``) and the codec's definition, not from
the reference code: the Hadamard is a matrix product with Sylvester's H_G / sqrt(G), scales are exact
float64 quotients, and only the FP8 rounding of the codes goes through torch's casts.

The codec computes in fp32, so a value that falls within fp32 error of an FP8 rounding midpoint
may be rounded either way (one FP8 step on one code: on a small tensor that alone can move the
whole decode by 3e-3, so a decode is not compared with the model's decode). :func:`assert_matches_model`
checks a message and its decode in three independent parts instead:

* stored scales against float64's (``SCALE_REL_TOL``; E8M0 exponents exactly);
* every code against the model's: the FP8 rounding of a value within ``CODE_SLACK`` of the model's;
* the decode against a float64 decode of the same message (``DECODE_REL_TOL``), and its signed error
  along x against that one's (``SIGNED_TOL``).

Tolerances: about 1.3x of the largest values measured over 3 distributions (Gaussian, Student-t(3),
near-zero mass with outlier channels) x group sizes 32-256 x E4M3/E5M2 x ash/none x fp32/dual/e8m0
scales, for the torch reference (tests/test_codec.py) and the Triton kernels (tests/test_kernels.py).
A +0.39% scale bias, in the stored scales or in the decode, is 3.9e-3 in the first or the third.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, Optional

import torch

from megatron_taco.codec.format import FP8_FORMATS, CodecSettings

__all__ = [
    "hadamard",
    "encode",
    "roundtrip",
    "decode",
    "rel_l2",
    "mean_group_gain_error",
    "check_decode",
    "assert_matches_model",
]

ADAPTIVE_SCALE_RANGE = (1e-3, 1e3)  # the clamp of s_a in the paper's dual-scale form
SCALE_FLOOR_EXPONENT = -126  # the smallest fp32 / dual s_q (keeps M / max|y| finite), as the codec's

# Stored fp32 scales (s, or s_q and s_a of "dual") vs float64: 2.8e-7 relative at most (2-3 fp32 ulps
# from the fp32 Hadamard). E8M0 exponents are equal (none within 1e-6 of a power-of-two boundary).
SCALE_REL_TOL = 3.6e-7
# Codes: |v_fp32 - v_float64| / (|v| + M), v the value rounded to FP8 in units of the scale, measured
# 2.05e-7 at most (2^-22.2; the + M term is cancellation in the fp32 Hadamard, which depends on the
# input, hence 4.6x of it here). A code may be the rounding of any value within 2^-20 (|v| + M) of v:
# for E4M3 4.3e-4 + 1e-6 |v|, below a quarter of its smallest step (2^-9), so only a near-tie may round
# the other way; for E5M2, whose range (2^32) exceeds fp32's precision, 0.055 + 1e-6 |v|, so E5M2 codes
# below 0.2 (3.5e-6 of the group's largest) are not held to one step. Measured: at most 1 code in
# 6144 differs from float64's nearest.
CODE_SLACK = 2.0**-20
# ||decode - float64 decode of the same message|| / ||float64 decode||: 9.6e-8 at most.
DECODE_REL_TOL = 1.25e-7
# Signed error along x (mean_group_gain_error) minus that of the float64 decode: 2.5e-8 at most.
SIGNED_TOL = 3.3e-8


@functools.lru_cache(maxsize=None)
def hadamard(group: int) -> torch.Tensor:
    """Sylvester-ordered Hadamard matrix H_G / sqrt(G) (orthogonal and symmetric), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < group:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(group)


def groups_of(x: torch.Tensor, group: int) -> torch.Tensor:
    """x flattened to float64 and zero-padded into [n_groups, group]."""
    flat = x.detach().reshape(-1).double().cpu()
    padded = torch.zeros(-(-flat.numel() // group) * group, dtype=torch.float64)
    padded[: flat.numel()] = flat
    return padded.view(-1, group)


def _fp8(v: torch.Tensor, settings: CodecSettings) -> torch.Tensor:
    """Round float64 values to the FP8 grid (saturating at +-M), as float64."""
    fmt = settings.format
    return v.clamp(-fmt.max_value, fmt.max_value).to(fmt.torch_dtype).double()


def encode(x: torch.Tensor, settings: CodecSettings) -> Dict[str, torch.Tensor]:
    """Float64 encode of ``x``. Per group: ``y`` the transformed values, ``s`` the quantization scale
    (what multiplies the codes), ``stored`` the scales as the wire format stores them, ``v = y / s``
    (clamped to +-M) and ``codes`` its FP8 rounding. All-zero groups get scale 1, as in the codec; one-scale fp32
    storage floors the scale at 2^SCALE_FLOOR_EXPONENT, as the codec does. Finite inputs only."""
    fmt = FP8_FORMATS[settings.fmt]
    g = groups_of(x, settings.group_size)
    y = g @ hadamard(settings.group_size) if settings.transform == "ash" else g  # H symmetric: row @ H = H x
    amax = y.abs().amax(-1)
    s = torch.where(amax > 0, amax / fmt.max_value, torch.ones_like(amax))
    floor = 2.0**SCALE_FLOOR_EXPONENT
    out = {"y": y}  # (the floor matters only for groups whose max |y| is below M * 2^-126)
    if settings.scales == "e8m0":
        out["log2_s"] = torch.log2(s)  # how close each group is to a power-of-two boundary
        exponent = torch.ceil(out["log2_s"]).clamp(-126, 126)
        s = torch.exp2(exponent)
        out["stored"] = (exponent + 127)[:, None]
    elif settings.scales == "dual":
        # the codec's y is H(s_a x)/sqrt(G), so s_q = s * s_a; s_a cancels on decode
        rms = torch.sqrt((g * g).mean(-1) + settings.eps)
        s_a = (fmt.max_value / rms).clamp(*ADAPTIVE_SCALE_RANGE)
        s_q = torch.where(amax > 0, torch.clamp(s * s_a, min=floor), torch.ones_like(s))
        s = torch.where(amax > 0, s_q / s_a, s)
        out["stored"] = torch.stack([s_q, s_a], -1)
    else:
        s = torch.where(amax > 0, torch.clamp(s, min=floor), s)
        out["stored"] = s[:, None]
    out["s"] = s
    out["v"] = (y / s[:, None]).clamp(-fmt.max_value, fmt.max_value)
    out["codes"] = _fp8(out["v"], settings)
    return out


def _inverse_transform(y_hat: torch.Tensor, settings: CodecSettings) -> torch.Tensor:
    return y_hat @ hadamard(settings.group_size) if settings.transform == "ash" else y_hat


def roundtrip(x: torch.Tensor, settings: CodecSettings) -> torch.Tensor:
    """Float64 decode(encode(x)) with the shape of ``x``: the codec's result up to FP8 rounding ties."""
    enc = encode(x, settings)
    x_hat = _inverse_transform(enc["codes"] * enc["s"][:, None], settings)
    return x_hat.reshape(-1)[: x.numel()].view(x.shape)


def wire_codes(buf: torch.Tensor, settings: CodecSettings, numel: int) -> torch.Tensor:
    """The FP8 codes of one message as float64 values [groups, G]."""
    groups, codes_at, scales_at = settings.layout(numel)
    raw = buf.detach().cpu()[codes_at:scales_at]
    return raw.view(settings.format.torch_dtype).double().view(groups, settings.group_size)


def wire_scales(buf: torch.Tensor, settings: CodecSettings, numel: int) -> torch.Tensor:
    """The per-group scales of one message as the wire format stores them: float64 [groups, k]."""
    groups, _, scales_at = settings.layout(numel)
    raw = buf.detach().cpu()[scales_at:]
    assert raw.numel() == groups * settings.scale_bytes, f"{raw.numel()} scale bytes for {groups} groups"
    if settings.scales == "e8m0":
        return raw.double().view(groups, 1)
    return raw.view(torch.float32).double().view(groups, -1)


def decode(buf: torch.Tensor, settings: CodecSettings, numel: int) -> torch.Tensor:
    """Float64 decode of one wire message (its codes times its stored scale, transformed back): [numel]."""
    stored = wire_scales(buf, settings, numel)
    if settings.scales == "e8m0":
        s = torch.exp2(stored[:, 0] - 127)
    elif settings.scales == "dual":
        s = stored[:, 0] / stored[:, 1]  # x' = H(q s_q) / sqrt(G) / s_a
    else:
        s = stored[:, 0]
    x_hat = _inverse_transform(wire_codes(buf, settings, numel) * s[:, None], settings)
    return x_hat.reshape(-1)[:numel]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.detach().double().cpu().reshape(-1), b.detach().double().cpu().reshape(-1)
    return float((a - b).norm() / b.norm())


def mean_group_gain_error(x_hat: torch.Tensor, x: torch.Tensor, group: int) -> float:
    """Mean over non-zero groups of <x_hat - x, x> / <x, x>: the signed relative error along x.

    Round-to-nearest errors are nearly uncorrelated with x, so this averages to ~0 over many groups;
    a decode scaled by (1 + b) gives b for every group.
    """
    g, gh = groups_of(x, group), groups_of(x_hat, group)
    norm2 = (g * g).sum(-1)
    keep = norm2 > 0
    return float((((gh - g) * g).sum(-1)[keep] / norm2[keep]).mean())


def check_message(x: torch.Tensor, settings: CodecSettings, buf: torch.Tensor) -> Dict[str, float]:
    """Assert that message ``buf`` encodes ``x`` as the model does: stored scales within
    ``SCALE_REL_TOL`` (E8M0: the same exponent unless float64 puts the group within 1e-6 of a
    boundary) and every code the FP8 rounding of a value within ``CODE_SLACK`` of the model's
    (so at a tie, either neighbour). Returns what was measured."""
    enc = encode(x, settings)
    stored = wire_scales(buf, settings, x.numel())
    measured = {}
    s = enc["s"]
    if settings.scales == "e8m0":
        differ = (stored != enc["stored"]).any(-1)
        near_boundary = (enc["log2_s"] - enc["log2_s"].round()).abs() < 1e-6
        wrong = differ & ~near_boundary
        assert not wrong.any(), f"{int(wrong.sum())} E8M0 exponents differ from float64's ceil(log2(amax / M))"
        s = torch.where(differ, torch.exp2(stored[:, 0] - 127), s)  # a boundary group: follow the message
        measured["scale_rel"] = 0.0
    else:
        measured["scale_rel"] = float((stored / enc["stored"] - 1).abs().max()) if stored.numel() else 0.0
        assert measured["scale_rel"] <= SCALE_REL_TOL, (
            f"stored scales are up to {measured['scale_rel']:.3e} (relative) from float64's "
            f"(tolerance {SCALE_REL_TOL:.1e})"
        )
    v = (enc["y"] / s[:, None]).clamp(-settings.format.max_value, settings.format.max_value)
    slack = CODE_SLACK * (v.abs() + settings.format.max_value)
    codes = wire_codes(buf, settings, x.numel())
    # FP8 rounding is monotone: the codes of the values within the slack are the grid points from
    # the rounding of v - slack to that of v + slack
    nearest, low, high = _fp8(v, settings), _fp8(v - slack, settings), _fp8(v + slack, settings)
    wrong = (codes < low) | (codes > high)
    if wrong.any():
        i = wrong.nonzero()[0].tolist()
        raise AssertionError(
            f"{int(wrong.sum())} of {codes.numel()} codes are not float64's rounding of y / s (first: group {i[0]} "
            f"element {i[1]}: code {float(codes[i[0], i[1]])}, y / s = {float(v[i[0], i[1]]):.6g})"
        )
    measured["ties"] = float((codes != nearest).double().mean())
    return measured


def check_decode(
    x: torch.Tensor,
    settings: CodecSettings,
    buf: Optional[torch.Tensor],
    x_hat: torch.Tensor,
    reference: Optional[torch.Tensor] = None,
) -> Dict[str, float]:
    """Assert that ``x_hat`` is the float64 decode of ``buf`` (or ``reference``, e.g. a sum of decodes)
    within ``DECODE_REL_TOL``, with the same signed error along ``x`` within ``SIGNED_TOL``.
    Returns what was measured."""
    if reference is None:
        reference = decode(buf, settings, x.numel())
    measured = {"decode_rel": rel_l2(x_hat, reference) if reference.norm() > 0 else float(x_hat.double().norm())}
    assert measured["decode_rel"] <= DECODE_REL_TOL, (
        f"decode is {measured['decode_rel']:.3e} from the float64 decode of the same message "
        f"(tolerance {DECODE_REL_TOL:.1e})"
    )
    group = settings.group_size
    measured["signed"] = mean_group_gain_error(x_hat, x, group) - mean_group_gain_error(reference, x, group)
    assert abs(measured["signed"]) <= SIGNED_TOL, (
        f"signed error along x differs from the float64 decode's by {measured['signed']:+.3e} "
        f"(tolerance {SIGNED_TOL:.1e})"
    )
    return measured


def assert_matches_model(
    x: torch.Tensor, settings: CodecSettings, buf: torch.Tensor, x_hat: torch.Tensor
) -> Dict[str, float]:
    """:func:`check_message` and :func:`check_decode`: the message and its decode are the model's."""
    return {**check_message(x, settings, buf), **check_decode(x, settings, buf, x_hat)}
