"""benchmarks/mapl_loopback.py puts MAPL's boundary inside one process; it must train like the real PP=2 run
(two gloo ranks, megatron-core's pipeline schedule, MaplSync across the pair): same model, data and steps,
the same losses up to float rounding, with gradient clipping active on every step (U, the anchors once and the
other parameters in one norm on both sides)."""

from __future__ import annotations

from benchmarks.loss_compare import MODELS
from benchmarks.mapl_loopback import train_config, train_loopback
from megatron_taco.testing.distributed import run_distributed

SHAPE = MODELS["gpt-tiny"]  # 4 layers, hidden 64, learned positions (position anchors on)
STEPS, DATA_SEED, EVAL_ITERS = 6, 3, 2


def _config():
    # gradient norms 2.1-4.3 in these steps: always clipped
    return train_config(
        SHAPE, seed=0, steps=STEPS, lr=3e-3, warmup=2, micro_batch_size=2, micro_batches=2, clip_grad=0.05
    )


def test_loopback_trains_like_pp2():
    pipeline = run_distributed(train_loopback, 2, _config(), "8x", STEPS, DATA_SEED, EVAL_ITERS, "", 2, timeout=600)
    pipeline = pipeline[0]
    loopback = run_distributed(train_loopback, 1, _config(), "8x", STEPS, DATA_SEED, EVAL_ITERS, timeout=600)[0]
    uncompressed = run_distributed(train_loopback, 1, _config(), "none", STEPS, DATA_SEED, EVAL_ITERS, timeout=600)[0]
    assert min(pipeline["grad_norms"]) > 0.05, pipeline["grad_norms"]  # clipping was active on every step
    for a, b in zip(pipeline["train"] + [pipeline["valid"]], loopback["train"] + [loopback["valid"]]):
        assert abs(a - b) <= 2e-7 * abs(a), (pipeline, loopback)  # fp32; <= 4.9e-8 observed
    # and the boundary is there: the uncompressed model trains differently
    assert abs(uncompressed["valid"] - loopback["valid"]) > 1e-3, (uncompressed, loopback)
    assert pipeline["parameters"] == loopback["parameters"]  # both count the anchors once


def test_the_tables_baseline_has_mapls_parameters_and_starts_as_the_stock_model():
    """``tables``: the uncompressed model plus MAPL's anchor tables (the equal-parameter baseline). Its tables
    start at zero, so its first step is the stock model's; then the tables learn."""
    runs = {
        v: run_distributed(train_loopback, 1, _config(), v, STEPS, DATA_SEED, EVAL_ITERS, timeout=600)[0]
        for v in ("none", "tables", "8x")
    }
    assert runs["tables"]["parameters"] == runs["8x"]["parameters"] > runs["none"]["parameters"]
    assert runs["tables"]["train"][0] == runs["none"]["train"][0]  # a(t, p) = 0 at the start: the same forward
    assert abs(runs["tables"]["valid"] - runs["none"]["valid"]) > 1e-4, runs
