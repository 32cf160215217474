"""Fault injection and determinism with compression on (real gloo ranks; NCCL for the fp16 test).

The fp16 dynamic-loss-scaling test needs CUDA: megatron-core's mixed-precision optimizer accepts
only CUDA tensors, so it is skipped on the CPU machines and runs on the GPU machine
(benchmarks/results/reliability.md says where it ran).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_taco.config.mapl import MaplConfig
from megatron_taco.config.taco import LinearSettings, TacoConfig
from megatron_taco.testing.distributed import DistributedTestError, run_distributed
from megatron_taco.testing.models import TINY_GPT
from megatron_taco.training.data import synthetic_batches
from megatron_taco.training.loop import TrainConfig, Trainer

TACO = TacoConfig(default=LinearSettings(mode="fp8-ash"), min_bytes=0)
NEEDS_TWO_GPUS_FOR_FP16 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs: megatron-core's fp16 optimizer takes CUDA tensors only",
)


def _losses(taco, mapl, tp, pp, sp, steps=5, dtype="fp32"):
    """Per-step losses and grad norms (from the last stage), and a checksum of this rank's final weights."""
    cfg = TrainConfig(
        TINY_GPT, tensor_parallel=tp, pipeline_parallel=pp, sequence_parallel=sp, taco=taco, mapl=mapl, dtype=dtype
    )
    trainer = Trainer(cfg)
    data = synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, cfg.micro_batch_size, seed=3)
    history = [(stats["loss"], stats["grad_norm"]) for stats in (trainer.train_step(data) for _ in range(steps))]
    weights = [p.detach().double().sum().item() for p in trainer.model.parameters()]
    trainer.close()
    return history, weights


DETERMINISM_CASES = [
    (TACO, None, 2, 1, True),
    (None, MaplConfig(ratio=4), 1, 2, False),
    (None, MaplConfig(ratio=4, vq_levels=2, vq_codes=32), 1, 2, False),
]
DETERMINISM_IDS = ["taco-tp2-sp", "mapl-pp2", "mapl-vq-pp2"]


@pytest.mark.parametrize("taco,mapl,tp,pp,sp", DETERMINISM_CASES, ids=DETERMINISM_IDS)
def test_same_seed_gives_bit_identical_losses(taco, mapl, tp, pp, sp):
    first = run_distributed(_losses, 2, taco, mapl, tp, pp, sp, timeout=120)
    second = run_distributed(_losses, 2, taco, mapl, tp, pp, sp, timeout=120)
    assert first == second


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs (NCCL): the GPU half of the determinism check",
)
@pytest.mark.parametrize("taco,mapl,tp,pp,sp", DETERMINISM_CASES, ids=DETERMINISM_IDS)
def test_same_seed_gives_bit_identical_gpu_trainings(taco, mapl, tp, pp, sp, monkeypatch):
    """bf16 on 2 GPUs over NCCL, 20 steps: losses, grad norms and every rank's weights equal bit for bit."""
    monkeypatch.setenv("TACO_TEST_START_METHOD", "spawn")  # CUDA cannot be used in forked children
    runs = [
        run_distributed(_losses, 2, taco, mapl, tp, pp, sp, 20, "bf16", backend="nccl", timeout=300) for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert all(torch.isfinite(torch.tensor(loss)) for loss, _ in runs[0][-1][0])


def _nan_in_activation(taco):
    cfg = TrainConfig(TINY_GPT, tensor_parallel=2, sequence_parallel=True, taco=taco)
    trainer = Trainer(cfg)
    data = synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, cfg.micro_batch_size, seed=3)
    trainer.train_step(data)
    if dist.get_rank() == 1:  # one rank's layer-2 fc1 input goes NaN
        layer = trainer.model.module.decoder.layers[1]

        def poison(module, inputs):
            x = inputs[0].clone()
            x.view(-1)[7] = float("nan")
            return (x,)

        layer.mlp.linear_fc1.register_forward_pre_hook(poison)
    trainer.train_step(data)
    return "no error"


