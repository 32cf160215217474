"""Where the fixed cost of a compressed collective goes (2 GPUs, NVLink, small messages).

    python -m benchmarks.comm_overhead --out benchmarks/results/comm_overhead.md

Host (Python) time per call of each piece, measured without synchronising
(the CPU cost of launching, unless the GPU falls behind and the launch queue
fills), the same calls with a device synchronisation after each (latency), a
cProfile of the Python side of 200 compressed all-gathers, and a torch.profiler
table of 5 of them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

from megatron_taco import comm
from megatron_taco.codec import TacoCodec
from megatron_taco.testing.distributed import run_distributed

from .provenance import project_commit


def _per_call_us(fn, calls: int, sync_each: bool) -> float:
    """Wall microseconds per call; without ``sync_each`` the host's launch cost (the GPU may still be busy)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
        if sync_each:
            torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _python_profile(fn, calls: int = 200) -> str:
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def _worker():
    codec = TacoCodec()
    x = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)  # 1 MiB
    msg = codec.compress(x)
    gathered = torch.empty(2 * msg.numel(), dtype=torch.uint8, device="cuda")
    out = torch.empty(256, 4096, device="cuda", dtype=torch.bfloat16)
    options = comm.CommOptions(min_bytes=0)
    calls = {
        "torch add (reference launch)": lambda: torch.add(x, x),
        "codec.compress": lambda: codec.compress(x, out=msg),
        "codec.compress (new output buffer)": lambda: codec.compress(x),
        "codec.decompress_rows (2 rows)": lambda: codec.decompress_rows(
            gathered.view(2, -1), out.view(2, -1), validate=False
        ),
        "dist.all_gather_into_tensor (plain, async + wait)": lambda: dist.all_gather_into_tensor(
            out, x, async_op=True
        ).wait(),
        "comm.all_gather uncompressed": lambda: comm.all_gather(x, None, None, options),
        "comm.all_gather compressed": lambda: comm.all_gather(x, None, codec, options),
    }
    rows = {
        name: (_per_call_us(fn, 200, sync_each=False), _per_call_us(fn, 100, sync_each=True))
        for name, fn in calls.items()
    }
    python_profile = _python_profile(lambda: comm.all_gather(x, None, codec, options))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            comm.all_gather(x, None, codec, options)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=15)
    return rows, table, python_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/comm_overhead.md")
    args = parser.parse_args()
    os.environ["TACO_TEST_START_METHOD"] = "spawn"
    rows, table, python_profile = run_distributed(_worker, 2, backend="nccl", timeout=600)[0]
    lines = [
        "# Host cost of a compressed collective (1 MiB bf16, 2 GPUs, NVLink)",
        "",
        f"- Command: `python -m benchmarks.comm_overhead --out {args.out}`; commit {project_commit()}; "
        f"date {datetime.date.today().isoformat()}",
        "- *host us*: microseconds per call, averaged over 200 calls without synchronising (launch cost on the CPU,",
        "  unless the GPU falls behind and the launch queue fills); *latency us*: with a device synchronisation",
        "  after every call (100 calls).",
        "",
        "| call | host us | latency us |",
        "|---|---|---|",
        *[f"| {name} | {host:.1f} | {latency:.1f} |" for name, (host, latency) in rows.items()],
        "",
        "## cProfile (Python side), 200 compressed all-gathers, by own time",
        "",
        "```",
        python_profile.strip(),
        "```",
        "",
        "## torch.profiler, 5 compressed all-gathers",
        "",
        "```",
        table,
        "```",
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
