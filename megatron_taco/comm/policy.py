"""Decide, per process group, whether compression pays: measure the link once.

Compression costs codec time (a pass over the data at close to memory bandwidth)
and saves about half the wire time. On NVLink-class links the saving is smaller
than the codec cost, on PCIe/host-memory and Ethernet-class links it is much
larger (benchmarks/results/collectives.md). ``auto_options`` times one plain
all-gather on the group and turns compression off when the measured bus
bandwidth is above ``FAST_LINK_GBPS``; every rank takes the same decision (the
slowest rank's time is used).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_taco.comm.collectives import CommOptions

# Bus bandwidth above which compressed collectives were slower than NCCL bf16 in
# benchmarks/results/collectives.md (2 x H200: NVLink ~200+ GB/s loses, host memory ~20 GB/s wins).
FAST_LINK_GBPS = 60.0
NEVER = 1 << 62


def measure_bus_bandwidth(group: Optional[dist.ProcessGroup], device: torch.device, nbytes: int = 32 << 20) -> float:
    """All-gather bus bandwidth of ``nbytes`` (output) in GB/s, the slowest rank's, after one warm-up."""
    world = dist.get_world_size(group)
    shard = torch.zeros(nbytes // world, dtype=torch.uint8, device=device)
    out = torch.empty(shard.numel() * world, dtype=torch.uint8, device=device)
    elapsed = []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_gather_into_tensor(out, shard, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed.append(time.perf_counter() - start)
    slowest = torch.tensor([min(elapsed[1:])], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return out.numel() * (world - 1) / world / float(slowest) / 1e9


def auto_options(
    group: Optional[dist.ProcessGroup],
    device: torch.device,
    min_bytes: int = 1 << 20,
    chunk_bytes: int = CommOptions().chunk_bytes,
) -> "tuple[CommOptions, float]":
    """(options, measured GB/s): compression on for messages >= min_bytes on slow links, off on fast ones."""
    gbps = measure_bus_bandwidth(group, device)
    return CommOptions(min_bytes=NEVER if gbps > FAST_LINK_GBPS else min_bytes, chunk_bytes=chunk_bytes), gbps
