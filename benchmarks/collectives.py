"""Compressed vs plain NCCL collectives on 2 GPUs, in three link regimes.

    python -m benchmarks.collectives --out-dir benchmarks/results

Regimes (``LINK_REGIMES`` in megatron_taco/testing/distributed.py), each a fresh pair of NCCL processes:
  nvlink  default transports
  shm     NCCL_P2P_DISABLE=1                      (host shared memory, PCIe-class)
  socket  + NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo (TCP over loopback, Ethernet-class)

For all-gather, reduce-scatter and all-reduce of bf16 tensors of 1-512 MiB
(size = the full tensor: all-gather output, reduce-scatter input), the median
time of the plain NCCL collective and of megatron_taco.comm's compressed one,
their ratio (speed-up), and bus bandwidth as nccl-tests defines it
(all-gather/reduce-scatter: size/t * (n-1)/n; all-reduce: 2x that). Also a
sweep of the pipelining piece size at 256 MiB, and the compressed result's
relative error against the plain one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import torch
import torch.distributed as dist

from megatron_taco import comm
from megatron_taco.codec import TacoCodec
from megatron_taco.comm.policy import FAST_LINK_GBPS, NEVER, auto_options
from megatron_taco.testing.distributed import LINK_REGIMES, run_distributed

from .provenance import project_commit

MIB = 1 << 20
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def _time_ms(fn, iters: int) -> float:
    """Median per-call time over ``iters`` calls, the max over ranks (a collective ends on its slowest rank)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _input(name: str, size_bytes: int, world: int) -> torch.Tensor:
    numel = size_bytes // 2
    rows = numel // 4096
    if name == "all_gather":
        rows //= world
    return torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)


def _call(name: str, x: torch.Tensor, codec, options):
    return getattr(comm, name)(x, None, codec, options)


def _regime_worker(sizes_mib, chunk_sweep_mib, iters_small: int, iters_large: int):
    world = dist.get_world_size()
    codec = TacoCodec()
    auto, link_gbps = auto_options(None, torch.device("cuda"))
    rows = []
    for name in COLLECTIVES:
        for size_mib in sizes_mib:
            x = _input(name, size_mib * MIB, world)
            iters = iters_small if size_mib <= 64 else iters_large
            options = comm.CommOptions(min_bytes=0)
            plain_ms = _time_ms(lambda: _call(name, x, None, options), iters)
            comp_ms = _time_ms(lambda: _call(name, x, codec, options), iters)
            exact = _call(name, x, None, options).double()
            approx = _call(name, x, codec, options).double()
            rel_err = float((approx - exact).norm() / exact.norm())
            factor = 2 * (world - 1) / world if name == "all_reduce" else (world - 1) / world
            size_bytes = size_mib * MIB
            rows.append(
                dict(
                    collective=name,
                    size_mib=size_mib,
                    plain_ms=plain_ms,
                    comp_ms=comp_ms,
                    speedup=plain_ms / comp_ms,
                    plain_busbw=size_bytes / plain_ms / 1e6 * factor,
                    comp_busbw=size_bytes / comp_ms / 1e6 * factor,
                    rel_err=rel_err,
                    auto_ms=_time_ms(lambda: _call(name, x, codec, auto), iters),
                )
            )
            del x, exact, approx
        torch.cuda.empty_cache()
    sweep = []
    for name in ("all_gather", "reduce_scatter"):
        x = _input(name, 256 * MIB, world)
        for chunk_mib in chunk_sweep_mib:
            options = comm.CommOptions(min_bytes=0, chunk_bytes=chunk_mib * MIB)
            sweep.append(
                dict(
                    collective=name,
                    chunk_mib=chunk_mib,
                    comp_ms=_time_ms(lambda: _call(name, x, codec, options), iters_large),
                )
            )
    return rows, sweep, {"link_gbps": link_gbps, "compresses": auto.min_bytes < NEVER}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--sizes-mib", default="1,4,16,64,256,512")
    parser.add_argument("--chunk-sweep-mib", default="0,8,32,128")
    parser.add_argument("--regimes", default="nvlink,shm,socket")
    parser.add_argument("--iters-small", type=int, default=20)
    parser.add_argument("--iters-large", type=int, default=5)
    args = parser.parse_args()
    assert torch.cuda.device_count() >= 2, "benchmarks/collectives.py needs 2 GPUs"
    os.environ["TACO_TEST_START_METHOD"] = "spawn"  # fresh processes: NCCL reads the regime's environment
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    chunks = [int(s) for s in args.chunk_sweep_mib.split(",")]
    results = {}
    for regime in args.regimes.split(","):
        print(f"regime {regime} ...", flush=True)
        rows, sweep, auto = run_distributed(
            _regime_worker,
            2,
            sizes,
            chunks,
            args.iters_small,
            args.iters_large,
            backend="nccl",
            env=LINK_REGIMES[regime],
            timeout=900,
        )[0]
        results[regime] = {"rows": rows, "sweep": sweep, "auto": auto}
        for r in rows:
            print(
                f"  {r['collective']:>14} {r['size_mib']:>4} MiB  plain {r['plain_ms']:8.3f} ms  "
                f"taco {r['comp_ms']:8.3f} ms  x{r['speedup']:.2f}  err {r['rel_err']:.4f}",
                flush=True,
            )
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "collectives.json"), "w") as f:
        json.dump(results, f, indent=1)
    _plot(results, os.path.join(args.out_dir, "collectives.png"))
    _write(args, results, os.path.join(args.out_dir, "collectives.md"))


