"""Batches for the trainer: a deterministic synthetic stream (throughput, smoke tests).

Every tensor-parallel and pipeline rank of one data-parallel replica draws the
same batches (the stream is seeded by the data-parallel rank), as Megatron's
data loaders do.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Iterator

import torch

__all__ = [
    "synthetic_batches",
    "stdlib_text_files",
    "build_token_dataset",
    "byte_text_batches",
    "train_bpe_vocabulary",
    "bpe_text_batches",
    "stdlib_text_batches",
    "cache_stdlib_text",
    "indexed_dataset_batches",
]


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
        first = torch.randint(0, vocab_size, (micro_batch_size,), generator=gen)
        noise = torch.rand(micro_batch_size, seq_length, generator=gen) < 0.1
        random_tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length), generator=gen)
        # Token i + 1 is random_tokens[i] where noise[i], else successor[token i]. Vectorised (the loop
        # over positions cost tens of ms per micro-batch of host time): token i + 1 = successor^k(start),
        # where start is the last noise draw at or before i (k = i - that position) or token 0 (k = i + 1).
        last = torch.where(noise, positions, -1).cummax(dim=1).values
        start = torch.where(last >= 0, random_tokens.gather(1, last.clamp(min=0)), first.unsqueeze(1))
        hops = torch.where(last >= 0, positions - last, positions + 1)
        chain, power = start, successor  # successor^k by binary lifting: apply successor^(2^j) for each set bit j
        for bit in range(int(seq_length).bit_length()):
            chain = torch.where((hops >> bit) & 1 == 1, power[chain], chain)
            power = power[power]
        seq = torch.cat([first.unsqueeze(1), chain], dim=1)
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


def _encode_bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int32)


def build_token_dataset(files: list, path_prefix: str, encode: Callable[[bytes], torch.Tensor] = _encode_bytes) -> str:
    """Tokenize text files with ``encode`` (default byte-level, vocab 256) into a megatron-core indexed
    dataset (.bin/.idx), one document per file. Returns ``path_prefix``. Rebuilt only when the .idx file is
    missing."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if not os.path.exists(path_prefix + ".idx"):
        os.makedirs(os.path.dirname(path_prefix) or ".", exist_ok=True)
        tmp = f".tmp{os.getpid()}"  # ranks building the same dataset at once each write their own files
        builder = IndexedDatasetBuilder(path_prefix + ".bin" + tmp, dtype=numpy.uint16)
        for path in files:
            data = path.read_bytes()
            if data:
                builder.add_item(encode(data))
                builder.end_document()
        builder.finalize(path_prefix + ".idx" + tmp)
        os.replace(path_prefix + ".bin" + tmp, path_prefix + ".bin")
        os.replace(path_prefix + ".idx" + tmp, path_prefix + ".idx")
    return path_prefix


