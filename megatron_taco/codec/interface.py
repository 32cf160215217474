"""What the collectives need of a wire codec: the interface every format's codec provides.

The compressed collectives (:mod:`megatron_taco.comm`), the settings handshake, the telemetry and the TACO
linears depend on this Protocol, not on a class: a wire format is a module under ``codec/`` (its settings,
its torch reference, its kernels) whose codec has these methods. :class:`~megatron_taco.codec.taco.TacoCodec`
is the one for TACO's formats (FP8 E4M3/E5M2, INT8, FP4 E2M1, INT4, with or without the Hadamard transform).
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

import torch

__all__ = ["WireCodec", "token_message"]


@runtime_checkable
class WireCodec(Protocol):
    def settings_bytes(self) -> bytes:
        """The 4 bytes every decoder must agree on (header bytes 4-7; the collectives' handshake compares them)."""

    def describe(self) -> str:
        """The settings in words, for errors that name what disagrees."""

    def compressed_nbytes(self, numel: int) -> int:
        """Bytes of the message for ``numel`` elements, header included."""

    def compress(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` (any shape) -> one uint8 message."""

    def compress_rows(self, rows: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each row of a 2-D tensor -> its own message: [R, m] -> uint8 [R, nbytes]."""

    def decompress(
        self, buf: torch.Tensor, shape: Sequence[int], dtype: torch.dtype = torch.float32, validate: bool = True
    ) -> torch.Tensor:
        """One message -> a tensor of ``shape`` and ``dtype``."""

    def decompress_sum(
        self, bufs: torch.Tensor, shape: Sequence[int], dtype: torch.dtype = torch.float32, validate: bool = True
    ) -> torch.Tensor:
        """N messages [N, nbytes] -> the fp32 sum of their decodes, in message order, cast to ``dtype``."""

    def decompress_rows(self, bufs: torch.Tensor, out: torch.Tensor, validate: bool = True) -> torch.Tensor:
        """Into each row of ``out`` [R, m]: the fp32 sum of its len(bufs) / R messages."""


def token_message(rows: torch.Tensor, out: Optional[torch.Tensor], wire: str) -> torch.Tensor:
    """The message of a wire whose tokens are rows of bytes ([tokens, bytes per token] uint8, MAPL's top-k and
    narrow-integer wires): flat, or written into ``out`` (uint8, that many bytes) when given."""
    if out is None:
        return rows.flatten()
    if out.dtype != torch.uint8 or out.shape != (rows.numel(),):
        raise ValueError(f"{wire}: out must be uint8 of shape ({rows.numel()},), got {out.dtype} {out.shape}")
    out.view(rows.shape).copy_(rows)
    return out
