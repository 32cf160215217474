"""Does a finished torch.profiler session slow the training steps that follow it in the same process?

    python -m benchmarks.profiler_residue --out-dir benchmarks/results

The e2e benchmark ends every timed run with a profiled step, and the runs that followed a profiled one were
slower on NVLink (the "run-order effect" of e2e.md). This times the TP=2 + SP GPT of e2e.py on NVLink with
one trainer: twice before any profiling, then one profiled step (e2e's time split), then twice again; once
with Kineto's defaults and once with ``TEARDOWN_CUPTI=1`` (Kineto then finalises CUPTI when a profile ends,
pytorch/pytorch#144455). Each setting is a fresh NCCL process pair.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch

from megatron_taco.testing.distributed import run_distributed
from megatron_taco.training.data import synthetic_batches
from megatron_taco.training.loop import Trainer

from .e2e import CUPTI_TEARDOWN, THROUGHPUT_MODELS, _gpu_time_split, _median_step_s, tp_config
from .provenance import project_commit

SETTINGS = {"Kineto defaults": {}, "TEARDOWN_CUPTI=1": CUPTI_TEARDOWN}


def _worker(steps: int, warmup: int) -> dict:
    model_name, shape = next(iter(THROUGHPUT_MODELS.items()))
    trainer = Trainer(tp_config(shape, micro_batches=2))
    data = synthetic_batches(shape.vocab_size, shape.seq_length, 1, seed=1)
    before = [_median_step_s(trainer, data, steps, warmup) for _ in range(2)]
    split = _gpu_time_split(trainer, data)
    after = [_median_step_s(trainer, data, steps, warmup) for _ in range(2)]
    trainer.close()
    return dict(model=model_name, before=before, after=after, split={k: v for k, v in split.items() if k != "host_ops"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    os.environ["TACO_TEST_START_METHOD"] = "spawn"
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    rows = {
        name: run_distributed(_worker, 2, args.steps, args.warmup, backend="nccl", env=env, timeout=600)[0]
        for name, env in SETTINGS.items()
    }
    model = next(iter(rows.values()))["model"]
    lines = [
        "# Does a finished profile slow later steps? (TP=2 + SP, NVLink)",
        "",
        f"- Command: `python -m benchmarks.profiler_residue --out-dir {args.out_dir} --steps {args.steps} "
        f"--warmup {args.warmup}`",
        f"- Commit: {project_commit()}",
        f"- Date: {datetime.date.today().isoformat()}; 2 x {torch.cuda.get_device_name(0)}; torch {torch.__version__}",
        f"- Model: {model}, bf16, micro-batch 1 x 2; one trainer per setting; each time is the median of steps "
        f"{args.warmup + 1}-{args.steps} of a block of {args.steps}",
        "",
        "| setting | before profiling (ms/step, 2 blocks) | after one profiled step (ms/step, 2 blocks) | after / before |",
        "|---|---|---|---|",
    ]
    for name, r in rows.items():
        ratio = min(r["after"]) / min(r["before"])
        lines.append(
            f"| {name} | {', '.join(f'{t * 1e3:.1f}' for t in r['before'])} | "
            f"{', '.join(f'{t * 1e3:.1f}' for t in r['after'])} | {ratio:.2f} |"
        )
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "profiler_residue.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
