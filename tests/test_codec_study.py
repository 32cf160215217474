"""The TP=2 messages that benchmarks/codec_study.py rebuilds from a TP=1 model are the ones a real TP=2 + SP run
sends: same weights (the trainer's initialisation does not depend on the layout), same batch, first step, both
ranks, forward and backward, on real gloo ranks (CPU)."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from benchmarks.codec_study import COLUMN_PARALLEL, LINEARS, capture_tp1_as_tp2, layer_linear
from megatron_taco.testing.distributed import run_distributed

SEED = 7
MICRO_BATCH = 2


def _rebuilt_from_tp1(model: str) -> Dict[str, List[torch.Tensor]]:
    from benchmarks.loss_compare import MODELS

    captured, _, _ = capture_tp1_as_tp2(MODELS[model], 1, SEED, MICRO_BATCH, "fp32", ranks=(0, 1))
    return {key: [t.detach().clone() for t in per_rank] for key, per_rank in captured.items()}


def _sent_by_tp2(model: str) -> Dict[str, torch.Tensor]:
    """This rank's inputs to the four SP collectives of every linear in the first step of a TP=2 + SP run."""
    from megatron.core.tensor_parallel import layers

    from benchmarks.loss_compare import MODELS
    from megatron_taco.training.data import byte_text_batches, stdlib_text_files
    from megatron_taco.training.loop import TrainConfig, Trainer

    shape = MODELS[model]
    sent: Dict[str, torch.Tensor] = {}
    current = {"label": None}
    original_reduce_scatter = layers.reduce_scatter_to_sequence_parallel_region
    original_dist_reduce_scatter = layers.dist_reduce_scatter_func

    def forward_reduce_scatter(tensor, *args, **kwargs):
        sent[f"fwd reduce-scatter, {current['label']}"] = tensor.detach().clone()
        return original_reduce_scatter(tensor, *args, **kwargs)

    def backward_reduce_scatter(output, tensor, *args, **kwargs):  # the column linears' input gradient
        sent[f"bwd reduce-scatter, {current['label']}"] = tensor.detach().clone()
        return original_dist_reduce_scatter(output, tensor, *args, **kwargs)

    layers.reduce_scatter_to_sequence_parallel_region = forward_reduce_scatter
    layers.dist_reduce_scatter_func = backward_reduce_scatter
    try:
        cfg = TrainConfig(shape, tensor_parallel=2, sequence_parallel=True, micro_batch_size=MICRO_BATCH,
                          num_microbatches=1, lr=6e-4, seed=SEED)  # fmt: skip
        trainer = Trainer(cfg)
        for layer in trainer.model.module.decoder.layers:
            for name in LINEARS:
                module = layer_linear(layer, name)
                label = f"layer {layer.layer_number} {name}"

                def pre_hook(mod, inputs, label=label, name=name):
                    current["label"] = label
                    if name in COLUMN_PARALLEL:
                        sent[f"fwd all-gather, {label}"] = inputs[0].detach().clone()

                def forward_hook(mod, inputs, output, label=label, name=name):
                    def on_grad(dy):
                        current["label"] = label  # the next backward reduce-scatter is this linear's
                        if name not in COLUMN_PARALLEL:
                            sent[f"bwd all-gather, {label}"] = dy.detach().clone()

                    output[0].register_hook(on_grad)

                module.register_forward_pre_hook(pre_hook)
                module.register_forward_hook(forward_hook)
        trainer.train_step(byte_text_batches(stdlib_text_files()[0], shape.seq_length, MICRO_BATCH, seed=SEED))
        trainer.close()
    finally:
        layers.reduce_scatter_to_sequence_parallel_region = original_reduce_scatter
        layers.dist_reduce_scatter_func = original_dist_reduce_scatter
    return sent


@pytest.mark.parametrize("model", ["gpt-tiny", "qwen-tiny"])  # qwen: gated fc1 (gate and up halves), GQA, qkv bias
def test_rebuilt_messages_equal_what_tp2_sends(model):
    rebuilt = run_distributed(_rebuilt_from_tp1, 1, model, timeout=600)[0]
    sent = run_distributed(_sent_by_tp2, 2, model, timeout=600)
    layers = 4
    assert len(rebuilt) == layers * 4 * 2, sorted(rebuilt)
    for key, per_rank in rebuilt.items():
        for rank, message in enumerate(per_rank):
            real = sent[rank][key]
            assert message.shape == real.shape, (key, rank)
            error = float((message.double() - real.double()).norm() / real.double().norm())
            assert error < 1e-6, (key, rank, error)  # fp32 sums in another order: <= 3.3e-7 observed
