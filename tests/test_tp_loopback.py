"""benchmarks/tp_loopback.py: a TP=1 model with the two-rank arithmetic trains like a real TP=2 + SP run.

Both start from the same weights (the loopback's, sharded as megatron-core shards them for TP=2) and train on the
same batches; the real run is two gloo ranks with TACO's compressed collectives. fp32 on CPU.
"""

import dataclasses
import functools

import pytest
import torch

from benchmarks.loss_compare import MODELS, arm_config
from benchmarks.tp_loopback import simulate_two_ranks
from megatron_taco.megatron.attach import unwrap
from megatron_taco.testing.distributed import run_distributed

STEPS = 4


def _trainer(model: str, arm: str, tensor_parallel: int):
    """``model`` with ``+tied``: its output layer uses the embedding's weight (as configs/gpt-125m.yaml)."""
    from megatron_taco.training.loop import TrainConfig, Trainer

    name, _, tied = model.partition("+")
    shape = dataclasses.replace(MODELS[name], num_layers=2, tie_embeddings=tied == "tied")
    cfg = TrainConfig(shape, tensor_parallel=tensor_parallel, sequence_parallel=tensor_parallel > 1,
                      micro_batch_size=2, num_microbatches=2, dtype="fp32", lr=3e-3, seed=1234,
                      taco=arm_config(arm))  # fmt: skip
    return Trainer(cfg)


def _train(trainer):
    """Losses of STEPS steps, and every parameter's gradient of the first (megatron-core's main_grad)."""
    from megatron_taco.training.data import byte_text_batches, stdlib_text_files

    data = byte_text_batches(stdlib_text_files()[0], trainer.cfg.shape.seq_length, 2, seed=1)
    losses = [trainer.train_step(data)["loss"]]
    grads = {name: p.main_grad.clone() for name, p in unwrap(trainer.model).named_parameters()}
    losses += [trainer.train_step(data)["loss"] for _ in range(STEPS - 1)]
    trainer.close()
    return losses, grads


def _loopback(model: str, arm: str):
    trainer = _trainer(model, arm, 1)
    assert simulate_two_ranks(trainer.models) == 4 * 2 + 1  # qkv, proj, fc1, fc2 of both layers; the output layer
    start = {name: p.detach().clone() for name, p in unwrap(trainer.model).named_parameters()}
    return start, *_train(trainer)


def _shard(name: str, p: torch.Tensor, full: torch.Tensor, *, gated: bool, rank: int) -> torch.Tensor:
    """This rank's TP=2 shard of the TP=1 parameter ``full`` (megatron-core marks the sharded ones)."""
    if not getattr(p, "tensor_model_parallel", False):
        return full
    if gated and "linear_fc1" in name:  # TP=2's fc1 rows: [gate_r; up_r]
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
    return full.chunk(2, p.partition_dim)[rank]


def _real(model: str, arm: str, start: dict):
    trainer = _trainer(model, arm, 2)
    gated = bool(unwrap(trainer.model).config.gated_linear_unit)
    shard = {}
    with torch.no_grad():
        for name, p in unwrap(trainer.model).named_parameters():
            shard[name] = functools.partial(_shard, name, p, gated=gated, rank=torch.distributed.get_rank())
            p.copy_(shard[name](start[name]))
    losses, grads = _train(trainer)
    return losses, {name: (grad, shard[name]) for name, grad in grads.items()}


@pytest.mark.parametrize(
    "model, arm",
    [
        ("gpt-tiny", "fp8-ash"),
        ("qwen-tiny", "fp4-ash/fp8-ash"),
        ("gpt-tiny", "int4-ash+sr"),
        ("qwen-tiny", "none"),
        ("gpt-tiny+tied", "int8"),
    ],
)
def test_the_loopback_computes_the_gradients_and_losses_of_two_ranks(model, arm):
    """First-step gradients within 1e-4 relative (observed: 7.3e-6 GPT FP8, where an fp32 summation-order difference
    can move an FP8 code; Qwen FP4 / FP8 2.8e-7 with 2cc314f's codec and 6.9e-5 with 2a7090e's, whose other rounding
    of the group multiplier moved one gradient code in layer 0 (its input norm's weight 6.9e-5, the embedding 1.9e-5,
    every other parameter within 3e-7), so the bound leaves room for such a move; 2.2e-7 INT4 with
    stochastic rounding; 1.3e-7 uncompressed; a column backward sent uncompressed: 2.0e-2; both simulated ranks
    drawing rank 0's rounding noise: 9.5e-2) and losses of 4 steps within 5e-5 (observed 1.4e-5 GPT FP8, 2.8e-5 INT4
    stochastic; weights nudged by 1e-7 alone move a real run by 5.7e-6)."""
    start, looped, looped_grads = run_distributed(_loopback, 1, model, arm)[0]
    ranks = run_distributed(_real, 2, model, arm, start)
    for losses, grads in ranks:
        for name, (grad, shard) in grads.items():
            expected = shard(looped_grads[name])
            assert (grad - expected).norm() <= 1e-4 * expected.norm(), name  # (rank 1's bytes 128-255: all 0)
    assert looped[0] != looped[-1]
    assert looped == pytest.approx(ranks[0][0], rel=5e-5, abs=0)


def test_uncompressed_partials_round_to_bf16_before_they_add_as_two_ranks_do():
    """In bf16 the loopback's uncompressed arm is TP=2's, not TP=1's: each rank's partial product rounds to bf16,
    then the two add with one more rounding (what NCCL's sum of two ranks gives): the row forward and the column
    backward."""
    from benchmarks.tp_loopback import _TwoRankColumn, _TwoRankRow

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, 64, generator=gen).to(torch.bfloat16)
    w = (torch.randn(48, 64, generator=gen) * 0.1).to(torch.bfloat16)
    halves = [torch.matmul(xr, wr.t()) for xr, wr in zip(x.chunk(2, -1), w.chunk(2, 1))]
    row = _TwoRankRow.apply(x, w, None)
    assert torch.equal(row, halves[0] + halves[1]) and not torch.equal(row, torch.matmul(x, w.t()))

    leaf = x.clone().requires_grad_(True)
    owned = [torch.arange(24), torch.arange(24, 48)]  # rank r computes output features owned[r]
    grad = torch.randn(8, 2, 48, generator=gen).to(torch.bfloat16)
    _TwoRankColumn.apply(leaf, w, None, None, owned).backward(grad)
    partials = [torch.matmul(grad[..., rows], w[rows]) for rows in owned]
    assert torch.equal(leaf.grad, partials[0] + partials[1]) and not torch.equal(leaf.grad, torch.matmul(grad, w))
