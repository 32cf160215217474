"""What it costs to give MAPL's receiving stage the token ids (issue 8, item 2), on 2 GPUs.

    python -m benchmarks.mapl_token_ids --out benchmarks/results/mapl_token_ids.md

The anchors a(tokens) need the token ids on both sides of a boundary. The trainer loads them on
every stage (each stage runs the data iterator), so the receiving stage pays one [b, s] int64
host-to-device copy per micro-batch. The alternative is to send them over the boundary with the
activations. For the micro-batch of the PP model in `e2e.py` (4 x 2048 tokens, h2048), this times,
per micro-batch and in each link regime (``LINK_REGIMES`` in megatron_taco/testing/distributed.py):
that copy from pageable and from pinned memory, sending the ids over the boundary instead, and the
forward boundary message itself, uncompressed and at MAPL 8x (r = 256). Median of 50, each call synchronised (latency).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

from megatron_taco.testing.distributed import LINK_REGIMES, run_distributed

from .provenance import project_commit

MICRO_BATCH, SEQ, HIDDEN, MAPL_8X_RANK = 4, 2048, 2048, 256


def _median_us(fn, calls: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _boundary_send(tensor: torch.Tensor):
    """Stage 0 sends ``tensor`` to stage 1 as megatron-core's P2P does (batched isend/irecv)."""
    op = dist.isend if dist.get_rank() == 0 else dist.irecv
    return lambda: [req.wait() for req in dist.batch_isend_irecv([dist.P2POp(op, tensor, 1 - dist.get_rank())])]


def _worker():
    device = torch.device("cuda", torch.cuda.current_device())
    tokens = torch.randint(0, 8192, (MICRO_BATCH, SEQ))
    pinned = tokens.pin_memory()
    rows = {
        "token ids: host-to-device copy, pageable": (tokens.numel() * 8, lambda: tokens.to(device)),
        "token ids: host-to-device copy, pinned, non_blocking": (
            tokens.numel() * 8,
            lambda: pinned.to(device, non_blocking=True),
        ),
        "token ids: sent over the boundary instead": (tokens.numel() * 8, _boundary_send(tokens.to(device))),
        "boundary message, uncompressed (bf16, d = 2048)": (
            SEQ * MICRO_BATCH * HIDDEN * 2,
            _boundary_send(torch.randn(SEQ, MICRO_BATCH, HIDDEN, device=device, dtype=torch.bfloat16)),
        ),
        "boundary message, MAPL 8x (bf16, r = 256)": (
            SEQ * MICRO_BATCH * MAPL_8X_RANK * 2,
            _boundary_send(torch.randn(SEQ, MICRO_BATCH, MAPL_8X_RANK, device=device, dtype=torch.bfloat16)),
        ),
    }
    measured = {name: (nbytes, _median_us(fn)) for name, (nbytes, fn) in rows.items()}
    # the copy is paid on the receiving stage; report what rank 1 saw for everything
    gathered = [None, None]
    dist.all_gather_object(gathered, measured)
    return gathered[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/mapl_token_ids.md")
    parser.add_argument("--regimes", default="nvlink,socket")
    args = parser.parse_args()
    os.environ["TACO_TEST_START_METHOD"] = "spawn"
    import triton

    lines = [
        "# MAPL: the cost of the token ids on the receiving stage (issue 8, item 2)",
        "",
        f"- Command: `python -m benchmarks.mapl_token_ids --out {args.out} --regimes {args.regimes}`",
        f"- Commit: {project_commit()}",
        f"- Date: {datetime.date.today().isoformat()}; 2 x {torch.cuda.get_device_name(0)}; torch {torch.__version__}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, triton {triton.__version__}",
        f"- One micro-batch of the PP model in `e2e.py`: {MICRO_BATCH} x {SEQ} tokens, hidden {HIDDEN}; median of 50 "
        "calls, each synchronised (latency), as seen on the receiving stage.",
        "",
        "| regime | what | bytes | us per micro-batch | vs MAPL 8x message | vs uncompressed message |",
        "|---|---|---|---|---|---|",
    ]
    for regime in args.regimes.split(","):
        measured = run_distributed(_worker, 2, backend="nccl", env=LINK_REGIMES[regime], timeout=300)[0]
        mapl_us = measured["boundary message, MAPL 8x (bf16, r = 256)"][1]
        plain_us = measured["boundary message, uncompressed (bf16, d = 2048)"][1]
        for name, (nbytes, us) in measured.items():
            lines.append(f"| {regime} | {name} | {nbytes} | {us:.1f} | {us / mapl_us:.3f} | {us / plain_us:.3f} |")
        print(f"{regime} done", flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
