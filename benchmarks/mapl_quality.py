"""MAPL quality study on 2 GPUs: PP=2, the same model, data, seed and steps side by side.

    python -m benchmarks.mapl_quality --out-dir benchmarks/results

Variants: uncompressed; MAPL at 2x, 4x, 8x, 16x (learned U + token anchors);
the SSN-style baseline (a fixed random orthogonal projection, no anchors) at
8x; MAPL 8x + residual VQ; MAPL 8x at two other manifold learning rates; later
rows with other anchor settings (``mapl_variants.py``).
Data: the Python standard library's sources, byte-level; validation on
held-out files. Writes mapl_quality.md, mapl_quality.json and a loss-curve PNG,
rewritten after every variant (a cut-short run leaves a valid partial report).
``--parallel N`` trains N variants at once, each on both GPUs (the model is too
small to keep the GPUs busy).
``--lr-decay-style cosine --lr-warmup-iters W`` runs Megatron's schedule (the
manifold learning rate follows it) for studies of longer runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os

import torch
import torch.distributed as dist

from megatron_taco.testing.distributed import run_distributed
from megatron_taco.training.cli import add_lr_schedule_args, lr_schedule_flags, lr_schedule_settings
from megatron_taco.training.data import byte_text_batches, stdlib_text_files
from megatron_taco.training.loop import TrainConfig, Trainer
from megatron_taco.training.model import ModelShape

from .mapl_variants import VARIANTS as ALL_VARIANTS
from .provenance import project_commit

MODEL = ModelShape(
    num_layers=8, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048, vocab_size=256, seq_length=512
)
VARIANTS = {
    name: ALL_VARIANTS[name]
    for name in (  # this study's rows, in report order
        "uncompressed",
        "MAPL 2x",
        "MAPL 4x",
        "MAPL 8x",
        "MAPL 16x",
        "fixed projection 8x (SSN-style)",
        "MAPL 8x + VQ (2 x 255 codes)",
        "MAPL 8x, manifold lr 0.001",
        "MAPL 8x, manifold lr 0.1",
        "MAPL 8x, anchor rank 64",
        "MAPL 16x, anchor rank 64",
        "MAPL 8x, anchor rank 64, position anchors",
        "MAPL 16x, anchor rank 64, position anchors",
        "MAPL 8x, anchor rank 64, position anchors, anchors from the embedding",
        "MAPL 16x, anchor rank 64, position anchors, anchors from the embedding",
        "MAPL 8x, anchor rank 256 (= vocab), position anchors, anchors from the embedding",
        "MAPL 16x, anchor rank 256 (= vocab), position anchors, anchors from the embedding",
        "MAPL 8x, anchor rank 256 (= vocab), position anchors, anchors from the embedding, 1 context token",
        "MAPL 8x, anchor rank 256 (= vocab), position anchors, anchors from the embedding, 3 context tokens",
        "MAPL 16x, anchor rank 256 (= vocab), position anchors, anchors from the embedding, 3 context tokens",
        "MAPL 8x, anchor rank 64, position anchors, anchors from the embedding, 3 context tokens",
        "MAPL 16x, anchor rank 64, position anchors, anchors from the embedding, 3 context tokens",
    )
}


def _train_variant(args: argparse.Namespace, name: str) -> dict:
    """One variant on 2 GPUs: its training losses and final validation loss (progress on rank 0's stdout)."""
    train_files, valid_files = stdlib_text_files()
    trainer = Trainer(_config(args, VARIANTS[name]))
    train = byte_text_batches(train_files, MODEL.seq_length, 4, seed=1)
    losses = []
    for step in range(1, args.steps + 1):
        losses.append(trainer.train_step(train)["loss"])
        if step % args.log_interval == 0 and dist.get_rank() == 0:
            print(
                f"  {name}: step {step}/{args.steps}, train loss (20-step mean) {sum(losses[-20:]) / 20:.4f}",
                flush=True,
            )
    valid = trainer.evaluate(byte_text_batches(valid_files, MODEL.seq_length, 4, seed=2), args.eval_iters)
    trainer.close()
    return dict(train=losses, valid=valid)


def _config(args: argparse.Namespace, mapl) -> TrainConfig:
    return TrainConfig(
        MODEL,
        pipeline_parallel=2,
        micro_batch_size=4,
        num_microbatches=args.micro_batches,
        dtype="bf16",
        lr=1e-3,
        seed=1234,
        mapl=mapl,
        **lr_schedule_settings(args, args.steps),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-iters", type=int, default=20)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--variants", default="", help="';'-separated subset of the variant names (default: all)")
    add_lr_schedule_args(parser, "--steps")
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="variants trained at the same time, each on both GPUs (the small model leaves them idle)",
    )
    parser.add_argument("--log-interval", type=int, default=250, help="steps between progress lines")
    args = parser.parse_args()
    names = [name for name in VARIANTS if not args.variants or name in args.variants.split(";")]
    unknown = set(args.variants.split(";")) - set(VARIANTS) if args.variants else set()
    if unknown:
        parser.error(f"--variants: unknown names {sorted(unknown)}; choose from {list(VARIANTS)}")
    os.environ["TACO_TEST_START_METHOD"] = "spawn"
    os.makedirs(args.out_dir, exist_ok=True)
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = {
            pool.submit(run_distributed, _train_variant, 2, args, name, backend="nccl", timeout=3600): name
            for name in names
        }
        for future in concurrent.futures.as_completed(futures):
            name = futures[future]
            results[name] = future.result()[0]
            print(
                f"  {name}: train {sum(results[name]['train'][-20:]) / 20:.4f} valid {results[name]['valid']:.4f}",
                flush=True,
            )
            _write(args, {n: results[n] for n in names if n in results})  # report order = variant order


