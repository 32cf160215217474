"""Bandwidth of the fused TACO kernels vs a device-to-device copy, on one GPU.

    python -m benchmarks.kernels --out benchmarks/results/kernels.md
    python -m benchmarks.kernels --fmt e2m1 --out benchmarks/results/kernels_fp4.md     # a 4-bit format

For bf16 and fp32 inputs of 8-512 MiB: compress, decompress, and decompress-sum
of N = 2 and 4 messages. Achieved bandwidth counts the bytes each kernel must
read and write (input + message, or N messages + output); it is reported as a
fraction of a torch device-to-device copy of the input measured in the same
way in the same run. Two ways of timing, both reported:

* ``do_bench``: one call at a time, the L2 cache flushed before each (a cold call);
* back to back: calls replayed in a CUDA graph for about 100 ms (no host time between them, no flush), as a
  training step's kernels follow each other (``triton.testing.do_bench_cudagraph``).

Beside them: the torch eager reference and a torch.compile of it.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from megatron_taco.codec import TacoCodec, reference
from megatron_taco.codec import kernels as taco_kernels

from .provenance import project_commit

MIB = 1 << 20


def _bench(fn) -> float:
    """Median milliseconds of fn(), one call at a time with the L2 cache flushed before each."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _bench_back_to_back(fn) -> float:
    """Median milliseconds per call of fn() replayed back to back in a CUDA graph (no host time, no flush);
    NaN, with the reason printed, where fn cannot be captured."""
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as exc:  # report, do not hide
        print(f"back-to-back timing failed: {type(exc).__name__}: {exc}", flush=True)
        return float("nan")


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/kernels.md")
    parser.add_argument("--sizes-mib", default="8,32,64,128,256,512")
    parser.add_argument("--compare-sizes-mib", default="64,256", help="sizes where the torch reference runs too")
    parser.add_argument("--fmt", default="e4m3", help="element format: e4m3, e5m2, int8, e2m1 (FP4), int4")
    parser.add_argument("--transform", default="ash", help="ash or none")
    parser.add_argument("--scales", default="fp32", help="fp32, dual or e8m0")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--backend", default="triton", help="triton, or te (Transformer Engine's cast)")
    parser.add_argument("--no-sweep", action="store_true", help="keep the shipped launch configs")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="input dtypes, comma-separated")
    args = parser.parse_args()
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    assert torch.cuda.is_available(), "benchmarks/kernels.py needs a CUDA GPU"
    torch.manual_seed(0)
    codec = TacoCodec(args.group_size, args.fmt, args.transform, args.scales, backend=args.backend)
    settings = codec.settings

    def reference_compress(x):
        groups = x.numel() // settings.group_size
        return reference.encode_groups(x.float().view(groups, settings.group_size), settings)

    sweep = [] if args.no_sweep else _sweep_launch_configs(codec, dtypes)
    compiled_compress = torch.compile(reference_compress)
    rows = []
    for dtype in dtypes:
        for size_mib in (int(s) for s in args.sizes_mib.split(",")):
            numel = size_mib * MIB // torch.empty((), dtype=dtype).element_size()
            x = torch.randn(numel, device="cuda", dtype=dtype)
            in_bytes = x.numel() * x.element_size()
            msg_bytes = codec.compressed_nbytes(numel)
            copy_out = torch.empty_like(x)
            copy_ms = _bench(lambda: copy_out.copy_(x))
            copy_bw = _gbps(2 * in_bytes, copy_ms)
            buf = torch.empty(msg_bytes, dtype=torch.uint8, device="cuda")
            comp_ms = _bench(lambda: codec.compress(x, out=buf))
            dec_ms = _bench(lambda: codec.decompress(buf, x.shape, dtype, validate=False))
            # back to back: the same kernels in a CUDA graph (decompress writes into a fixed output)
            dec_out = torch.empty_like(x)
            copy_b2b_bw = _gbps(2 * in_bytes, _bench_back_to_back(lambda: copy_out.copy_(x)))
            comp_b2b_ms = _bench_back_to_back(lambda: codec.compress(x, out=buf))
            dec_b2b_ms = _bench_back_to_back(
                lambda: taco_kernels.decompress_rows(buf.view(1, -1), dec_out.view(1, -1), settings)
            )
            row = dict(
                dtype=str(dtype).replace("torch.", ""),
                size=size_mib,
                copy_ms=copy_ms,
                copy_bw=copy_bw,
                comp_ms=comp_ms,
                comp_frac=_gbps(in_bytes + msg_bytes, comp_ms) / copy_bw,
                dec_ms=dec_ms,
                dec_frac=_gbps(in_bytes + msg_bytes, dec_ms) / copy_bw,
                copy_b2b_bw=copy_b2b_bw,
                comp_b2b_frac=_gbps(in_bytes + msg_bytes, comp_b2b_ms) / copy_b2b_bw,
                dec_b2b_frac=_gbps(in_bytes + msg_bytes, dec_b2b_ms) / copy_b2b_bw,
            )
            for n in (2, 4):
                bufs = buf.unsqueeze(0).repeat(n, 1)
                ms = _bench(lambda: codec.decompress_sum(bufs, x.shape, dtype, validate=False))
                row[f"sum{n}_ms"] = ms
                row[f"sum{n}_frac"] = _gbps(n * msg_bytes + in_bytes, ms) / copy_bw
                bufs = None  # freed before the next one
            if str(size_mib) in args.compare_sizes_mib.split(","):
                row["eager_ms"] = _bench(lambda: reference_compress(x))
                try:
                    compiled_compress(x)
                    row["compiled_ms"] = _bench(lambda: compiled_compress(x))
                except Exception as exc:  # report, do not hide
                    row["compiled_ms"] = float("nan")
                    print(f"torch.compile of the reference failed: {type(exc).__name__}: {exc}", flush=True)
            rows.append(row)
            print(row, flush=True)
            x = buf = copy_out = dec_out = None  # freed before the next size
            torch.cuda.empty_cache()
    _write(args, rows, sweep, f"{codec.settings.describe()}, backend {args.backend}")


