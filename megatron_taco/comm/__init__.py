"""Compressed collectives over torch.distributed process groups (gloo on CPU, NCCL on GPU)."""

from megatron_taco.comm.collectives import (
    DEFAULT_OPTIONS,
    CommOptions,
    Handle,
    all_gather,
    all_reduce,
    compresses,
    reduce_scatter,
)
from megatron_taco.comm.handshake import SettingsMismatchError

__all__ = [
    "CommOptions",
    "DEFAULT_OPTIONS",
    "Handle",
    "SettingsMismatchError",
    "all_gather",
    "all_reduce",
    "compresses",
    "reduce_scatter",
]