def _cache_path(files: list, name: str) -> str:
    """A file under the cache folder (``MEGATRON_TACO_CACHE``, default ~/.cache/megatron_taco) whose name
    holds ``name`` and a hash of the files' paths and sizes."""
    import hashlib

    key = hashlib.sha1("\n".join(f"{p}:{p.stat().st_size}" for p in files).encode()).hexdigest()[:16]
    cache = os.environ.get("MEGATRON_TACO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "megatron_taco"))
    return os.path.join(cache, f"{name}-{key}")


def byte_text_batches(
    files: list, seq_length: int, micro_batch_size: int, seed: int, data_parallel_rank: int = 0
) -> Iterator[Dict[str, torch.Tensor]]:
    """Batches of text files, byte-level, through an indexed dataset cached under ~/.cache/megatron_taco."""
    prefix = build_token_dataset(files, _cache_path(files, "bytes"))
    return indexed_dataset_batches(prefix, seq_length, micro_batch_size, seed, data_parallel_rank)


def train_bpe_vocabulary(train_files: list, vocab_size: int) -> str:
    """A byte-level BPE vocabulary of ``vocab_size`` tokens trained on ``train_files`` with the ``tokenizers``
    package (the path of its JSON file, cached): an LLM-style vocabulary for studies whose method depends on
    it (MAPL's token anchors), next to the 256 bytes."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:
        raise RuntimeError(f"a BPE vocabulary needs the tokenizers package (pip install tokenizers): {exc}") from None
    if not 256 < vocab_size <= 65536:
        raise ValueError(f"BPE vocabulary of {vocab_size} tokens: expected 257-65536 (uint16 token ids)")
    import tokenizers

    # the cache name holds the trainer's settings and the tokenizers version (another version may merge otherwise)
    path = _cache_path(train_files, f"bpe{vocab_size}-tokenizers{tokenizers.__version__}") + ".json"
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
        texts = (p.read_bytes().decode("utf-8", errors="replace") for p in train_files)
        tokenizer.train_from_iterator(texts, trainer, length=len(train_files))
        tmp = f"{path}.tmp{os.getpid()}"
        tokenizer.save(tmp)
        os.replace(tmp, path)
    return path


def bpe_text_batches(
    files: list, vocabulary: str, seq_length: int, micro_batch_size: int, seed: int, data_parallel_rank: int = 0
) -> Iterator[Dict[str, torch.Tensor]]:
    """Batches of text files tokenized with the BPE ``vocabulary`` (from :func:`train_bpe_vocabulary`), through
    an indexed dataset cached beside it."""
    import hashlib

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(vocabulary)
    if tokenizer.get_vocab_size() > 65536:
        raise ValueError(f"{vocabulary}: {tokenizer.get_vocab_size()} tokens do not fit the dataset's uint16 ids")

    def encode(data: bytes) -> torch.Tensor:
        return torch.tensor(tokenizer.encode(data.decode("utf-8", errors="replace")).ids, dtype=torch.int32)

    with open(vocabulary, "rb") as f:  # tokens of this vocabulary file's contents, wherever it lies
        name = "tokens-" + hashlib.sha1(f.read()).hexdigest()[:16]
    prefix = build_token_dataset(files, _cache_path(files, name), encode)
    return indexed_dataset_batches(prefix, seq_length, micro_batch_size, seed, data_parallel_rank)


def stdlib_text_batches(
    split: str, vocab_size: int, seq_length: int, micro_batch_size: int, seed: int
) -> Iterator[Dict[str, torch.Tensor]]:
    """Batches of the stdlib text's ``split`` ('train' or 'valid'): byte-level when ``vocab_size`` is 256, else
    through a BPE vocabulary of that size trained on the training split."""
    train_files, valid_files = stdlib_text_files()
    files = train_files if split == "train" else valid_files
    if vocab_size == 256:
        return byte_text_batches(files, seq_length, micro_batch_size, seed=seed)
    vocabulary = train_bpe_vocabulary(train_files, vocab_size)
    return bpe_text_batches(files, vocabulary, seq_length, micro_batch_size, seed=seed)


def cache_stdlib_text(vocab_size: int) -> None:
    """Build the stdlib text's token datasets (and the BPE vocabulary when ``vocab_size`` is not 256) once, before
    parallel runs start, so each run reads them from the cache instead of building them side by side."""
    for split in ("train", "valid"):
        stdlib_text_batches(split, vocab_size, seq_length=1, micro_batch_size=1, seed=0)


def indexed_dataset_batches(
    path_prefix: str, seq_length: int, micro_batch_size: int, seed: int, data_parallel_rank: int = 0
) -> Iterator[Dict[str, torch.Tensor]]:
    """Endless micro-batches of random windows of an indexed dataset's token stream (documents concatenated)."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(path_prefix)
    corpus = torch.from_numpy(numpy.concatenate([dataset[i] for i in range(len(dataset))]).astype(numpy.int64))
    if corpus.numel() <= seq_length + 1:
        raise ValueError(f"dataset {path_prefix} holds {corpus.numel()} tokens: shorter than one sequence")
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