def _sweep_launch_configs(codec: TacoCodec, dtypes) -> list:
    """Time each kernel at 256 MiB for several warp counts and elements per thread; keep the best."""
    group = codec.settings.group_size  # more elements per thread than a group holds: the same launch
    configs = sorted({(warps, min(per_thread, group)) for warps in (1, 2, 4) for per_thread in (8, 16, 32, 64)})
    inputs = {
        dtype: torch.randn(256 * MIB // torch.empty((), dtype=dtype).element_size(), device="cuda", dtype=dtype)
        for dtype in dtypes
    }
    results = []
    for kernel in ("compress", "decompress_sum"):
        best = None
        for config in configs:
            taco_kernels.LAUNCH_CONFIG[kernel] = config
            total = 0.0
            for dtype, x in inputs.items():
                buf = codec.compress(x)
                if kernel == "compress":
                    total += _bench(lambda: codec.compress(x, out=buf))
                else:
                    bufs = buf.unsqueeze(0).repeat(2, 1)
                    total += _bench(lambda: codec.decompress_sum(bufs, x.shape, dtype, validate=False))
            results.append((kernel, config, total))
            print(f"sweep {kernel} warps={config[0]} elements per thread={config[1]}: {total:.3f} ms", flush=True)
            if best is None or total < best[1]:
                best = (config, total)
        taco_kernels.LAUNCH_CONFIG[kernel] = best[0]
        print(f"chosen {kernel}: warps={best[0][0]} elements per thread={best[0][1]}", flush=True)
    return results


def _write(args, rows, sweep, codec_description: str) -> None:
    props = torch.cuda.get_device_properties(0)
    lines = [
        "# TACO kernel bandwidth",
        "",
        f"- Command: `python -m benchmarks.kernels --out {args.out} --fmt {args.fmt} --transform {args.transform} "
        f"--scales {args.scales} --group-size {args.group_size} --backend {args.backend}"
        f"{' --no-sweep' if args.no_sweep else ''} --sizes-mib {args.sizes_mib} --compare-sizes-mib {args.compare_sizes_mib}"
        f" --dtypes {args.dtypes}`",
        f"- Commit: {project_commit()}",
        f"- Date: {datetime.date.today().isoformat()}; GPU: {props.name} ({props.multi_processor_count} SMs); "
        f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}",
        f"- Codec: {codec_description}. Times are medians of `triton.testing.do_bench` (one call at a time, L2 "
        "flushed before each) and, in the back-to-back columns, of `do_bench_cudagraph` (calls replayed in a CUDA "
        "graph, no flush).",
        "- Fraction = achieved bandwidth / bandwidth of a device-to-device copy of the input, timed the same way in "
        "the same run. Bytes counted: compress and decompress = input tensor + message; decompress-sum of N = N "
        "messages + output.",
        "",
        f"- Launch configs{' (shipped)' if args.no_sweep else ' chosen by the sweep below'}: "
        f"{dict(taco_kernels.LAUNCH_CONFIG)} (warps, elements per thread).",
        "",
        "| dtype | MiB | copy GB/s | compress ms | compress / copy | decompress ms | decompress / copy | "
        "decompress-sum N=2 / copy | N=4 / copy | back to back: copy GB/s | compress / copy | decompress / copy | "
        "torch eager compress ms | torch.compile compress ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eager = f"{r['eager_ms']:.3f} ({r['eager_ms'] / r['comp_ms']:.1f}x slower)" if "eager_ms" in r else "-"
        comp = f"{r['compiled_ms']:.3f} ({r['compiled_ms'] / r['comp_ms']:.1f}x slower)" if "compiled_ms" in r else "-"
        lines.append(
            f"| {r['dtype']} | {r['size']} | {r['copy_bw']:.0f} | {r['comp_ms']:.3f} | {r['comp_frac']:.2f} | "
            f"{r['dec_ms']:.3f} | {r['dec_frac']:.2f} | {r['sum2_frac']:.2f} | {r['sum4_frac']:.2f} | "
            f"{r['copy_b2b_bw']:.0f} | {r['comp_b2b_frac']:.2f} | {r['dec_b2b_frac']:.2f} | {eager} | {comp} |"
        )
    if sweep:
        lines += [
            "",
            f"## Launch-config sweep (256 MiB, sum of the {args.dtypes} times)",
            "",
            "| kernel | warps | elements per thread | ms |",
            "|---|---|---|---|",
        ]
        lines += [f"| {k} | {c[0]} | {c[1]} | {t:.3f} |" for k, c, t in sweep]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
