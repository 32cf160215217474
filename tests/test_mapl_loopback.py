"""benchmarks/mapl_loopback.py puts MAPL's boundary inside one process; it must train like the real PP=2 run
(two gloo ranks, megatron-core's pipeline schedule, MaplSync across the pair): same model, data and steps,
the same losses up to float rounding, with gradient clipping active on every step (U, the anchors once and the
other parameters in one norm on both sides)."""

from __future__ import annotations

import dataclasses

from benchmarks.loss_compare import MODELS
from benchmarks.mapl_loopback import train_config, train_loopback
from megatron_taco.config.mapl import MaplConfig
from megatron_taco.testing.distributed import run_distributed

SHAPE = MODELS["gpt-tiny"]  # 4 layers, hidden 64, learned positions (position anchors on)
STEPS, DATA_SEED, EVAL_ITERS = 6, 3, 2


def _config():
    # gradient norms 2.1-4.3 in these steps: always clipped
    return train_config(
        SHAPE, seed=0, steps=STEPS, lr=3e-3, warmup=2, micro_batch_size=2, micro_batches=2, clip_grad=0.05
    )


def _pipeline_run(ratio: float) -> dict:
    from megatron_taco.training.data import byte_text_batches, stdlib_text_files
    from megatron_taco.training.loop import Trainer

    cfg = dataclasses.replace(_config(), pipeline_parallel=2, mapl=MaplConfig(ratio=ratio))
    trainer = Trainer(cfg)
    train_files, valid_files = stdlib_text_files()
    data = byte_text_batches(train_files, SHAPE.seq_length, 2, seed=DATA_SEED)
    steps = [trainer.train_step(data) for _ in range(STEPS)]
    valid = trainer.evaluate(byte_text_batches(valid_files, SHAPE.seq_length, 2, seed=2), EVAL_ITERS)
    trainer.close()
    return dict(train=[s["loss"] for s in steps], valid=valid, grad_norms=[s["grad_norm"] for s in steps])


def test_loopback_trains_like_pp2():
    pipeline = run_distributed(_pipeline_run, 2, 8.0, timeout=600)[0]
    loopback = run_distributed(train_loopback, 1, _config(), "8x", STEPS, DATA_SEED, EVAL_ITERS, timeout=600)[0]
    uncompressed = run_distributed(train_loopback, 1, _config(), "none", STEPS, DATA_SEED, EVAL_ITERS, timeout=600)[0]
    assert min(pipeline["grad_norms"]) > 0.05, pipeline["grad_norms"]  # clipping was active on every step
    for a, b in zip(pipeline["train"] + [pipeline["valid"]], loopback["train"] + [loopback["valid"]]):
        assert abs(a - b) <= 2e-7 * abs(a), (pipeline, loopback)  # fp32; <= 4.9e-8 observed
    # and the boundary is there: the uncompressed model trains differently
    assert abs(uncompressed["valid"] - loopback["valid"]) > 1e-3, (uncompressed, loopback)