def _write(args: argparse.Namespace, results: dict) -> None:
    """Report of the variants run so far (rank 0, after each variant)."""
    with open(os.path.join(args.out_dir, "mapl_quality.json"), "w") as f:
        json.dump(results, f)
    _plot(results, os.path.join(args.out_dir, "mapl_quality.png"))
    base = results.get("uncompressed", {}).get("valid", float("nan"))
    props = torch.cuda.get_device_properties(0)
    lines = [
        "# MAPL quality: PP=2, learned Stiefel projections vs a fixed one",
        "",
        f"- Command: `python -m benchmarks.mapl_quality --out-dir {args.out_dir} --steps {args.steps} "
        f"--eval-iters {args.eval_iters} --micro-batches {args.micro_batches} "
        + lr_schedule_flags(args)
        + f"--parallel {args.parallel}"
        + (f" --variants '{args.variants}'" if args.variants else "")
        + "`",
        f"- Commit: {project_commit()}",
        f"- Variants run: {len(results)} of {len(VARIANTS)}"
        + ("" if len(results) == len(VARIANTS) else " (cut short, or a subset was asked for)"),
        f"- Date: {datetime.date.today().isoformat()}; 2 x {props.name}; torch {torch.__version__}",
        f"- Model: GPT {MODEL.num_layers} layers, hidden {MODEL.hidden_size}, FFN {MODEL.ffn_hidden_size}, "
        f"seq {MODEL.seq_length}, byte-level vocab; PP=2 (one boundary), bf16, Adam, "
        f"{_config(args, VARIANTS['MAPL 8x']).lr_schedule_summary}, "
        f"{args.micro_batches} micro-batches of 4 per step, {args.steps} steps; manifold lr 0.01, momentum 0.9, "
        "anchor rank 16 unless the row says otherwise; VQ: EMA decay 0.9, every changed code word synced. "
        "Data: Python stdlib sources; validation on held-out files.",
        "",
        "![loss curves](mapl_quality.png)",
        "",
        "| variant | wire width | train loss (mean of last 20 steps) | validation loss | vs uncompressed |",
        "|---|---|---|---|---|",
    ]
    for name, res in results.items():
        mapl = VARIANTS[name]
        width = MODEL.hidden_size if mapl is None else mapl.wire_rank(MODEL.hidden_size)
        width = f"{width}" + (f" -> {mapl.vq_levels} indices" if mapl is not None and mapl.vq_levels else "")
        tail = res["train"][-20:]
        lines.append(
            f"| {name} | {width} | {sum(tail) / len(tail):.4f} | {res['valid']:.4f} | "
            f"{100 * (res['valid'] / base - 1):+.2f}% |"
        )
    with open(os.path.join(args.out_dir, "mapl_quality.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, res in results.items():
        train = res["train"]
        smooth = [sum(train[max(0, i - 19) : i + 1]) / len(train[max(0, i - 19) : i + 1]) for i in range(len(train))]
        ax.plot(smooth, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (20-step mean)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
