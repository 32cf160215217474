"""Fault injection and determinism with compression on (real gloo ranks).

Not covered here: fp16 dynamic loss scaling with an injected Inf (megatron-core's mixed-precision
optimizer accepts only CUDA tensors, so it cannot run on the CPU machines; see
benchmarks/results/reliability.md).
"""

import pytest
import torch.distributed as dist

from megatron_taco.config.mapl import MaplConfig
from megatron_taco.config.taco import LinearSettings, TacoConfig
from megatron_taco.testing.distributed import DistributedTestError, run_distributed
from megatron_taco.testing.models import TINY_GPT
from megatron_taco.training.data import synthetic_batches
from megatron_taco.training.loop import TrainConfig, Trainer

TACO = TacoConfig(default=LinearSettings(mode="fp8-ash"), min_bytes=0)


def _losses(taco, mapl, tp, pp, sp, steps=5):
    cfg = TrainConfig(TINY_GPT, tensor_parallel=tp, pipeline_parallel=pp, sequence_parallel=sp, taco=taco, mapl=mapl)
    trainer = Trainer(cfg)
    data = synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, cfg.micro_batch_size, seed=3)
    losses = [trainer.train_step(data)["loss"] for _ in range(steps)]
    trainer.close()
    return losses


@pytest.mark.parametrize("taco,mapl,tp,pp,sp", [(TACO, None, 2, 1, True), (None, MaplConfig(ratio=4), 1, 2, False)],
                         ids=["taco-tp2-sp", "mapl-pp2"])
def test_same_seed_gives_bit_identical_losses(taco, mapl, tp, pp, sp):
    first = run_distributed(_losses, 2, taco, mapl, tp, pp, sp, timeout=120)[0]
    second = run_distributed(_losses, 2, taco, mapl, tp, pp, sp, timeout=120)[0]
    assert first == second


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
