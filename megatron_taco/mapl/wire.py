"""Megatron-core's P2P communicators for MAPL wires other than z in the pipeline dtype.

:class:`CodecWireCommunicator` (``--mapl-wire fp8``): z forward and dL/dz backward travel as TACO codec
messages (FP8 E4M3 after the Hadamard transform, one power-of-two scale byte per group of a token's z:
:func:`fp8_wire_codec`), encoded on send and decoded on arrival, so the schedule and the stages see r-wide
tensors as with the bf16 wire. At a given byte budget this buys twice the rank: 8x in bytes is r = d / 4 in
FP8, which trained 1.3 points better than r = d / 8 in bf16 (benchmarks/results/mapl_loopback.md).

:class:`CodecWireCommunicator` also carries ``--mapl-wire int5``
(:class:`~megatron_taco.codec.narrow_int.NarrowIntCodec`: 5-bit integers after a Hadamard of 32, 1.5x the FP8
wire's rank at no more bytes) and ``--mapl-wire topk`` (:class:`~megatron_taco.codec.topk.TopKCodec`: z d wide,
each token's k largest values in FP8 and their positions; the receiving stage keeps dL/dz on the coordinates that
arrived, so the gradient goes back at the same k).

:class:`IndexWireCommunicator`: VQ indices instead of activations on the forward wire.

With residual VQ the forward message is L indices per token, packed into the
pipeline dtype ([s, b, w], w = L bytes / element size), while the backward message
is still the r-wide gradient dL/dz (the quantizer passes gradients straight through).
Autograd gives a tensor's gradient that tensor's shape, so the two directions cannot
share one tensor; the schedule is not changed, this communicator does the swap:

- send forward: the stage's output z_q carries its packed indices in ``mapl_indices``;
  those are sent instead of z_q (the schedule still holds z_q for the backward pass).
- receive forward: the packed indices arrive; the schedule gets an r-wide zero
  *carrier* (requires grad) holding them in ``mapl_indices``. The receiving stage
  decodes the indices and adds the carrier, so the carrier's gradient is dL/dz_q,
  r wide, and that is what the schedule sends back.

Both sides know both shapes (uniform r, fixed L and K), so the shape exchange of
megatron-core's variable-shape mode is answered locally: no extra messages.
"""

from __future__ import annotations

import copy
import math
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_taco.codec import TacoCodec
from megatron_taco.codec.narrow_int import NarrowIntCodec
from megatron_taco.codec.topk import TopKCodec
from megatron_taco.config.errors import MaplConfigError
from megatron_taco.config.mapl import INT5_BITS, MaplConfig

__all__ = [
    "CodecWireCommunicator",
    "IndexWireCommunicator",
    "WireRoundTrip",
    "compression_ratio",
    "describe_compression",
    "fp8_wire_codec",
    "round_trip",
    "warm_up_wire_codec",
    "wire_codec",
]


# what a compressed wire sends z and dL/dz as: TACO's FP8 codec (--mapl-wire fp8), the 5-bit one (int5) or the
# top-k one (topk)
MaplWireCodec = Union[TacoCodec, NarrowIntCodec, TopKCodec]


def fp8_wire_codec(rank: int) -> TacoCodec:
    """The codec of ``--mapl-wire fp8`` for a z of ``rank`` values per token: E4M3 codes, the Hadamard
    transform, one power-of-two scale byte per group (128 values, or the largest power of two dividing r)."""
    group = next((g for g in (128, 64, 32, 16) if rank % g == 0), None)
    if group is None:
        raise MaplConfigError(f"--mapl-wire fp8: the wire rank {rank} must be a multiple of 16 (codec groups)")
    return TacoCodec(group, "e4m3", "ash", "e8m0")


def wire_codec(cfg: MaplConfig, rank: int) -> Optional[MaplWireCodec]:
    """The codec of ``cfg.wire`` for a z of ``rank`` values (None: z goes as it is in the pipeline dtype)."""
    if cfg.wire == "topk":
        return TopKCodec(rank, cfg.topk_values(rank))
    if cfg.wire == "int5":
        return NarrowIntCodec(rank, INT5_BITS)
    return fp8_wire_codec(rank) if cfg.wire == "fp8" else None


def compression_ratio(hidden_size: int, rank: int, codec: Optional[MaplWireCodec], element_size: int) -> float:
    """d / r, or with a codec wire the bytes of h (``element_size`` bytes per value) over the codec bytes of z per
    token (codes and scale bytes; the message header aside)."""
    if codec is None:
        return hidden_size / rank
    return element_size * hidden_size / (codec.compressed_nbytes(rank) - codec.compressed_nbytes(0))


def describe_compression(hidden_size: int, rank: int, codec: Optional[MaplWireCodec], element_size: int) -> str:
    """:func:`compression_ratio` in words, for the start-up lines."""
    ratio = compression_ratio(hidden_size, rank, codec, element_size)
    if codec is None:
        return f"{ratio:g}x"
    if isinstance(codec, TopKCodec):
        return f"{ratio:.2f}x in bytes: each token's {codec.k} largest of {rank} values of z in FP8, both ways"
    if isinstance(codec, NarrowIntCodec):
        return f"{ratio:.2f}x in bytes: z as INT{codec.bits} messages both ways"
    return f"{ratio:.2f}x in bytes: z as FP8 codec messages both ways"


def round_trip(codec: Optional[MaplWireCodec], x: torch.Tensor) -> torch.Tensor:
    """What the wire delivers of ``x``: one message of ``codec``, encoded and decoded (x itself on the bf16 wire)."""
    if codec is None:
        return x
    return codec.decompress(codec.compress(x), x.shape, x.dtype, validate=False)


