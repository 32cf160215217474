"""An independent float64 model of the TACO codec, and the statistics tests compare it with.

Written from the wire-format description (``megatron_taco.codec.format``), not from the
reference code: the Hadamard is a matrix product with Sylvester's H_G / sqrt(G), scales are
exact float64 quotients, and only the FP8 rounding of the codes goes through torch's casts.
The codec computes in fp32, so its codes can differ from these at rounding ties (rare) and
its scales by a few fp32 ulps; everything else must agree.
"""

from __future__ import annotations

import functools
import math
from typing import Dict

import torch

from megatron_taco.codec.format import FP8_FORMATS, CodecSettings

ADAPTIVE_SCALE_RANGE = (1e-3, 1e3)  # the clamp of s_a in the paper's dual-scale form

# Tolerances of the codec (torch reference and Triton kernels) against this model, about 1.3x of the
# largest values measured over 3 distributions (Gaussian, Student-t(3), near-zero mass with outlier
# channels) x group sizes 32-256 x E4M3/E5M2 x ash/none x fp32/dual/e8m0 scales (tests/test_codec.py,
# tests/test_kernels.py). A +0.39% scale bias is 3.9e-3 in the first and the third.
#   ||decode - model|| / ||model||: 1.17e-5 at most; ~1e-7 (fp32 arithmetic) unless a code rounds the
#       other way at an FP8 rounding tie (1 code in 28416 in the worst case)
FLOAT64_REL_TOL = 1.5e-5
#   stored fp32 scales (s, or s_q and s_a of "dual") vs float64: 2.8e-7 relative at most (2-3 fp32 ulps
#       of the fp32 Hadamard); E8M0 exponents are equal (no group within 1e-6 of a power-of-two boundary)
SCALE_REL_TOL = 3.6e-7
#   signed error along x (mean_group_gain_error) minus the model's: 6.6e-8 at most
SIGNED_TOL = 8.5e-8


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


def encode(x: torch.Tensor, settings: CodecSettings) -> Dict[str, torch.Tensor]:
    """Float64 encode of ``x``: per group the transformed values ``y``, the quantization scale ``s``
    (what multiplies the codes), the stored scales as the wire format defines them, and the codes
    as float64 FP8 values. All-zero groups get scale 1 (as the codec); no NaN/Inf handling."""
    fmt = FP8_FORMATS[settings.fmt]
    g = groups_of(x, settings.group_size)
    y = g @ hadamard(settings.group_size) if settings.transform == "ash" else g  # H symmetric: row @ H = H x
    amax = y.abs().amax(-1)
    s = torch.where(amax > 0, amax / fmt.max_value, torch.ones_like(amax))
    out = {"y": y, "groups": g}
    if settings.scales == "e8m0":
        exponent = torch.ceil(torch.log2(s)).clamp(-126, 126)
        out["ratio_log2"] = torch.log2(s)  # how close to a power-of-two boundary each group is
        s = torch.exp2(exponent)
        out["stored"] = (exponent + 127)[:, None]
    elif settings.scales == "dual":
        # y_codec = H(s_a x)/sqrt(G): s_q = max|y_codec| / M = s * s_a (s_a cancels on decode)
        rms = torch.sqrt((g * g).mean(-1) + settings.eps)
        s_a = (fmt.max_value / rms).clamp(*ADAPTIVE_SCALE_RANGE)
        out["stored"] = torch.stack([torch.where(amax > 0, s * s_a, torch.ones_like(s)), s_a], -1)
    else:
        out["stored"] = s[:, None]
    out["s"] = s
    out["codes"] = (y / s[:, None]).clamp(-fmt.max_value, fmt.max_value).to(fmt.torch_dtype).double()
    return out


def roundtrip(x: torch.Tensor, settings: CodecSettings) -> torch.Tensor:
    """Float64 decode(encode(x)) with the shape of ``x``."""
    enc = encode(x, settings)
    y_hat = enc["codes"] * enc["s"][:, None]
    x_hat = y_hat @ hadamard(settings.group_size) if settings.transform == "ash" else y_hat
    return x_hat.reshape(-1)[: x.numel()].view(x.shape)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


def mean_group_gain_error(x_hat: torch.Tensor, x: torch.Tensor, group: int) -> float:
    """Mean over non-zero groups of <x_hat - x, x> / <x, x>: the signed relative error along x.

    Round-to-nearest errors are uncorrelated with x, so this averages to ~0 over many groups;
    a decode scaled by (1 + b) gives b for every group.
    """
    g, gh = groups_of(x, group), groups_of(x_hat, group)
    norm2 = (g * g).sum(-1)
    keep = norm2 > 0
    return float((((gh - g) * g).sum(-1)[keep] / norm2[keep]).mean())


def wire_scales(buf: torch.Tensor, settings: CodecSettings, numel: int) -> torch.Tensor:
    """The per-group scales of one message, read as the wire format lays them out: float64 [groups, k]."""
    groups, _, scales_at = settings.layout(numel)
    raw = buf.detach().cpu()[scales_at:]
    assert raw.numel() == groups * settings.scale_bytes, f"{raw.numel()} scale bytes for {groups} groups"
    if settings.scales == "e8m0":
        return raw.double().view(groups, 1)
    return raw.view(torch.float32).double().view(groups, -1)


def assert_matches_model(x: torch.Tensor, settings: CodecSettings, buf: torch.Tensor, x_hat: torch.Tensor) -> None:
    """Assert that message ``buf`` and its decode ``x_hat`` are this model's, within the tolerances above:
    the decoded values, their signed error along x, and the stored scales."""
    model = roundtrip(x, settings)
    err = rel_l2(x_hat, model)
    assert err <= FLOAT64_REL_TOL, f"decode is {err:.3e} from the float64 model (tolerance {FLOAT64_REL_TOL:.1e})"
    # Rounding has a small signed error of its own (tests/test_codec.py, E4M3_SIGNED_BOUND): compare with the model's.
    group = settings.group_size
    signed = mean_group_gain_error(x_hat, x, group) - mean_group_gain_error(model, x, group)
    assert abs(signed) <= SIGNED_TOL, f"signed error along x differs from the float64 model's by {signed:+.3e}"
    expected = encode(x, settings)
    stored = wire_scales(buf, settings, x.numel())
    if settings.scales == "e8m0":
        near_boundary = (expected["ratio_log2"] - expected["ratio_log2"].round()).abs() < 1e-6
        wrong = (stored != expected["stored"]).any(-1) & ~near_boundary
        assert not wrong.any(), f"{int(wrong.sum())} E8M0 exponents differ from float64's ceil(log2(amax / M))"
    else:
        scale_err = float((stored / expected["stored"] - 1).abs().max())
        assert scale_err <= SCALE_REL_TOL, f"stored scales are up to {scale_err:.3e} (relative) from float64's"
