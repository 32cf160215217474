"""Compressed collectives along dim 0, with the shapes of Megatron's sequence-parallel ones.

    all_gather(x, group, codec)       [n, ...] -> [n * world, ...]
    reduce_scatter(x, group, codec)   [n * world, ...] -> [n, ...], summed
    all_reduce(x, group, codec)       same shape, summed

* All-gather: compress the local shard once, all-gather the bytes, decode
  every rank's message (one's own too, so every rank ends bit-identical).
* Reduce-scatter: compress the world's destination chunks (one launch),
  all-to-all the bytes, then one fused kernel decodes the received messages
  and sums them in fp32 in rank order (deterministic; one quantization per
  value). NCCL cannot sum FP8 payloads with different scales.
* All-reduce: compressed reduce-scatter, then compressed all-gather of the
  reduced chunk (two quantizations), on the flattened tensor.

``codec=None``, or a message smaller than ``CommOptions.min_bytes``, uses the
plain torch.distributed collective. Large messages are cut into row pieces of
about ``chunk_bytes``: piece k+1 is compressed while piece k is on the wire
(NCCL runs on its own stream; ``work.wait()`` only orders streams), and piece
k is decoded as soon as it lands. ``async_op=True`` returns a handle whose
``wait()`` returns the result, for overlap with compute.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_taco.codec import WireCodec
from megatron_taco.comm.handshake import ensure_same_settings

__all__ = ["CommOptions", "DEFAULT_OPTIONS", "Handle", "compresses", "all_gather", "reduce_scatter", "all_reduce"]


@dataclasses.dataclass(frozen=True)
class CommOptions:
    """When to compress and how to pipeline.

    min_bytes: messages (uncompressed bytes of the local input) below this go uncompressed.
    chunk_bytes: pieces of about this many uncompressed bytes are pipelined on CUDA (0: one piece).
    """

    min_bytes: int = 0
    chunk_bytes: int = 128 << 20  # best or tied in every link regime (benchmarks/results/collectives.md)

    def __post_init__(self) -> None:
        if self.min_bytes < 0 or self.chunk_bytes < 0:
            raise ValueError(f"min_bytes and chunk_bytes must be >= 0, got {self}")


DEFAULT_OPTIONS = CommOptions()


class Handle:
    """Result of an async collective: ``wait()`` finishes it and returns the output tensor."""

    def __init__(self, finish: Callable[[], torch.Tensor]) -> None:
        self._finish: Optional[Callable[[], torch.Tensor]] = finish
        self._result: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._result = self._finish()
            self._finish = None
        return self._result


def _world(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group)


def compresses(x: torch.Tensor, codec: Optional[WireCodec], options: CommOptions) -> bool:
    """Whether a collective of input ``x`` goes compressed (codec given and x above the threshold)."""
    return codec is not None and x.numel() > 0 and x.numel() * x.element_size() >= options.min_bytes


def _compresses(x: torch.Tensor, group, codec: Optional[WireCodec], options: CommOptions) -> bool:
    ensure_same_settings(group, codec, options.min_bytes, options.chunk_bytes, x.device)
    return compresses(x, codec, options)


def _row_pieces(rows: int, row_bytes: int, options: CommOptions, on_cuda: bool) -> List[Tuple[int, int]]:
    """[start, end) row ranges of about chunk_bytes each (one piece off CUDA: nothing to overlap)."""
    if not on_cuda or options.chunk_bytes == 0 or rows * row_bytes <= options.chunk_bytes:
        return [(0, rows)]
    per_piece = max(1, options.chunk_bytes // max(1, row_bytes))
    return [(start, min(rows, start + per_piece)) for start in range(0, rows, per_piece)]


def _check_rank_input(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} takes a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{name} works along dim 0; got a 0-d tensor")


def all_gather(
    x: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    codec: Optional[WireCodec],
    options: CommOptions = DEFAULT_OPTIONS,
    async_op: bool = False,
):
    """Gather ``x`` [n, ...] from every rank into [n * world, ...] (rank order)."""
    _check_rank_input(x, "all_gather")
    x = x.contiguous()
    world = _world(group)
    out = torch.empty((x.shape[0] * world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if not _compresses(x, group, codec, options):
        return _uncompressed(dist.all_gather_into_tensor, out, x, group, async_op)

    def send(start: int, end: int):
        message = codec.compress(x[start:end])
        gathered = torch.empty(world * message.numel(), dtype=torch.uint8, device=x.device)
        work = dist.all_gather_into_tensor(gathered, message, group=group, async_op=True)
        return work, gathered.view(world, -1)

    # destination of rows [start, end) of every rank's shard: a [world, piece] view of the output
    return _pipelined(x, x.shape[0], out, out.view(world, -1), send, codec, options, async_op)


def reduce_scatter(
    x: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    codec: Optional[WireCodec],
    options: CommOptions = DEFAULT_OPTIONS,
    async_op: bool = False,
):
    """Sum ``x`` [n * world, ...] over ranks and keep this rank's chunk [n, ...]."""
    _check_rank_input(x, "reduce_scatter")
    world = _world(group)
    if x.shape[0] % world:
        raise ValueError(f"reduce_scatter: dim 0 of size {x.shape[0]} is not divisible by the group size {world}")
    x = x.contiguous()
    rows = x.shape[0] // world
    out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if not _compresses(x, group, codec, options):
        return _uncompressed(dist.reduce_scatter_tensor, out, x, group, async_op)

    row_numel = x[0].numel()
    chunks = x.view(world, rows * row_numel)  # chunk r goes to rank r

    def send(start: int, end: int):
        messages = codec.compress_rows(chunks[:, start * row_numel : end * row_numel])
        received = torch.empty_like(messages)
        return dist.all_to_all_single(received, messages, group=group, async_op=True), received

    # all received messages of a piece sum into one row: a [1, piece] view of the output
    return _pipelined(x, rows, out, out.view(1, -1), send, codec, options, async_op)


