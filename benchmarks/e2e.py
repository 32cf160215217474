"""End-to-end evaluation on 2 GPUs: throughput and loss with TACO and MAPL.

    python -m benchmarks.e2e --out-dir benchmarks/results

Throughput: a GPT-style and a Qwen-style model sized so TP traffic matters,
TP=2 + SP, bf16, uncompressed vs TACO (the default auto link policy, and
optionally compression forced on), in the three link regimes of ``LINK_REGIMES``
(megatron_taco/testing/distributed.py), each a fresh NCCL process pair. Steady state:
the first steps are warm-up and excluded; the median step time of the rest. Every run ends with
one profiled step that splits GPU time into codec, NCCL (wire) and the rest.

PP=2 throughput: a wide, shallow GPT whose step is dominated by the boundary
transfers on slow links (one layer per stage), uncompressed vs MAPL 4x, 8x and
8x + residual VQ, with the same time split.

Loss: the throughput models (byte-level vocabulary) on real text (the Python
standard library's sources; validation on held-out files), same seeds, data
and steps: uncompressed (TP=2 + SP) vs TACO int8 (the configs' mode) vs MAPL 8x at PP=2 by
default (``--loss-variants`` adds the other TACO modes and MAPL 8x + VQ),
for several seeds. The loss runs go as concurrent process pairs
(``--loss-parallel``): sharing the GPUs changes how fast the runs go, not what
they compute. The report is rewritten after every part (and every loss run),
so a run cut short keeps what it measured; the defaults fit in one 10-minute
call on 2 x H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_taco.config.mapl import MaplConfig
from megatron_taco.config.taco import LinearSettings, TacoConfig
from megatron_taco.mapl.stage import CODEC_RANGE as MAPL_CODEC_RANGE
from megatron_taco.testing.distributed import LINK_REGIMES, run_distributed
from megatron_taco.testing.profiling import codec_operators
from megatron_taco.training.data import byte_text_batches, stdlib_text_files, synthetic_batches
from megatron_taco.training.loop import TrainConfig, Trainer
from megatron_taco.training.model import QWEN_ARCHITECTURE, ModelShape

from .provenance import project_commit

THROUGHPUT_MODELS = {
    "GPT (4L, h4096, ffn16384, seq2048)": ModelShape(
        num_layers=4, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=16384, vocab_size=32000, seq_length=2048
    ),
    "Qwen-style (4L, h3584, GQA 28/4, SwiGLU 18944, seq2048)": ModelShape(
        num_layers=4,
        hidden_size=3584,
        num_attention_heads=28,
        num_query_groups=4,
        ffn_hidden_size=18944,
        vocab_size=32000,
        seq_length=2048,
        **QWEN_ARCHITECTURE,
    ),
}
# the loss study trains the same models on byte-level text: only the vocabulary differs
LOSS_MODELS = {name: dataclasses.replace(shape, vocab_size=256) for name, shape in THROUGHPUT_MODELS.items()}
LOSS_LR = 3e-4
# Kineto then finalises CUPTI when a profile ends: a finished profile otherwise slows the steps that follow it
# in the same process (pytorch/pytorch#144455; measured in benchmarks/results/profiler_residue.md)
CUPTI_TEARDOWN = {"TEARDOWN_CUPTI": "1"}
# cuBLAS's documented setting for run-to-run reproducibility when several streams share a device
DETERMINISTIC_CUBLAS = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
PIPELINE_MODEL = (
    "GPT wide-shallow (2L, h2048, ffn8192, seq2048, vocab 8192)",
    ModelShape(
        num_layers=2, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192, vocab_size=8192, seq_length=2048
    ),
)
PIPELINE_MICRO_BATCH = 4  # 4 x 2048 tokens x 2048 x bf16 = 32 MiB per boundary message
TACO_KERNELS = ("_compress_kernel", "_decompress_sum_kernel")  # the Triton kernels of the TACO codec


def _forced_taco(mode: str, direction: str = "both", bwd_mode: Optional[str] = None) -> TacoConfig:
    """TACO on every linear and every message (min_bytes 0: no link policy)."""
    return TacoConfig(default=LinearSettings(mode=mode, direction=direction, bwd_mode=bwd_mode), min_bytes=0)


CONFIGS_MODE = "int8"  # configs/*.yaml's --taco-mode: what the headline rows time
TACO_AUTO = TacoConfig(default=LinearSettings(mode=CONFIGS_MODE))  # min_bytes None: the link probe decides
TACO_FORCED = _forced_taco(CONFIGS_MODE)
LOSS_VARIANTS = {  # name: (TACO, MAPL); TACO runs at TP=2 + SP, MAPL at PP=2
    "baseline": (None, None),
    "TACO fp8-ash": (_forced_taco("fp8-ash"), None),
    "TACO fp8-ash, forward only": (_forced_taco("fp8-ash", "fwd"), None),
    "TACO fp8-ash, backward only": (_forced_taco("fp8-ash", "bwd"), None),
    "TACO fp8 (no Hadamard)": (_forced_taco("fp8"), None),
    "TACO int8 (no Hadamard)": (TACO_FORCED, None),
    "TACO int8-ash": (_forced_taco("int8-ash"), None),
    "TACO fp4-ash": (_forced_taco("fp4-ash"), None),
    "TACO int4-ash": (_forced_taco("int4-ash"), None),
    "TACO fp4-ash forward, fp8-ash backward": (_forced_taco("fp4-ash", bwd_mode="fp8-ash"), None),
    "MAPL 8x (PP=2)": (None, MaplConfig(ratio=8)),
    "MAPL 8x + VQ 2 x 255 (PP=2)": (None, MaplConfig(ratio=8, vq_levels=2, vq_codes=255)),
}


def _gpu_time_split(trainer: Trainer, data) -> dict:
    """GPU time of one profiled step (ms of kernels, memory copies included) by category, and the host
    operators with the most own CPU time (to see whether the step waits for the host).

    codec: TACO's Triton kernels, and MAPL's work (the kernels of the MAPL codec range's operators, forward and
    backward: :func:`~megatron_taco.testing.profiling.codec_operators`); nccl: NCCL kernels, i.e. the wire,
    waiting for the peer included; other: the rest. Each kernel counts once, but kernels on different streams
    overlap, so the three can add up to more than the step.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    # one warm-up step under the profiler first: CUPTI's start-up would otherwise land in the recorded step
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
    ) as prof:
        for _ in range(2):
            trainer.train_step(data)
            torch.cuda.synchronize()
            prof.step()
    events = prof.events()

    def ms(kernels) -> float:
        return sum(k.time_range.end - k.time_range.start for k in kernels) / 1e3

    # device activity (kernels, copies), not the device-side spans the profiler draws for record_function ranges
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    nccl = [k for k in kernels if k.name.lower().startswith("nccl")]
    taco = [k for k in kernels if any(name in k.name for name in TACO_KERNELS)]
    # MAPL's kernels are ordinary GEMMs and element-wise ops: found through the host operator that launched them
    mapl = (
        sum(
            k.duration
            for op in codec_operators(events, MAPL_CODEC_RANGE)
            for k in op.kernels
            if not k.name.lower().startswith("nccl")
        )
        / 1e3
    )
    codec = ms(taco) + mapl
    return {
        "codec": codec,
        "nccl": ms(nccl),
        "other": ms(kernels) - ms(nccl) - codec,
        "host_ops": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12),
    }


