"""Where the fixed cost of a compressed collective goes (2 GPUs, NVLink, small messages).

    python benchmarks/comm_overhead.py --out benchmarks/results/comm_overhead.md

Host (Python) time per call of each piece, measured without synchronising
(so it is the CPU cost of launching), and a torch.profiler CPU table of one
compressed all-gather of 1 MiB.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megatron_taco import comm  # noqa: E402
from megatron_taco.codec import TacoCodec  # noqa: E402
from megatron_taco.testing.distributed import run_distributed  # noqa: E402


def _host_us(fn, calls: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def _worker():
    codec = TacoCodec()
    x = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)  # 1 MiB
    msg = codec.compress(x)
    gathered = torch.empty(2 * msg.numel(), dtype=torch.uint8, device="cuda")
    out = torch.empty(256, 4096, device="cuda", dtype=torch.bfloat16)
    options = comm.CommOptions(min_bytes=0)
    rows = {
        "torch add (reference launch)": _host_us(lambda: torch.add(x, x)),
        "codec.compress": _host_us(lambda: codec.compress(x, out=msg)),
        "codec.decompress_rows (2 rows)": _host_us(lambda: codec.decompress_rows(gathered.view(2, -1), out.view(2, -1), validate=False)),
        "dist.all_gather_into_tensor (plain, async + wait)": _host_us(lambda: dist.all_gather_into_tensor(out, x, async_op=True).wait()),
        "comm.all_gather uncompressed": _host_us(lambda: comm.all_gather(x, None, None, options)),
        "comm.all_gather compressed": _host_us(lambda: comm.all_gather(x, None, codec, options)),
    }
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            comm.all_gather(x, None, codec, options)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=15)
    return rows, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/comm_overhead.md")
    args = parser.parse_args()
    os.environ["TACO_TEST_START_METHOD"] = "spawn"
    rows, table = run_distributed(_worker, 2, backend="nccl", timeout=600)[0]
    lines = [
        "# Host cost of a compressed collective (1 MiB bf16, 2 GPUs, NVLink)",
        "",
        f"- Command: `python benchmarks/comm_overhead.py --out {args.out}`; date {datetime.date.today().isoformat()}",
        "- Host microseconds per call, averaged over 200 calls without synchronising (launch cost on the CPU).",
        "",
        "| call | host us |",
        "|---|---|",
        *[f"| {name} | {us:.1f} |" for name, us in rows.items()],
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
