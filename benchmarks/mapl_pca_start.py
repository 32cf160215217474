"""Would a data-driven start for MAPL's projection close the early loss gap? (CPU, PP=2; a negative result)

    python -m benchmarks.mapl_pca_start --out benchmarks/results/mapl_pca_start.md

The MAPL loss gap forms in the first ~100 steps (``results/archive/mapl/mapl_cpu_study_seeds.md``), when U is still the random
start. This tries the obvious fix on the model of ``mapl_cpu_study.py`` at 8x (anchor rank 64, position
anchors, anchors starting from noise as when this was measured): the sending stage accumulates the second
moment C = E[x x^T] of what it projects, x = h - a(t, p), and after a step sets U to C's top-r eigenvectors,
broadcast to the receiving replica (momentum reset);
*once* does it after step 1, *tracking* after each of the first 100 steps with C an EMA (decay 0.9), after
which the Riemannian optimizer continues. Reported against the default MAPL 8x run of the same seed. The
sender's statistics come from wrapping ``BoundaryCodec.project`` (an experiment, not a product path).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import torch
import torch.distributed as dist

from megatron_taco.config.mapl import MaplConfig
from megatron_taco.mapl.boundary import BoundaryCodec
from megatron_taco.testing.distributed import run_distributed
from megatron_taco.training.loop import Trainer

from .mapl_cpu_study import study_run
from .provenance import project_commit

MAPL = MaplConfig(ratio=8, anchor_rank=64, position_anchors=True, anchor_init="random")  # as measured
VARIANTS = {
    "MAPL 8x (random start)": 0,
    "PCA start once (after step 1)": 1,
    "PCA tracking for 100 steps (EMA 0.9)": 100,
}  # name: steps after which U is reset to the PCA
EMA_DECAY = 0.9


def _record_second_moments(moments: dict) -> None:
    """Wrap the sender's projection so each training forward adds E[x x^T] of its input to ``moments``."""
    project = BoundaryCodec.project

    def recording_project(self, hidden, tokens, positions=None, previous=None):
        if torch.is_grad_enabled():
            with torch.no_grad():
                anchors = self(tokens, positions, previous)
                x = (hidden.float() if anchors is None else hidden.float() - anchors).reshape(-1, self.hidden_size)
                moments[self.boundary] = moments.get(self.boundary, 0) + x.T @ x / x.shape[0]
        return project(self, hidden, tokens, positions, previous)

    BoundaryCodec.project = recording_project


def _reset_to_pca(trainer: Trainer, moments: dict, ema: dict) -> None:
    """Sender: U := top-r eigenvectors of the EMA of C; broadcast to the receiver; momentum reset."""
    sync = trainer.mapl_sync
    for index, boundary in enumerate(sync.trainable):
        sender = sync.senders[boundary.boundary]
        if dist.get_rank() == sender:
            step_moment = moments.pop(boundary.boundary)
            previous = ema.get(boundary.boundary)
            ema[boundary.boundary] = (
                step_moment if previous is None else (EMA_DECAY * previous + (1 - EMA_DECAY) * step_moment)
            )
            eigenvectors = torch.linalg.eigh(ema[boundary.boundary].double())[1]
            top = eigenvectors[:, -boundary.rank :].flip(-1).float().contiguous()
        else:
            top = torch.empty_like(boundary.projection)
        dist.broadcast(top, src=sender, group=sync.groups[boundary.boundary])
        with torch.no_grad():
            boundary.projection.copy_(top)
        sync.optimizer.buffers[index].zero_()


def _worker(pca_steps: int, steps: int, seed: int) -> dict:
    moments: dict = {}
    ema: dict = {}
    _record_second_moments(moments)

    def after_step(trainer: Trainer, step: int) -> None:
        if step < pca_steps:
            _reset_to_pca(trainer, moments, ema)
        else:
            moments.clear()

    return study_run(MAPL, seed, steps, after_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/mapl_pca_start.md")
    args = parser.parse_args()
    results = {
        name: {
            seed: run_distributed(_worker, 2, pca_steps, args.steps, seed, timeout=3600)[0]
            for seed in range(args.seeds)
        }
        for name, pca_steps in VARIANTS.items()
    }
    base = results["MAPL 8x (random start)"]

    def window(curve, end):
        return statistics.mean(curve[end - 50 : end])

    points = [p for p in (100, 200, 300, 500) if p <= args.steps]
    lines = [
        "# A PCA start for MAPL's projection (CPU, PP=2, 8x)",
        "",
        f"- Command: `python -m benchmarks.mapl_pca_start --steps {args.steps} --seeds {args.seeds} --out {args.out}`",
        f"- Commit: {project_commit()}",
        f"- Date: {datetime.date.today().isoformat()}; CPU, 2 gloo ranks, fp32; torch {torch.__version__}",
        "- Model and data: those of `mapl_cpu_study.py` (GPT 4L h128, seq 128, byte-level stdlib sources, Adam "
        "lr 2e-3, 2 x 8 sequences per step); MAPL 8x (r = 16), anchor rank 64, position anchors, manifold lr 0.01.",
        "",
        "Train-loss change against the random start of the same seed (mean of the 50 steps before each point, "
        "mean over seeds) and final validation loss:",
        "",
        "| variant | " + " | ".join(f"step {p}" for p in points) + " | validation (mean) | vs random start per seed |",
        "|---|" + "---|" * len(points) + "---|---|",
    ]
    for name, seeds in results.items():
        gaps = [
            statistics.mean(100 * (window(seeds[s]["train"], p) / window(base[s]["train"], p) - 1) for s in seeds)
            for p in points
        ]
        per_seed = ", ".join(f"{100 * (seeds[s]['valid'] / base[s]['valid'] - 1):+.1f}%" for s in seeds)
        lines.append(
            f"| {name} | "
            + " | ".join(f"{g:+.1f}%" for g in gaps)
            + f" | {statistics.mean(c['valid'] for c in seeds.values()):.4f} | {per_seed} |"
        )
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(results, f)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