def _median_step_s(trainer: Trainer, data, steps: int, warmup: int) -> float:
    """Median wall time of a training step, the first ``warmup`` steps excluded."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.train_step(data)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def _timed_run(cfg: TrainConfig, model_name: str, variant: str, steps: int, warmup: int) -> dict:
    """Train ``cfg`` on synthetic data: median step time, tokens/s and one profiled step's time split."""
    shape = cfg.shape
    trainer = Trainer(cfg)
    data = synthetic_batches(shape.vocab_size, shape.seq_length, cfg.micro_batch_size, seed=1)
    step_s = _median_step_s(trainer, data, steps, warmup)
    split = _gpu_time_split(trainer, data)
    trainer.close()
    tokens = shape.seq_length * cfg.micro_batch_size * cfg.num_microbatches
    if dist.get_rank() == 0:
        layout = "PP=2 " if cfg.pipeline_parallel > 1 else ""
        print(f"  {layout}{model_name} {variant}: {step_s * 1e3:.1f} ms/step", flush=True)
    torch.cuda.empty_cache()
    return dict(model=model_name, variant=variant, step_s=step_s, tokens_per_s=tokens / step_s, split=split)


def tp_config(shape: ModelShape, micro_batches: int, taco: Optional[TacoConfig] = None) -> TrainConfig:
    """The TP=2 + SP throughput layout: bf16, micro-batch 1 x ``micro_batches`` per step."""
    return TrainConfig(
        shape,
        tensor_parallel=2,
        sequence_parallel=True,
        micro_batch_size=1,
        num_microbatches=micro_batches,
        dtype="bf16",
        lr=1e-4,
        taco=taco,
    )