def _plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
    for ax, name in zip(axes, COLLECTIVES):
        for regime, data in results.items():
            rows = [r for r in data["rows"] if r["collective"] == name]
            ax.plot([r["size_mib"] for r in rows], [r["speedup"] for r in rows], marker="o", label=regime)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel("message size (MiB, bf16)")
    axes[0].set_ylabel("speed-up vs NCCL bf16 (same run)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _write(args, results, path) -> None:
    import triton

    props = torch.cuda.get_device_properties(0)
    lines = [
        "# Compressed collectives vs NCCL bf16",
        "",
        f"- Command: `python -m benchmarks.collectives --out-dir {args.out_dir} --sizes-mib {args.sizes_mib} "
        f"--regimes {args.regimes}`",
        f"- Commit: {project_commit()}",
        f"- Date: {datetime.date.today().isoformat()}; 2 x {props.name}; torch {torch.__version__}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, triton {triton.__version__}",
        "- Codec: G=128 E4M3 ASH, folded fp32 scale (1.94x smaller than bf16); compression forced on (min_bytes=0); "
        "pieces of 32 MiB pipelined unless the sweep says otherwise.",
        "- Time: median over iterations (20 up to 64 MiB, 5 above) of CUDA-event time, max over the 2 ranks. "
        "Speed-up = plain time / compressed time, measured in the same process pair. Bus bandwidth as nccl-tests.",
        "- rel. err = ||compressed - plain|| / ||plain|| of the collective's result.",
        "",
        "![speed-up](collectives.png)",
        "",
    ]
    for regime, data in results.items():
        auto = data["auto"]
        lines += [
            f"## {regime}",
            "",
            f"Auto policy (`comm.policy.auto_options`): probe measured {auto['link_gbps']:.1f} GB/s bus bandwidth "
            f"(threshold {FAST_LINK_GBPS:.0f}) -> compression {'on' if auto['compresses'] else 'off'}.",
            "",
            "| collective | MiB | NCCL bf16 ms | TACO ms | speed-up | auto policy speed-up | NCCL busbw GB/s | "
            "TACO busbw GB/s (bf16-equivalent) | rel. err |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in data["rows"]:
            lines.append(
                f"| {r['collective']} | {r['size_mib']} | {r['plain_ms']:.3f} | {r['comp_ms']:.3f} | "
                f"{r['speedup']:.2f}x | {r['plain_ms'] / r['auto_ms']:.2f}x | {r['plain_busbw']:.1f} | "
                f"{r['comp_busbw']:.1f} | {r['rel_err']:.4f} |"
            )
        lines += [
            "",
            "Pipelining piece size at 256 MiB (compressed time, ms; 0 = one piece):",
            "",
            "| collective | "
            + " | ".join(f"{s['chunk_mib']} MiB" for s in data["sweep"][: len(args.chunk_sweep_mib.split(","))])
            + " |",
            "|---|" + "---|" * len(args.chunk_sweep_mib.split(",")),
        ]
        for name in ("all_gather", "reduce_scatter"):
            sel = [s for s in data["sweep"] if s["collective"] == name]
            lines.append(f"| {name} | " + " | ".join(f"{s['comp_ms']:.3f}" for s in sel) + " |")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
