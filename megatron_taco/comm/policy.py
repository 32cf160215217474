"""Decide, per process group, whether compression pays: measure the link once.

Compression costs a fixed overhead per collective plus codec time, and saves
about half the wire time. On NVLink-class links the saving is smaller than the
cost; on PCIe/host-memory and Ethernet-class links it is larger for messages
above a break-even size (benchmarks/results/collectives.md). ``auto_options``
times one plain all-gather on the group, turns compression off above
``FAST_LINK_GBPS`` and otherwise sets ``min_bytes`` to the break-even size
``overhead * bandwidth / saved fraction``. Every rank takes the same decision
(the slowest rank's time is used).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_taco.comm.collectives import CommOptions

__all__ = ["FAST_LINK_GBPS", "NEVER", "measure_bus_bandwidth", "break_even_bytes", "auto_options"]

# Measured on 2 x H200 (benchmarks/results/collectives.md): the probe reads ~118 GB/s on NVLink,
# where compression lost at every size, ~23 GB/s over host memory and ~2.7 GB/s over sockets,
# where it won from 64 MiB and 4 MiB on. A compressed collective costs ~0.6 ms more than the
# plain one at small sizes (fixed per-call cost), and saves 1 - 1/1.94 of the wire bytes.
FAST_LINK_GBPS = 60.0
FIXED_OVERHEAD_S = 0.6e-3
SAVED_FRACTION = 1 - 1 / 1.94
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


def break_even_bytes(gbps: float) -> int:
    """Smallest message (uncompressed bytes) whose wire-time saving covers the fixed overhead."""
    return int(FIXED_OVERHEAD_S * gbps * 1e9 / SAVED_FRACTION)


def auto_options(
    group: Optional[dist.ProcessGroup],
    device: torch.device,
    chunk_bytes: int = CommOptions().chunk_bytes,
    report: bool = False,
) -> "tuple[CommOptions, float]":
    """(options, measured GB/s): compression off on fast links, on above the break-even size otherwise.

    ``report``: the group's first rank prints the measurement and the decision (one line per group)."""
    gbps = measure_bus_bandwidth(group, device)
    min_bytes = NEVER if gbps > FAST_LINK_GBPS else break_even_bytes(gbps)
    if report and dist.get_rank() == min(
        dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    ):
        print(f"megatron_taco: --taco-min-bytes auto: {describe_decision(group, gbps, min_bytes)}", flush=True)
    return CommOptions(min_bytes=min_bytes, chunk_bytes=chunk_bytes), gbps


def describe_decision(group: Optional[dist.ProcessGroup], gbps: float, min_bytes: int) -> str:
    """One line: which group, what the probe measured, what was decided."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    decision = (
        f"compression off (faster than {FAST_LINK_GBPS:g} GB/s)"
        if min_bytes >= NEVER
        else f"compression on for messages >= {min_bytes / 2**20:.2f} MiB"
    )
    return f"TP group ranks {ranks}: all-gather bus bandwidth {gbps:.1f} GB/s -> {decision}"