def _throughput_worker(steps: int, warmup: int, micro_batches: int, forced: bool):
    # the baseline again at the end (A-B-A): the first model trained in a process may run at another speed
    variants = (
        [("baseline", None), ("TACO auto", TACO_AUTO)]
        + (
            [
                ("TACO forced", TACO_FORCED),
                ("TACO fp8-ash forced", _forced_taco("fp8-ash")),
                ("TACO fp4-ash forced", _forced_taco("fp4-ash")),
            ]
            if forced
            else []
        )
        + [("baseline, again after TACO", None)]
    )
    return [
        _timed_run(tp_config(shape, micro_batches, taco), model_name, variant, steps, warmup)
        for model_name, shape in THROUGHPUT_MODELS.items()
        for variant, taco in variants
    ]


def _pipeline_worker(steps: int, warmup: int, micro_batches: int):
    """PP=2 throughput of the wide-shallow GPT: uncompressed vs MAPL 4x, 8x and 8x + VQ."""
    model_name, shape = PIPELINE_MODEL
    variants = (
        ("baseline", None),
        ("MAPL 4x", MaplConfig(ratio=4)),
        ("MAPL 8x", MaplConfig(ratio=8)),
        ("MAPL 8x + VQ 2 x 255", MaplConfig(ratio=8, vq_levels=2, vq_codes=255)),
    )
    return [
        _timed_run(
            TrainConfig(
                shape,
                pipeline_parallel=2,
                micro_batch_size=PIPELINE_MICRO_BATCH,
                num_microbatches=micro_batches,
                dtype="bf16",
                lr=1e-4,
                mapl=mapl,
            ),
            model_name,
            variant,
            steps,
            warmup,
        )
        for variant, mapl in variants
    ]


def _loss_worker(model_name: str, variant: str, seed: int, steps: int, micro_batches: int, eval_iters: int) -> dict:
    """One loss run: ``steps`` training steps on real text, then the validation loss."""
    shape = LOSS_MODELS[model_name]
    taco, mapl = LOSS_VARIANTS[variant]
    train_files, valid_files = stdlib_text_files()
    layout = dict(pipeline_parallel=2) if mapl else dict(tensor_parallel=2, sequence_parallel=True)
    cfg = TrainConfig(
        shape,
        **layout,
        micro_batch_size=1,
        num_microbatches=micro_batches,
        dtype="bf16",
        lr=LOSS_LR,
        seed=1234 + seed,
        taco=taco,
        mapl=mapl,
    )
    trainer = Trainer(cfg)
    train = byte_text_batches(train_files, shape.seq_length, 1, seed=1 + seed)
    losses = [trainer.train_step(train)["loss"] for _ in range(steps)]
    valid = trainer.evaluate(byte_text_batches(valid_files, shape.seq_length, 1, seed=2), eval_iters)
    trainer.close()
    return dict(train=losses, valid=valid)


