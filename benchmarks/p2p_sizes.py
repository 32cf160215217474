"""Point-to-point bandwidth by message size, the way megatron-core's pipeline schedules send (GPU, 2 ranks).

    torchrun --nproc-per-node 2 -m benchmarks.p2p_sizes [--link socket|nvlink] [--json FILE]

Rank 0 sends one bf16 message per size to rank 1 with ``batch_isend_irecv`` (as the 1F1B schedule does); the
time is the median of 10 round trips / 2 after 3 warm-ups. Answers: does a message 8x smaller go 8x faster
on this link, or does a per-message cost dominate (MAPL's 8x boundary messages are 4 MiB where the
uncompressed ones are 32 MiB in the Megatron-LM PP=2 rows)?
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

SIZES_MIB = (0.5, 1, 2, 4, 8, 16, 32, 64)


def _round_trip(tensor: torch.Tensor, peer: int) -> float:
    """Seconds for tensor to go to the peer and come back."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for send_first in (True, False) if dist.get_rank() == 0 else (False, True):
        op = dist.P2POp(dist.isend if send_first else dist.irecv, tensor, peer)
        for req in dist.batch_isend_irecv([op]):
            req.wait()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--link", default="?", help="label for the link regime the environment sets")
    parser.add_argument("--json", help="write the table here (rank 0)")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    peer = 1 - rank
    rows = []
    for mib in SIZES_MIB:
        tensor = torch.ones(int(mib * 2**20) // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            _round_trip(tensor, peer)
        seconds = statistics.median(_round_trip(tensor, peer) for _ in range(10)) / 2
        rows.append({"MiB": mib, "ms": round(seconds * 1e3, 3), "GB/s": round(mib * 2**20 / seconds / 1e9, 2)})
    if rank == 0:
        for row in rows:
            print(f"p2p {args.link}: {row['MiB']:>5} MiB  {row['ms']:8.3f} ms  {row['GB/s']:6.2f} GB/s", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"link": args.link, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
