"""MAPL quality on CPU: a small GPT at PP=2 (2 gloo ranks, fp32), long enough to see how the gap evolves.

    python benchmarks/mapl_cpu_study.py --steps 1000 --out benchmarks/results/mapl_cpu_study.md

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
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megatron_taco.config.mapl import MaplConfig  # noqa: E402
from megatron_taco.testing.distributed import run_distributed  # noqa: E402
from megatron_taco.training.data import byte_text_batches, stdlib_text_files  # noqa: E402
from megatron_taco.training.loop import TrainConfig, Trainer  # noqa: E402
from megatron_taco.training.model import ModelShape  # noqa: E402

MODEL = ModelShape(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, vocab_size=256,
                   seq_length=128)
VARIANTS = {
    "uncompressed": None,
    "MAPL 8x": MaplConfig(ratio=8, anchor_rank=16),
    "MAPL 8x, manifold lr 0.1": MaplConfig(ratio=8, lr=0.1, anchor_rank=16),
    "MAPL 8x, anchor rank 64": MaplConfig(ratio=8, anchor_rank=64),
    "fixed projection 8x (SSN-style)": MaplConfig(ratio=8, fixed_projection=True, anchor_rank=0),
}
WINDOW = 50  # steps averaged for each point of the gap table


def _worker(names, steps: int):
    train_files, valid_files = stdlib_text_files()
    results = {}
    for name in names:
        cfg = TrainConfig(MODEL, pipeline_parallel=2, micro_batch_size=8, num_microbatches=2, lr=2e-3, seed=1234,
                          mapl=VARIANTS[name])
        trainer = Trainer(cfg)
        train = byte_text_batches(train_files, MODEL.seq_length, 8, seed=1)
        start = time.time()
        losses = [trainer.train_step(train)["loss"] for _ in range(steps)]
        valid = trainer.evaluate(byte_text_batches(valid_files, MODEL.seq_length, 8, seed=2), 10)
        trainer.close()
        results[name] = dict(train=losses, valid=valid, seconds=time.time() - start)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--out", default="benchmarks/results/mapl_cpu_study.md")
    args = parser.parse_args()
    results = run_distributed(_worker, 2, list(VARIANTS), args.steps, timeout=24 * 3600)[0]
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(results, f)
    points = [p for p in (100, 200, 300, 500, 700, 1000, 2000) if p <= args.steps]

    def window(curve, end):
        return sum(curve[end - WINDOW:end]) / WINDOW

    base = results["uncompressed"]
    lines = [
        "# MAPL quality on CPU: the loss gap over training (small GPT, PP=2)",
        "",
        f"- Command: `python benchmarks/mapl_cpu_study.py --steps {args.steps} --out {args.out}`",
        f"- Date: {datetime.date.today().isoformat()}; CPU, 2 gloo ranks, fp32; torch "
        f"{__import__('torch').__version__}, megatron-core {__import__('megatron.core').core.__version__}",
        f"- Model: GPT {MODEL.num_layers} layers, hidden {MODEL.hidden_size}, FFN {MODEL.ffn_hidden_size}, seq "
        f"{MODEL.seq_length}, byte-level vocab; PP=2 (one boundary); Adam lr 2e-3; 2 micro-batches of 8 per step; "
        "MAPL anchor rank 16, manifold lr 0.01 and momentum 0.9 unless the row says otherwise. Data: Python stdlib "
        "sources; validation on held-out files (10 batches). One seed.",
        "",
        f"Train-loss gap to uncompressed, mean of the {WINDOW} steps before each point, and final validation loss:",
        "",
        "| variant | " + " | ".join(f"step {p}" for p in points) + " | validation loss | vs uncompressed | seconds |",
        "|---|" + "---|" * (len(points) + 3),
    ]
    for name, res in results.items():
        gaps = " | ".join(f"{100 * (window(res['train'], p) / window(base['train'], p) - 1):+.1f}%" for p in points)
        lines.append(f"| {name} | {gaps} | {res['valid']:.4f} | {100 * (res['valid'] / base['valid'] - 1):+.1f}% | "
                     f"{res['seconds']:.0f} |")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
