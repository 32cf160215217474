"""The trainer's learning-rate schedule (Megatron-Core's OptimizerParamScheduler) and MAPL following it."""

import math

import pytest
import torch

from megatron_taco.config.mapl import MaplConfig
from megatron_taco.mapl.stiefel import StiefelMomentumSGD, random_stiefel
from megatron_taco.testing.distributed import run_distributed
from megatron_taco.testing.models import TINY_GPT
from megatron_taco.training.data import synthetic_batches
from megatron_taco.training.loop import TrainConfig, Trainer

PEAK, FLOOR, WARMUP, DECAY = 2e-3, 2e-4, 3, 10


def _expected_lr(step: int, style: str) -> float:
    """Megatron-LM's schedule, written out: linear warm-up from 0, then linear or cosine decay to the floor."""
    if step <= WARMUP:
        return PEAK * step / WARMUP
    if step > DECAY:
        return FLOOR
    ratio = (step - WARMUP) / (DECAY - WARMUP)
    coeff = 1 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
    return FLOOR + coeff * (PEAK - FLOOR)


def _schedule(style: str, steps: int):
    cfg = TrainConfig(
        TINY_GPT, lr=PEAK, min_lr=FLOOR, lr_warmup_iters=WARMUP, lr_decay_style=style, lr_decay_iters=DECAY
    )
    trainer = Trainer(cfg)
    data = synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, cfg.micro_batch_size, seed=1)
    history = []
    for _ in range(steps):
        used = [group["lr"] for group in trainer.optimizer.param_groups]  # what Adam applies in this step
        history.append((trainer.train_step(data)["lr"], used))
    trainer.close()
    return history


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_learning_rate_follows_the_warmup_and_decay(style):
    history = run_distributed(_schedule, 1, style, DECAY + 3, timeout=120)[0]
    for step, (reported, used) in enumerate(history):
        expected = _expected_lr(step, style)
        assert reported == pytest.approx(expected, rel=1e-12, abs=1e-15), (step, reported, expected)
        assert all(lr == pytest.approx(expected, rel=1e-12, abs=1e-15) for lr in used), (step, used)


def test_a_scaled_manifold_step_is_the_step_at_the_scaled_learning_rate():
    gen = torch.Generator().manual_seed(3)
    start = random_stiefel(48, 8, gen)
    grads = [torch.randn(48, 8, generator=gen) for _ in range(3)]
    scaled, reference = start.clone(), start.clone()
    scaled_opt = StiefelMomentumSGD([scaled], lr=0.04, momentum=0.9)
    reference_opt = StiefelMomentumSGD([reference], lr=0.01, momentum=0.9)
    for grad in grads:
        scaled_opt.step([grad], lr_scale=0.25)
        reference_opt.step([grad])
    assert torch.equal(scaled, reference)
    frozen = start.clone()
    StiefelMomentumSGD([frozen], lr=0.04).step([grads[0]], lr_scale=0.0)
    assert torch.equal(frozen, start)


def _projection_per_step(steps: int):
    cfg = TrainConfig(
        TINY_GPT,
        pipeline_parallel=2,
        lr=3e-3,
        lr_warmup_iters=2,
        lr_decay_style="cosine",
        lr_decay_iters=steps,
        mapl=MaplConfig(ratio=4),
    )
    trainer = Trainer(cfg)
    data = synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, cfg.micro_batch_size, seed=1)
    snapshots = [trainer.mapl_boundaries[0].projection.detach().clone()]
    for _ in range(steps):
        trainer.train_step(data)
        snapshots.append(trainer.mapl_boundaries[0].projection.detach().clone())
    trainer.close()
    return snapshots


def test_mapl_projection_follows_the_schedule():
    """Warm-up starts at lr 0: U (like every weight) stays put in the first step, then moves."""
    snapshots = run_distributed(_projection_per_step, 2, 4, timeout=180)
    for rank in (0, 1):
        u = snapshots[rank]
        assert torch.equal(u[1], u[0]), "step 1 runs at lr 0: U must not move"
        assert not torch.equal(u[2], u[1]) and not torch.equal(u[3], u[2])
        assert all(torch.equal(a, b) for a, b in zip(u, snapshots[1 - rank]))


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(lr_decay_style="cosine"), "--lr-decay-style cosine needs --lr-decay-iters"),
        (dict(lr_decay_style="linear", lr_warmup_iters=10, lr_decay_iters=10), "--lr-decay-iters 10 must be larger"),
        (dict(lr_decay_style="step", lr_decay_iters=10), "--lr-decay-style: invalid value 'step'"),
        (dict(min_lr=1.0), "--min-lr: invalid value 1"),
        (dict(lr=0.0), "--lr: invalid value 0"),
        (dict(lr_warmup_iters=-1), "--lr-warmup-iters: invalid value -1"),
    ],
)
def test_invalid_schedules_name_the_flag(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(TINY_GPT, **settings)


def test_the_schedule_is_described_in_words_for_the_log():
    assert TrainConfig(TINY_GPT, lr=1e-3).lr_schedule_summary == "lr 0.001, then constant"
    cosine = TrainConfig(
        TINY_GPT,
        pipeline_parallel=2,
        lr=1e-3,
        min_lr=1e-4,
        lr_warmup_iters=10,
        lr_decay_style="cosine",
        lr_decay_iters=100,
        mapl=MaplConfig(ratio=4),
    )
    assert cosine.lr_schedule_summary == (
        "lr 0.001, 10 warm-up steps from 0, cosine decay to 0.0001 at step 100 "
        "(MAPL's manifold lr follows the same factor)"
    )
