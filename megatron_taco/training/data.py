"""Batches for the trainer: a deterministic synthetic stream (throughput, smoke tests).

Every tensor-parallel and pipeline rank of one data-parallel replica draws the
same batches (the stream is seeded by the data-parallel rank), as Megatron's
data loaders do.
"""

from __future__ import annotations

from typing import Dict, Iterator

import torch


def synthetic_batches(
    vocab_size: int, seq_length: int, micro_batch_size: int, seed: int, data_parallel_rank: int = 0
) -> Iterator[Dict[str, torch.Tensor]]:
    """Endless micro-batches from a noisy first-order Markov chain over the vocabulary.

    The next token is a fixed permutation of the current one with probability
    0.9, uniform noise otherwise: a model learns it in tens of steps, so the
    loss falls quickly (its floor is about 0.1 * ln(vocab) + H(0.9) nats).
    """
    gen = torch.Generator().manual_seed(seed * 1000003 + data_parallel_rank)
    successor = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(seq_length)
    while True:
        seq = torch.empty(micro_batch_size, seq_length + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab_size, (micro_batch_size,), generator=gen)
        noise = torch.rand(micro_batch_size, seq_length, generator=gen) < 0.1
        random_tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length), generator=gen)
        for i in range(seq_length):
            seq[:, i + 1] = torch.where(noise[:, i], random_tokens[:, i], successor[seq[:, i]])
        yield {
            "tokens": seq[:, :-1].contiguous(),
            "labels": seq[:, 1:].contiguous(),
            "loss_mask": torch.ones(micro_batch_size, seq_length),
            "position_ids": positions.expand(micro_batch_size, -1).contiguous(),
        }
