"""What the collectives need of a wire codec: the interface every format's codec provides.

The compressed collectives (:mod:`megatron_taco.comm`), the settings handshake, the telemetry and the TACO
linears depend on this Protocol, not on a class: a wire format is a module under ``codec/`` (its settings,
its torch reference, its kernels) whose codec has these methods. :class:`~megatron_taco.codec.taco.TacoCodec`
is the one for TACO's formats (FP8 E4M3/E5M2, INT8, FP4 E2M1, INT4, with or without the Hadamard transform).
"""

from __future__ import annotations

import math
from typing import Optional, Protocol, Sequence, runtime_checkable

import torch

__all__ = ["TokenRowCodec", "WireCodec"]


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


class TokenRowCodec:
    """The shared half of a wire whose message is one row of ``token_bytes`` bytes per token of ``width`` values
    (MAPL's top-k and narrow-integer wires): the message size, and the checks of what goes in and comes out.
    A subclass sets ``width``, ``token_bytes`` and ``wire`` (its name in errors)."""

    wire: str
    width: int
    token_bytes: int

    def compressed_nbytes(self, numel: int) -> int:
        return numel // self.width * self.token_bytes

    def _tokens(self, numel: int) -> int:
        if numel % self.width:
            raise ValueError(f"{self.wire}: {numel} values are not whole tokens of {self.width}")
        return numel // self.width

    def _message(self, rows: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
        """The rows [tokens, token_bytes] uint8 as one flat message, written into ``out`` when given."""
        if out is None:
            return rows.flatten()
        self._message_buffer(rows.shape[0], out, rows.device).view(rows.shape).copy_(rows)
        return out

    def _message_buffer(self, tokens: int, out: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Where the message of ``tokens`` goes: ``out`` (checked: uint8 of the message's size) or a new buffer."""
        nbytes = tokens * self.token_bytes
        if out is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        if out.dtype != torch.uint8 or out.shape != (nbytes,):
            raise ValueError(f"{self.wire}: out must be uint8 of shape ({nbytes},), got {out.dtype} {out.shape}")
        return out

    def _rows(self, buf: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """A message for a tensor of ``shape`` as its rows [tokens, token_bytes], its size checked."""
        tokens = self._tokens(math.prod(shape))
        if buf.numel() != tokens * self.token_bytes:
            raise ValueError(
                f"{self.wire}: a message of {buf.numel()} bytes for {tokens} tokens of {self.token_bytes} bytes"
            )
        return buf.reshape(tokens, self.token_bytes)