def warm_up_wire_codec(cfg: MaplConfig, hidden_size: int) -> Optional[MaplWireCodec]:
    """The codec of ``--mapl-warmup-steps``' d-wide messages: the FP8 / INT5 wire's at rank d (INT5 at d = 512:
    3.04x fewer bytes than bf16; on the CPU model the same loss as a warm-up in bf16, on the GPU model +0.38 points
    [-0.14, +0.90] over half the run, benchmarks/results/mapl_loopback.md); None (the pipeline dtype) without a
    warm-up, for the other wires and for hidden sizes not in groups of 16 (``MaplConfig.warm_up_on_wire``)."""
    return wire_codec(cfg, hidden_size) if cfg.warm_up_on_wire(hidden_size) else None


class WireRoundTrip(torch.autograd.Function):
    """z -> :func:`round_trip` (z) forward, g -> :func:`round_trip` (g) backward with ``grad_codec``: what the
    P2P messages of a compressed wire deliver in both directions, on one rank (``--mapl-warmup-steps``'s
    sender; the loopback study)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, codec: MaplWireCodec, grad_codec: MaplWireCodec) -> torch.Tensor:
        ctx.grad_codec = grad_codec
        return round_trip(codec, z)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return round_trip(ctx.grad_codec, grad), None, None


class CodecWireCommunicator(P2PCommunicator):
    """Sends every r-wide P2P tensor (z forward, dL/dz backward; during ``--mapl-warmup-steps`` a second one with r =
    d: the warm-up's message and its gradient) as one codec message, padded to whole elements of the pipeline dtype;
    decodes what arrives to r wide. Both sides know r, so the shapes of megatron-core's
    variable-shape mode are answered locally (no extra messages). Received messages are decoded on arrival,
    so this communicator waits on its P2P requests (megatron-core's default outside interleaved overlap)."""

    def __init__(self, pp_group: dist.ProcessGroup, config, codec: MaplWireCodec) -> None:
        own = copy.copy(config)
        own.variable_seq_lengths = True  # receive buffers take the shapes from _communicate_shapes
        super().__init__(pp_group, own)
        self.codec = codec
        self.dtype = config.pipeline_dtype
        self._shape: Optional[Tuple[int, ...]] = None
        self._checked = False  # the first message's header is checked on the host: settings agree by name

    def _message_bytes(self) -> int:
        return self.codec.compressed_nbytes(math.prod(self._shape))

    def _wire_shape(self) -> Tuple[int, int, int]:
        return 1, 1, -(-self._message_bytes() // self.dtype.itemsize)

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        if not (recv_prev or recv_next):
            return None, None
        return self._wire_shape(), self._wire_shape()

    def _encode(self, tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if tensor is None:
            return None
        self._shape = tuple(tensor.shape)
        wire = torch.empty(self._wire_shape(), dtype=self.dtype, device=tensor.device)  # padding: never decoded
        self.codec.compress(tensor.detach(), out=wire.view(-1).view(torch.uint8)[: self._message_bytes()])
        return wire

    def _decode(self, wire: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if wire is None:
            return None
        message = wire.detach().view(-1).view(torch.uint8)[: self._message_bytes()]
        decoded = self.codec.decompress(message, self._shape, self.dtype, validate=not self._checked)
        self._checked = True
        return decoded

    def _communicate(
        self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, wait_on_reqs=True
    ):
        if not wait_on_reqs:
            raise MaplConfigError(
                "--mapl-wire fp8 / int5 / topk decode P2P messages on arrival; add --no-overlap-p2p-communication"
            )
        if tensor_shape is not None:
            self._shape = tuple(tensor_shape)
        received, grad, reqs = super()._communicate(
            tensor_send_next=self._encode(tensor_send_next),
            tensor_send_prev=self._encode(tensor_send_prev),
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
            wait_on_reqs=True,
        )
        received = self._decode(received)
        if received is not None:  # an activation: the schedule takes its gradient
            received.requires_grad_(True)
        return received, self._decode(grad), reqs


class IndexWireCommunicator(P2PCommunicator):
    def __init__(self, pp_group: dist.ProcessGroup, config, index_width: int) -> None:
        own = copy.copy(config)
        own.variable_seq_lengths = True  # receive buffers take the shapes from _communicate_shapes
        super().__init__(pp_group, own)
        self.index_width = index_width
        self._shape: Optional[Tuple[int, ...]] = None

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        if not (recv_prev or recv_next):
            return None, None
        seq, batch, width = self._shape
        return (seq, batch, self.index_width), (seq, batch, width)

    def _communicate(
        self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, wait_on_reqs=True
    ):
        if tensor_shape is not None:
            self._shape = tuple(tensor_shape)
        if tensor_send_next is not None:
            indices = getattr(tensor_send_next, "mapl_indices", None)
            if indices is None:
                raise RuntimeError(
                    "MAPL VQ: a stage sent an activation without VQ indices; every boundary of this "
                    "pipeline must use VQ (--mapl-vq-levels)"
                )
            tensor_send_next = indices
        received, grad, reqs = super()._communicate(
            tensor_send_next=tensor_send_next,
            tensor_send_prev=tensor_send_prev,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
            wait_on_reqs=wait_on_reqs,
        )
        if received is not None:
            carrier = torch.zeros(self._shape, dtype=received.dtype, device=received.device, requires_grad=True)
            carrier.mapl_indices = received.detach()
            received = carrier
        return received, grad, reqs