@pytest.mark.parametrize("taco", [None, TACO], ids=["uncompressed", "taco"])
def test_nan_in_an_activation_trips_megatrons_nan_check(taco):
    with pytest.raises(DistributedTestError, match="NaN"):
        run_distributed(_nan_in_activation, 2, taco, timeout=120)


def _nan_in_pipeline_activation(mapl):
    cfg = TrainConfig(TINY_GPT, pipeline_parallel=2, mapl=mapl)
    trainer = Trainer(cfg)
    data = synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, cfg.micro_batch_size, seed=3)
    trainer.train_step(data)
    if dist.get_rank() == 0:  # stage 0's layer-2 fc1 input goes NaN: the boundary must pass it on
        trainer.model.module.decoder.layers[1].mlp.linear_fc1.register_forward_pre_hook(
            lambda module, inputs: (inputs[0].index_fill(0, torch.tensor([3]), float("nan")),)
        )
    trainer.train_step(data)
    return "no error"


@pytest.mark.parametrize(
    "mapl", [MaplConfig(ratio=4), MaplConfig(ratio=4, vq_levels=2, vq_codes=32)], ids=["mapl", "mapl-vq"]
)
def test_nan_before_a_mapl_boundary_trips_megatrons_nan_check(mapl):
    with pytest.raises(DistributedTestError, match="NaN"):
        run_distributed(_nan_in_pipeline_activation, 2, mapl, timeout=120)


def _mismatched_mapl():
    rank = dist.get_rank()
    cfg = TrainConfig(TINY_GPT, pipeline_parallel=2, mapl=MaplConfig(ratio=4 if rank == 0 else 8))
    Trainer(cfg)
    return "no error"


def test_mapl_ranks_that_disagree_fail_on_both_sides_without_hanging():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_mismatched_mapl, 2, timeout=60)
    message = str(info.value)
    assert "MAPL settings differ across pipeline boundary 0" in message
    assert "rank 16 of 64" in message and "rank 8 of 64" in message
    assert "ranks [" in message and "failed after it" in message  # the other side failed too: no hang


def _taco_ranks_that_disagree(rank1_taco):
    taco = rank1_taco if dist.get_rank() == 1 else TacoConfig(default=LinearSettings(mode="fp8-ash"), min_bytes=0)
    Trainer(TrainConfig(TINY_GPT, tensor_parallel=2, sequence_parallel=True, taco=taco))
    return "no error"


@pytest.mark.parametrize(
    "rank1_taco, where, rank1_says",
    [
        # rank 1 would send every message stock, rank 0 compressed: on NCCL the first collective hangs
        (TacoConfig(default=LinearSettings(mode="fp8-ash"), min_bytes=1 << 40), "--taco-min-bytes", "1099511627776"),
        (TacoConfig(default=LinearSettings(mode="fp8-ash"), min_bytes=0, chunk_bytes=1 << 20), "--taco-chunk-bytes",
         "1048576"),
        (TacoConfig(default=LinearSettings(mode="fp8-ash"), layers=((1, 1),), min_bytes=0), "layer 2 qkv", "stock"),
    ],
    ids=["min-bytes", "chunk-bytes", "layers"],
)  # fmt: skip
def test_tensor_parallel_ranks_that_disagree_fail_at_start_up_naming_the_setting(rank1_taco, where, rank1_says):
    """The per-collective handshake never runs where a rank takes the stock path: the plans are compared at attach."""
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_taco_ranks_that_disagree, 2, rank1_taco, timeout=120)
    message = str(info.value)
    assert f"TACO settings differ across tensor-parallel ranks [0, 1] at {where} (" in message, message
    assert f"rank 1: {rank1_says}" in message and "failed after it" in message, message  # both ranks: no hang


