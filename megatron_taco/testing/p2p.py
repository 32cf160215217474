"""Record the point-to-point traffic megatron-core's pipeline schedules issue (for wire-size tests)."""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Tuple

import torch
import torch.distributed as dist

__all__ = ["recording_p2p"]


@contextlib.contextmanager
def recording_p2p() -> Iterator[List[Tuple[str, torch.dtype, Tuple[int, ...]]]]:
    """(op name, dtype, shape) of every batched P2P op issued inside the block, in order."""
    seen: List[Tuple[str, torch.dtype, Tuple[int, ...]]] = []
    original = dist.batch_isend_irecv

    def recording(ops):
        seen.extend((op.op.__name__, op.tensor.dtype, tuple(op.tensor.shape)) for op in ops)
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        yield seen
    finally:
        dist.batch_isend_irecv = original
