"""LayerNorm / RMSNorm that work with sequence parallelism, without apex.

megatron-core's local spec falls back to ``WrappedTorchNorm`` when apex is
missing, and that wrapper refuses ``sequence_parallel=True``. Under sequence
parallelism each TP rank normalises its own slice of the sequence with a full
(replicated) weight, so the weight gradients are partial sums: tagging the
parameters ``sequence_parallel = True`` makes megatron-core's
``finalize_model_grads`` all-reduce them over the TP group, which is what apex's
``FusedLayerNorm`` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["SequenceParallelNorm"]


class SequenceParallelNorm(torch.nn.Module):
    """``config.normalization`` ("LayerNorm" or "RMSNorm") over the last dim, SP-aware."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(
                f"SequenceParallelNorm supports normalization LayerNorm or RMSNorm, got {config.normalization!r}"
            )
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError("SequenceParallelNorm does not implement layernorm_zero_centered_gamma")
        self.normalization = config.normalization
        self.hidden_size = hidden_size
        self.eps = eps
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = (
            torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype)) if self.normalization == "LayerNorm" else None
        )
        for param in self.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalization == "LayerNorm":
            return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)
        return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