def _loss_study(args, results: dict, report) -> None:
    """Every (model, variant, seed) run as its own process pair, ``args.loss_parallel`` at a time."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    variants = args.loss_variants.split(";")
    unknown = [v for v in variants if v not in LOSS_VARIANTS]
    if unknown:
        raise SystemExit(f"--loss-variants: unknown {unknown}; choose from {list(LOSS_VARIANTS)}")
    runs = [
        (model, variant, seed)
        for model in LOSS_MODELS
        if args.loss_models == "all" or model.lower().startswith(args.loss_models)
        for variant in variants
        for seed in range(args.loss_seeds)
    ]
    with ThreadPoolExecutor(max_workers=args.loss_parallel) as pool:
        futures = {
            pool.submit(
                run_distributed,
                _loss_worker,
                2,
                *run,
                args.loss_steps,
                args.micro_batches,
                args.eval_iters,
                backend="nccl",
                env=DETERMINISTIC_CUBLAS,
                timeout=1200,
            ): run
            for run in runs
        }
        for future in as_completed(futures):
            model, variant, seed = futures[future]
            curve = future.result()[0]
            results_key = f"{model} | {variant} | seed {seed}"
            results["loss"][results_key] = curve
            print(f"  {results_key}: final train {curve['train'][-1]:.4f} valid {curve['valid']:.4f}", flush=True)
            report("loss")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--regimes", default="nvlink,shm,socket")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--pipeline-micro-batches", type=int, default=8)
    parser.add_argument("--forced", action="store_true", help="also time TACO with every message compressed")
    parser.add_argument("--loss-steps", type=int, default=150)
    parser.add_argument("--loss-seeds", type=int, default=2)
    parser.add_argument("--loss-parallel", type=int, default=6, help="loss runs (process pairs) at a time")
    parser.add_argument(
        "--loss-variants",
        default="baseline;TACO int8 (no Hadamard);MAPL 8x (PP=2)",
        help=f"';'-separated, from: {'; '.join(LOSS_VARIANTS)}",
    )
    parser.add_argument("--eval-iters", type=int, default=20)
    parser.add_argument("--parts", default="pipeline,throughput,loss")
    parser.add_argument("--loss-models", default="all", help="all, gpt or qwen")
    parser.add_argument("--plot-only", metavar="E2E_JSON", help="redraw the plots of a finished run into --out-dir")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    if args.plot_only:
        with open(args.plot_only) as f:
            _plot(json.load(f), args.out_dir)
        return
    os.environ["TACO_TEST_START_METHOD"] = "spawn"
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    results = {"throughput": {}, "pipeline": {}, "loss": {}, "seconds": {}}
    started = time.perf_counter()

    def report(part: str) -> None:
        """Rewrite the report with what is measured so far; wall seconds per part (for sizing the defaults)."""
        results["seconds"].pop(part, None)
        results["seconds"][part] = round(time.perf_counter() - started - sum(results["seconds"].values()), 1)
        with open(os.path.join(args.out_dir, "e2e.json"), "w") as f:
            json.dump(results, f, indent=1)
        _plot(results, args.out_dir)
        _write(args, results)

    workers = {
        "throughput": (_throughput_worker, (args.micro_batches, args.forced)),
        "pipeline": (_pipeline_worker, (args.pipeline_micro_batches,)),
    }
    for part in args.parts.split(","):
        if part == "loss":
            print("loss study", flush=True)
            _loss_study(args, results, report)
            continue
        worker, worker_args = workers[part]
        for regime in args.regimes.split(","):
            print(f"{part}, regime {regime}", flush=True)
            results[part][regime] = run_distributed(
                worker,
                2,
                args.steps,
                args.warmup,
                *worker_args,
                backend="nccl",
                env={**LINK_REGIMES[regime], **CUPTI_TEARDOWN},
                timeout=1200,
            )[0]
            report(f"{part} {regime}")


def _loss_runs(results) -> dict:
    """{model: {variant: {seed: curve}}} from the flat "model | variant | seed N" keys."""
    runs: dict = {}
    order = list(LOSS_VARIANTS)
    for key, curve in sorted(
        results["loss"].items(), key=lambda kv: (kv[0].split(" | ")[0], order.index(kv[0].split(" | ")[1]), kv[0])
    ):
        model, variant, seed = key.split(" | ")
        runs.setdefault(model, {}).setdefault(variant, {})[int(seed.split()[1])] = curve
    return runs


def _plot(results, out_dir) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [part for part in ("throughput", "pipeline") if results[part]]
    if parts:  # tokens/s of every variant over the baseline of its process pair, per regime
        fig, axes = plt.subplots(1, len(parts), figsize=(7 * len(parts), 4), squeeze=False)
        for ax, part in zip(axes[0], parts):
            regimes = list(results[part])
            series: dict = {}
            for regime in regimes:
                rows = results[part][regime]
                base = {r["model"]: r["tokens_per_s"] for r in rows if r["variant"] == "baseline"}
                for r in rows:
                    if r["variant"] != "baseline":
                        label = f"{r['model'].split(' (')[0]} {r['variant']}"
                        series.setdefault(label, {})[regime] = r["tokens_per_s"] / base[r["model"]]
            width = 0.8 / max(1, len(series))
            for i, (label, ratios) in enumerate(series.items()):
                ax.bar(
                    [k + i * width for k in range(len(regimes))],
                    [ratios.get(reg, 0.0) for reg in regimes],
                    width,
                    label=label,
                )
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks([k + 0.4 - width / 2 for k in range(len(regimes))], regimes)
            ax.set_ylabel("tokens/s vs baseline")
            ax.set_title("TP=2 + SP, TACO" if part == "throughput" else "PP=2, MAPL")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "e2e_throughput.png"), dpi=110)
        plt.close(fig)
    runs = _loss_runs(results)
    if runs:
        fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
        for ax, (model, variants) in zip(axes[0], sorted(runs.items())):
            for variant, seeds in variants.items():
                train = [statistics.mean(values) for values in zip(*(c["train"] for c in seeds.values()))]
                smooth = [statistics.mean(train[max(0, i - 9) : i + 1]) for i in range(len(train))]
                ax.plot(smooth, label=f"{variant} ({len(seeds)} seeds)")
            ax.set_title(model)
            ax.set_xlabel("step")
            ax.set_ylabel("train loss (10-step mean, mean over seeds)")
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "e2e_loss.png"), dpi=110)
        plt.close(fig)


SPLIT_NOTE = (
    "GPU time of one profiled step (ms of kernels, rank 0): codec (TACO's Triton kernels; MAPL's "
    "projection, anchors, VQ and replica synchronisation, forward and backward) / NCCL (the wire, waiting "
    "for the peer included) / other; kernels on different streams overlap."
)


def _throughput_table(parts: dict) -> list:
    """Markdown rows of timed runs per regime, each against the baseline of its model in the same process pair."""
    lines = [
        "| regime | model | variant | ms/step | tokens/s | vs baseline | codec ms | NCCL ms | other ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for regime, rows in parts.items():
        base = {r["model"]: r["tokens_per_s"] for r in rows if r["variant"] == "baseline"}
        for r in rows:
            split = r["split"]
            lines.append(
                f"| {regime} | {r['model']} | {r['variant']} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
                f"{r['tokens_per_s'] / base[r['model']]:.2f}x | {split['codec']:.1f} | {split['nccl']:.1f} | "
                f"{split['other']:.1f} |"
            )
    return lines + [""]


def _write(args, results) -> None:
    import triton

    props = torch.cuda.get_device_properties(0)
    lines = [
        "# End-to-end evaluation (2 GPUs)",
        "",
        f"- Command: `python -m benchmarks.e2e --out-dir {args.out_dir} --regimes {args.regimes} --steps {args.steps} "
        f"--warmup {args.warmup} --micro-batches {args.micro_batches} --pipeline-micro-batches "
        f"{args.pipeline_micro_batches}{' --forced' if args.forced else ''} --loss-steps {args.loss_steps} "
        f"--loss-seeds {args.loss_seeds} --loss-parallel {args.loss_parallel} --loss-variants '{args.loss_variants}' "
        f"--eval-iters {args.eval_iters} "
        f"--parts {args.parts} --loss-models {args.loss_models}`",
        f"- Commit: {project_commit()}",
        f"- Date: {datetime.date.today().isoformat()}; 2 x {props.name}; torch {torch.__version__}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, triton {triton.__version__}",
        "- Trainer: `megatron_taco.training` (megatron-core GPTModel, local spec, DDP, Adam, bf16 with fp32 main params).",
        "- Wall seconds per part: " + ", ".join(f"{part} {sec:g}" for part, sec in results["seconds"].items()),
        "",
    ]
    if results["throughput"]:
        lines += [
            "## Throughput: TP=2 + SP, bf16, micro-batch 1 x "
            f"{args.micro_batches} per step; median of steps {args.warmup + 1}-{args.steps}",
            "",
            f"TACO = {CONFIGS_MODE} (the configs' mode), G=128, fp32 scales. *auto* = the default link policy (`--taco-min-bytes auto`: "
            "probe the TP group, compress only on slow links above the break-even size); *forced* = every message "
            "compressed. " + SPLIT_NOTE,
            "",
        ] + _throughput_table(results["throughput"])
        regime, rows = next(iter(results["throughput"].items()))
        for r in rows:
            if r["variant"] == "baseline":
                lines += [
                    f"Host operators of the profiled baseline step ({regime}, {r['model']}), by own CPU time:",
                    "",
                    "```",
                    r["split"]["host_ops"].strip(),
                    "```",
                    "",
                ]
    if results["pipeline"]:
        lines += [
            f"## Throughput: PP=2 (1F1B), bf16, micro-batch {PIPELINE_MICRO_BATCH} x "
            f"{args.pipeline_micro_batches} per step; median of steps {args.warmup + 1}-{args.steps}",
            "",
            f"Model: {PIPELINE_MODEL[0]}, one layer per stage, so the boundary messages "
            f"({PIPELINE_MICRO_BATCH} x 2048 x 2048 bf16 = 32 MiB each way per micro-batch uncompressed) weigh as "
            "much as possible against the compute on slow links. " + SPLIT_NOTE,
            "",
        ] + _throughput_table(results["pipeline"])
    runs = _loss_runs(results)
    if runs:
        lines += [
            f"## Loss on real text: the throughput models (vocabulary 256), bf16, Adam lr {LOSS_LR:g}, "
            f"{args.loss_steps} steps of 1 x {args.micro_batches} micro-batches of 2048 byte-level tokens "
            f"(Python stdlib sources), validation on held-out files ({args.eval_iters} sequences); baseline and TACO "
            "at TP=2 + SP, MAPL at PP=2 (the same model and initialisation: the trainer's init does not depend on "
            "the layout); seed s changes the initialisation and the training data order; "
            f"`CUBLAS_WORKSPACE_CONFIG={DETERMINISTIC_CUBLAS['CUBLAS_WORKSPACE_CONFIG']}`",
            "",
            "![loss curves](e2e_loss.png)",
            "",
            "*vs baseline*: the validation loss against the baseline run of the same seed, per seed, then their "
            "mean and sample standard deviation.",
            "",
            "| model | variant | seeds | final train loss (last 20 steps, mean over seeds) | validation loss (mean) "
            "| vs baseline per seed | vs baseline mean +- std |",
            "|---|---|---|---|---|---|---|",
        ]
        for model, variants in runs.items():
            base = variants.get("baseline", {})
            for variant, seeds in variants.items():
                order = sorted(seeds)
                tail = statistics.mean(statistics.mean(seeds[k]["train"][-20:]) for k in order)
                valid = statistics.mean(seeds[k]["valid"] for k in order)
                diffs = [100 * (seeds[k]["valid"] / base[k]["valid"] - 1) for k in order if k in base]
                spread = (
                    f"{statistics.mean(diffs):+.2f}% +- {statistics.stdev(diffs):.2f}"
                    if len(diffs) > 1
                    else (f"{diffs[0]:+.2f}%" if diffs else "-")
                )
                lines.append(
                    f"| {model} | {variant} | {len(order)} | {tail:.4f} | {valid:.4f} | "
                    f"{', '.join(f'{d:+.2f}%' for d in diffs)} | {spread} |"
                )
        lines.append("")
    with open(os.path.join(args.out_dir, "e2e.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
