"""Realistic test tensors for codec numerics: the shapes of TP traffic, not just N(0, 1)."""

from __future__ import annotations

import os
from typing import Callable, Dict, Optional

import torch

__all__ = ["kernel_device", "gaussian", "DISTRIBUTIONS", "near_underflow_groups", "messages_with_hard_cases"]


def kernel_device() -> Optional[str]:
    """Where the Triton kernels' tests put their tensors: "cuda" (compiled), "cpu" under Triton's interpreter
    (TRITON_INTERPRET=1, as tests/conftest.py sets), else None (they cannot run)."""
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


def gaussian(shape, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen)


def student_t(shape, gen: torch.Generator, df: float = 3.0) -> torch.Tensor:
    """Heavy-tailed: N(0,1) / sqrt(chi2(df)/df)."""
    normal = torch.randn(shape, generator=gen)
    chi2 = torch.zeros(shape)
    for _ in range(int(df)):
        chi2 += torch.randn(shape, generator=gen) ** 2
    return normal / torch.sqrt(chi2 / df)


def near_zero_with_outlier_channels(shape, gen: torch.Generator) -> torch.Tensor:
    """Most mass within 1e-3 of zero, a few hidden channels 1000x louder (LLM activations)."""
    x = torch.randn(shape, generator=gen) * 1e-3
    hidden = shape[-1]
    channels = torch.randperm(hidden, generator=gen)[: max(1, hidden // 64)]
    x[..., channels] = torch.randn(x[..., channels].shape, generator=gen) * 1.0
    return x


DISTRIBUTIONS: Dict[str, Callable] = {
    "gaussian": gaussian,
    "student_t3": student_t,
    "near_zero_outliers": near_zero_with_outlier_channels,
}


def near_underflow_groups(rows: int, seed: int, low: float = 2e-38, high: float = 1e-37) -> torch.Tensor:
    """bf16 [rows, 128] of |values| in [low, high] (by default normal bf16, no subnormals), every 7th value zero:
    a group's max is below M * 2^-126, the codec's scale floor, for the FP8 formats (and below the 4-bit formats'
    overflow of M / max, about M * 2^-128, with high = 1.7e-38 and no transform)."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = low + torch.rand(rows, 128, generator=gen) * (high - low)
    x = (magnitude * torch.sign(torch.randn(rows, 128, generator=gen))).to(torch.bfloat16)
    x[:, ::7] = 0
    return x


def messages_with_hard_cases(seed: int) -> torch.Tensor:
    """6 rows of 1024: realistic traffic (each distribution twice) plus the hard cases a codec must keep: an outlier,
    an all-zero stretch, tiny values, and NaN, +Inf and -Inf groups."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.stack([fn((1, 1024), gen)[0] for fn in DISTRIBUTIONS.values()] * 2)
    x[0, 5] = 80.0
    x[1, :256] = 0.0
    x[2, 300:340] *= 1e-30
    x[3, 7] = float("nan")
    x[4, 600] = float("inf")
    x[5, 900] = -float("inf")
    return x
