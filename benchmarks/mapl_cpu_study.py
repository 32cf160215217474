"""MAPL quality on CPU: a small GPT at PP=2 (2 gloo ranks, fp32), long enough to see how the gap evolves.

    python -m benchmarks.mapl_cpu_study --steps 1000 --out benchmarks/results/mapl_cpu_study.md

Complements ``mapl_quality.py`` (GPU, bf16, a 4x wider model, 250 steps) where GPU time is short:
same trainer, data (Python stdlib sources, byte-level) and variants, a model small enough for a
CPU (hidden 128, so 8x leaves r = 16), and the loss gap to the uncompressed run at several points
of training rather than only at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from typing import Optional

from megatron_taco.testing.distributed import run_distributed
from megatron_taco.training.cli import add_lr_schedule_args, lr_schedule_flags, lr_schedule_settings
from megatron_taco.training.data import byte_text_batches, stdlib_text_files
from megatron_taco.training.loop import TrainConfig
from megatron_taco.training.model import ModelShape

from .mapl_variants import VARIANTS as ALL_VARIANTS
from .mapl_variants import make_trainer
from .provenance import project_commit

MODEL = ModelShape(
    num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, vocab_size=256, seq_length=128
)
VARIANTS = {
    name: ALL_VARIANTS[name]
    for name in (  # this study's rows, in report order
        "uncompressed",
        "MAPL 8x",
        "MAPL 8x, manifold lr 0.1",
        "MAPL 8x, anchor rank 64",
        "fixed projection 8x (SSN-style)",
        "MAPL 8x, anchor rank 128 (= hidden)",
        "MAPL 8x, anchor rank 64, manifold lr 0.1",
        "MAPL 16x, anchor rank 64",
        "MAPL 8x, anchor rank 64, position anchors",
        "MAPL 8x, anchor rank 64, manifold lr 0.1, position anchors",
        "MAPL 8x, anchor rank 128, position anchors",
        "MAPL 16x, anchor rank 64, position anchors",
        "MAPL 8x, anchor rank 64, position anchors, anchors from the embedding",
        "MAPL 16x, anchor rank 64, position anchors, anchors from the embedding",
        "MAPL 8x, anchor rank 128, position anchors, anchors from the embedding",
        "MAPL 8x, anchor rank 128, position anchors, anchors from the embedding, 1 context token",
        "MAPL 8x, anchor rank 128, position anchors, anchors from the embedding, 3 context tokens",
        "MAPL 8x, anchor rank 64, position anchors, anchors from the embedding, 3 context tokens",
        "MAPL 16x, anchor rank 64, position anchors, anchors from the embedding, 3 context tokens",
        "uncompressed + MAPL's anchors (rank 128, positions, 3 context tokens), no compression",
    )
}
WINDOW = 50  # steps averaged for each point of the gap table


def study_config(mapl, seed: int, **schedule) -> TrainConfig:
    """The study's training settings for one run (``schedule``: TrainConfig's learning-rate schedule fields)."""
    return TrainConfig(
        MODEL,
        pipeline_parallel=2,
        micro_batch_size=8,
        num_microbatches=2,
        lr=2e-3,
        seed=1234 + seed,
        mapl=mapl,
        **schedule,
    )


def study_run(mapl, seed: int, steps: int, after_step=None, schedule: Optional[dict] = None) -> dict:
    """One run of the study's model: ``steps`` steps on stdlib text, then the validation loss.

    Seed s changes the initialisation and the order of the training data; ``after_step(trainer, step)``, if
    given, runs after every step (for experiments that act on the trainer between steps); ``schedule``: the
    learning-rate schedule's TrainConfig fields (default: constant).
    """
    train_files, valid_files = stdlib_text_files()
    trainer = make_trainer(study_config(mapl, seed, **(schedule or {})))
    train = byte_text_batches(train_files, MODEL.seq_length, 8, seed=1 + seed)
    start = time.time()
    losses = []
    for step in range(steps):
        losses.append(trainer.train_step(train)["loss"])
        if after_step is not None:
            after_step(trainer, step)
    valid = trainer.evaluate(byte_text_batches(valid_files, MODEL.seq_length, 8, seed=2), 10)
    trainer.close()
    return dict(train=losses, valid=valid, seconds=time.time() - start)


def _worker(names, steps: int, seeds: int, schedule: dict):
    """{variant: {seed: curve}}."""
    return {
        name: {seed: study_run(VARIANTS[name], seed, steps, schedule=schedule) for seed in range(seeds)}
        for name in names
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/mapl_cpu_study.md")
    parser.add_argument(
        "--variants",
        default=";".join(VARIANTS),
        help="names from VARIANTS separated by ';' (uncompressed is always run: the reference)",
    )
    add_lr_schedule_args(parser, "--steps")
    args = parser.parse_args()
    schedule = lr_schedule_settings(args, args.steps)
    names = ["uncompressed"] + [n for n in args.variants.split(";") if n != "uncompressed"]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    results = run_distributed(_worker, 2, names, args.steps, args.seeds, schedule, timeout=24 * 3600)[0]
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(results, f)
    points = [p for p in (100, 200, 300, 500, 700, 1000, 2000) if p <= args.steps]

    def gap(name, seed, end):
        """Train-loss gap to the same seed's uncompressed run, mean of the WINDOW steps before ``end``."""
        mine, base = results[name][seed]["train"], results["uncompressed"][seed]["train"]
        return sum(mine[end - WINDOW : end]) / sum(base[end - WINDOW : end]) - 1

    lines = [
        "# MAPL quality on CPU: the loss gap over training (small GPT, PP=2)",
        "",
        f"- Command: `python -m benchmarks.mapl_cpu_study --steps {args.steps} --seeds {args.seeds} --out {args.out} "
        + lr_schedule_flags(args)
        + f"--variants '{';'.join(names[1:])}'`",
        f"- Commit: {project_commit()}",
        f"- Date: {datetime.date.today().isoformat()}; CPU, 2 gloo ranks, fp32; torch "
        f"{__import__('torch').__version__}, megatron-core {__import__('megatron.core').core.__version__}",
        f"- Model: GPT {MODEL.num_layers} layers, hidden {MODEL.hidden_size}, FFN {MODEL.ffn_hidden_size}, seq "
        f"{MODEL.seq_length}, byte-level vocab; PP=2 (one boundary); Adam, "
        f"{study_config(VARIANTS['MAPL 8x'], 0, **schedule).lr_schedule_summary}; 2 micro-batches of 8 per step; "
        "MAPL anchor rank 16, manifold lr 0.01 and momentum 0.9 unless the row says otherwise. Data: Python stdlib "
        f"sources; validation on held-out files (10 batches). Seeds: {args.seeds} (seed s changes the "
        "initialisation and the order of the training data; every gap is against the same seed's uncompressed run).",
        "",
        f"Train-loss gap to uncompressed (mean of the {WINDOW} steps before each point, mean over seeds) and final "
        "validation loss:",
        "",
        "| variant | "
        + " | ".join(f"step {p}" for p in points)
        + " | validation loss (mean) | vs uncompressed per seed "
        "| vs uncompressed mean +- std | seconds per run |",
        "|---|" + "---|" * (len(points) + 4),
    ]
    for name, runs in results.items():
        seeds = sorted(runs)
        gaps = " | ".join(f"{100 * statistics.mean(gap(name, k, p) for k in seeds):+.1f}%" for p in points)
        valid = [100 * (runs[k]["valid"] / results["uncompressed"][k]["valid"] - 1) for k in seeds]
        spread = (
            f"{statistics.mean(valid):+.1f}% +- {statistics.stdev(valid):.1f}"
            if len(valid) > 1
            else f"{valid[0]:+.1f}%"
        )
        lines.append(
            f"| {name} | {gaps} | {statistics.mean(runs[k]['valid'] for k in seeds):.4f} | "
            f"{', '.join(f'{v:+.1f}%' for v in valid)} | {spread} | "
            f"{statistics.mean(runs[k]['seconds'] for k in seeds):.0f} |"
        )
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