def all_reduce(
    x: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    codec: Optional[WireCodec],
    options: CommOptions = DEFAULT_OPTIONS,
    async_op: bool = False,
):
    """Sum ``x`` over ranks (any shape): compressed reduce-scatter + compressed all-gather."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"all_reduce takes a torch.Tensor, got {type(x).__name__}")
    if not _compresses(x, group, codec, options):
        out = x.clone()
        work = dist.all_reduce(out, group=group, async_op=True)
        return _finish(lambda: (work.wait(), out)[1], async_op)
    world = _world(group)
    flat = x.reshape(-1)
    per_rank = -(-flat.numel() // world)
    padded = torch.zeros(per_rank * world, dtype=x.dtype, device=x.device)
    padded[: flat.numel()] = flat
    # A 2-D view [world * per_rank, 1] lets the dim-0 collectives cut it into per-rank chunks.
    reducing = reduce_scatter(padded.view(-1, 1), group, codec, options, async_op=True)

    def finish() -> torch.Tensor:
        gathered = all_gather(reducing.wait(), group, codec, options)
        return gathered.view(-1)[: flat.numel()].view(x.shape)

    return _finish(finish, async_op)


def _pipelined(
    x: torch.Tensor,
    rows: int,
    out: torch.Tensor,
    out_rows: torch.Tensor,
    send: Callable[[int, int], Tuple[dist.Work, torch.Tensor]],
    codec: WireCodec,
    options: CommOptions,
    async_op: bool,
):
    """Compress and send row pieces [start, end) of ``x`` one after another (``send`` returns the
    collective's work and its receive buffer); decode each piece into its columns of ``out_rows``
    as soon as it has landed."""
    row_numel = x[0].numel()
    inflight = []
    for start, end in _row_pieces(rows, row_numel * x.element_size(), options, x.is_cuda):
        work, received = send(start, end)
        inflight.append((work, received, out_rows[:, start * row_numel : end * row_numel]))

    def finish() -> torch.Tensor:
        for work, received, destination in inflight:
            work.wait()
            codec.decompress_rows(received, destination, validate=False)
        return out

    return _finish(finish, async_op)


def _uncompressed(collective: Callable, out: torch.Tensor, x: torch.Tensor, group, async_op: bool):
    """The plain torch.distributed ``collective(out, x)``, with the same sync/async contract."""
    work = collective(out, x, group=group, async_op=True)
    return _finish(lambda: (work.wait(), out)[1], async_op)


def _finish(finish: Callable[[], torch.Tensor], async_op: bool):
    return Handle(finish) if async_op else finish()
