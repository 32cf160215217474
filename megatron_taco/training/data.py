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


def stdlib_text_files(validation_fraction: float = 0.05) -> "tuple[list, list]":
    """(train, validation) lists of the Python standard library's .py files, split by a fixed rule.

    Real text that every machine has (DESIGN.md section 7); a file goes to validation when a
    hash of its relative path falls in the first ``validation_fraction`` of the range.
    """
    import sysconfig
    import zlib
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    train, valid = [], []
    for path in files:
        bucket = zlib.crc32(str(path.relative_to(root)).encode()) / 2**32
        (valid if bucket < validation_fraction else train).append(path)
    return train, valid


def byte_text_batches(
    files: list, seq_length: int, micro_batch_size: int, seed: int, data_parallel_rank: int = 0
) -> Iterator[Dict[str, torch.Tensor]]:
    """Endless micro-batches of random windows of the files' bytes (byte-level tokens, vocab 256)."""
    corpus = torch.frombuffer(bytearray(b"".join(p.read_bytes() for p in files)), dtype=torch.uint8).long()
    if corpus.numel() <= seq_length + 1:
        raise ValueError(f"text corpus of {corpus.numel()} bytes is shorter than one sequence")
    gen = torch.Generator().manual_seed(seed * 1000003 + data_parallel_rank)
    positions = torch.arange(seq_length)
    while True:
        starts = torch.randint(0, corpus.numel() - seq_length - 1, (micro_batch_size, 1), generator=gen)
        seq = corpus[starts + torch.arange(seq_length + 1)]
        yield {
            "tokens": seq[:, :-1].contiguous(),
            "labels": seq[:, 1:].contiguous(),
            "loss_mask": torch.ones(micro_batch_size, seq_length),
            "position_ids": positions.expand(micro_batch_size, -1).contiguous(),
        }