def _fp16_skips(taco, inject_at, steps=8):
    cfg = TrainConfig(
        TINY_GPT, tensor_parallel=2, sequence_parallel=True, dtype="fp16", taco=taco, initial_loss_scale=2.0**10
    )
    trainer = Trainer(cfg)
    data = synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, cfg.micro_batch_size, seed=3)
    state = {"step": 0}

    def overflow(module, inputs, output):
        # rank 1's layer-2 fc2 output gradient overflows at one step; in backward it enters the
        # (compressed, with TACO) sequence-parallel all-gather
        if state["step"] == inject_at and dist.get_rank() == 1 and output[0].requires_grad:
            output[0].register_hook(
                lambda grad: grad.index_fill(0, torch.tensor([1], device=grad.device), float("inf"))
            )

    trainer.model.module.decoder.layers[1].mlp.linear_fc2.register_forward_hook(overflow)
    history = []
    for step in range(steps):
        state["step"] = step
        stats = trainer.train_step(data)
        history.append((stats["skipped"], stats["loss"], trainer.optimizer.get_loss_scale().item()))
    trainer.close()
    return history


@NEEDS_TWO_GPUS_FOR_FP16
def test_fp16_overflow_in_a_compressed_gradient_skips_the_step_like_uncompressed(monkeypatch):
    monkeypatch.setenv("TACO_TEST_START_METHOD", "spawn")  # CUDA cannot be used in forked children
    plain = run_distributed(_fp16_skips, 2, None, 3, backend="nccl", timeout=300)[0]
    taco = run_distributed(_fp16_skips, 2, TACO, 3, backend="nccl", timeout=300)[0]
    skipped = [s for s, _, _ in taco]
    assert skipped == [s for s, _, _ in plain], (plain, taco)
    assert skipped[3], "the overflowed step must be skipped"
    assert not any(skipped[4:]), "training must go on after the skip"
    assert [scale for _, _, scale in taco] == [scale for _, _, scale in plain], "same loss-scale history"
    assert all(abs(loss) < 100 for _, loss, _ in taco[4:])


def _mapl_projection_moves(dtype, steps=12):
    """Per step: skipped?, how far U moved, U finite? (PP=2, MAPL 4x; fp16 starts at a loss scale that overflows)."""
    cfg = TrainConfig(TINY_GPT, pipeline_parallel=2, dtype=dtype, mapl=MaplConfig(ratio=4), initial_loss_scale=2.0**20)
    trainer = Trainer(cfg)
    data = synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, cfg.micro_batch_size, seed=3)
    u = trainer.mapl_boundaries[0].projection
    history = []
    for _ in range(steps):
        before = u.detach().clone()
        stats = trainer.train_step(data)
        history.append((stats["skipped"], float((u.detach() - before).norm()), bool(torch.isfinite(u).all())))
    trainer.close()
    return history


@NEEDS_TWO_GPUS_FOR_FP16
def test_fp16_loss_scale_reaches_neither_the_projection_step_nor_skipped_steps(monkeypatch):
    """U is updated outside Megatron's optimizer: its gradient must be unscaled, and overflowed steps skipped."""
    monkeypatch.setenv("TACO_TEST_START_METHOD", "spawn")  # CUDA cannot be used in forked children
    fp16 = run_distributed(_mapl_projection_moves, 2, "fp16", backend="nccl", timeout=300)[0]
    fp32 = run_distributed(_mapl_projection_moves, 2, "fp32", backend="nccl", timeout=300)[0]
    assert all(finite for _, _, finite in fp16)
    skipped = [moved for skip, moved, _ in fp16 if skip]
    applied = [moved for skip, moved, _ in fp16 if not skip]
    assert skipped and applied, fp16  # 2^20 overflows fp16 at first; the scaler backs off and training goes on
    assert all(moved == 0.0 for moved in skipped), "a skipped step must leave U as it was"
    # the k-th applied step against the k-th fp32 step (same momentum history): the same size, not loss-scaled
    for moved, reference in zip(applied, [moved for _, moved, _ in fp32]):
        assert 0.5 * reference < moved < 2 * reference, (applied, fp32)
