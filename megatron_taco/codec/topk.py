"""The top-k sparse wire format: each token's k largest-magnitude values in FP8, and which they are.

MAPL's ``--mapl-wire topk`` sends z = (h - a) U with U square this way: where a dense wire keeps one fixed
r-dimensional subspace for every token, this one keeps each token's own k coordinates. A token's d-wide
vector becomes one row of the message::

    row       = [scale byte][k E4M3 codes][positions]
    scale     2^e with e = ceil(log2(max |kept| / 448)), so every code fits E4M3's range, stored as the E8M0
              byte e + 127 (a token of zeros: scale 1; 255: the token held a NaN or an Inf, it decodes as NaN)
    codes     kept value / 2^e rounded to the nearest E4M3, in ascending position order
    positions a d-bit mask, or k indices of ceil(log2 d) bits, whichever is shorter, bit-packed LSB first

Decoding scatters the k values back; every other coordinate is 0. The same format carries dL/dz back: the
receiver keeps the gradient on the nonzero coordinates it received (:meth:`TopKCodec.support_only`), so the top k
of that gradient are those coordinates: the gradient of the sparse map (the choice of the k is piecewise
constant), straight through the FP8 rounding. A kept value that rounds to 0 (below about 2^-19 of its token's
largest) sends nothing forward and gets no gradient back. Torch operations, on any device.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from megatron_taco.codec.interface import TokenRowCodec

__all__ = ["TopKCodec", "topk_count", "topk_token_bytes"]

E4M3_MAX = 448.0  # largest finite E4M3 value
_NONFINITE_SCALE = 255  # E8M0's NaN byte: the token held a non-finite value


def _index_bits(width: int) -> int:
    return max(1, math.ceil(math.log2(width)))


def _positions_bytes(width: int, k: int) -> int:
    """Bytes that say which k of ``width`` coordinates a token sends: a bitmask or packed indices, the shorter."""
    return min(math.ceil(width / 8), math.ceil(k * _index_bits(width) / 8))


def topk_token_bytes(width: int, k: int) -> int:
    """Message bytes per token: the scale byte, k codes, the positions."""
    return 1 + k + _positions_bytes(width, k)


def topk_count(width: int, ratio: float, element_size: int = 2) -> int:
    """The largest k whose :func:`topk_token_bytes` keep ``ratio`` against the token's ``width`` values of
    ``element_size`` bytes (0 when not even one value fits)."""
    budget = element_size * width / ratio
    return max((k for k in range(1, width + 1) if topk_token_bytes(width, k) <= budget), default=0)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[T, n] bool -> [T, ceil(n / 8)] uint8, bit j of byte i = bits[:, 8 i + j]."""
    tokens, n = bits.shape
    padded = torch.nn.functional.pad(bits.to(torch.int32), (0, -n % 8)).view(tokens, -1, 8)
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.int32, device=bits.device)
    return (padded * weights).sum(-1).to(torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`_pack_bits`: [T, m] uint8 -> [T, n] bool."""
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
    return ((packed.to(torch.int32)[..., None] >> shifts) & 1).flatten(1)[:, :n].bool()


class TopKCodec(TokenRowCodec):
    """Per token of ``width`` values: the ``k`` largest in magnitude, in FP8 E4M3 under one power-of-two scale.

    compress: [..., width] -> uint8 [tokens * :func:`topk_token_bytes`]; decompress: back to [..., width], zeros
    where nothing was sent. ``compressed_nbytes`` / ``compress`` / ``decompress`` are what MAPL's P2P wire and its
    telemetry use of a wire codec.
    """

    wire = "top-k wire"

    def __init__(self, width: int, k: int) -> None:
        if not 0 < k <= width:
            raise ValueError(f"top-k wire: k = {k} values of {width} per token; needs 0 < k <= width")
        self.width, self.k = width, k
        self.token_bytes = topk_token_bytes(width, k)
        self.bitmask = math.ceil(width / 8) <= math.ceil(k * _index_bits(width) / 8)

    def describe(self) -> str:
        return f"top-{self.k} of {self.width} values per token in FP8 E4M3 ({self.token_bytes} bytes per token)"

    def compress(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` [..., width] -> one uint8 message (written to ``out`` [nbytes] if given)."""
        tokens = self._tokens(x.numel())
        rows = x.detach().reshape(tokens, self.width).float()
        finite = torch.isfinite(rows).all(-1)
        rows = torch.where(finite[:, None], rows, torch.zeros((), device=rows.device))
        index = rows.abs().topk(self.k, dim=-1).indices.sort(-1).values
        values = rows.gather(-1, index)
        # e = ceil(log2(amax / 448)): frexp gives amax / 448 = m 2^E with m in [0.5, 1); m = 0.5 is 2^(E - 1)
        mantissa, exponent = torch.frexp(values.abs().amax(-1) / E4M3_MAX)
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp(-127, 127)
        exponent = torch.where(mantissa == 0, torch.zeros_like(exponent), exponent)  # a token of zeros: scale 1
        codes = (values * torch.exp2(-exponent.float())[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
        scale = torch.where(finite, exponent + 127, _NONFINITE_SCALE).to(torch.uint8)
        if self.bitmask:
            bits = torch.zeros(tokens, self.width, dtype=torch.bool, device=x.device).scatter(-1, index, True)
        else:
            shifts = torch.arange(_index_bits(self.width), device=x.device)
            bits = ((index[..., None] >> shifts) & 1).flatten(1).bool()
        return self._message(torch.cat([scale[:, None], codes, _pack_bits(bits)], dim=1), out)

    def decompress(
        self, buf: torch.Tensor, shape: Sequence[int], dtype: torch.dtype = torch.float32, validate: bool = True
    ) -> torch.Tensor:
        """One message -> [shape] in ``dtype``; ``validate``: check the positions (k distinct, inside the token)."""
        rows = self._rows(buf, shape)
        tokens = rows.shape[0]
        exponent = rows[:, 0].to(torch.int32)
        codes = rows[:, 1 : 1 + self.k].contiguous().view(torch.float8_e4m3fn).float()
        positions = rows[:, 1 + self.k :]
        if self.bitmask:
            mask = _unpack_bits(positions, self.width)
            if validate and not bool((mask.sum(-1) == self.k).all()):
                raise ValueError(f"top-k wire: a token's bitmask does not mark {self.k} positions")
            index = mask.nonzero()[:, 1].view(tokens, self.k)
        else:
            bits = _unpack_bits(positions, self.k * _index_bits(self.width)).view(tokens, self.k, -1)
            index = (bits.to(torch.int64) << torch.arange(bits.shape[-1], device=buf.device)).sum(-1)
            if validate and not bool(((index < self.width).all() and (index.diff(dim=-1) > 0).all())):
                raise ValueError(
                    f"top-k wire: a token's indices are not {self.k} ascending positions below {self.width}"
                )
        values = codes * torch.exp2((exponent - 127).float())[:, None]
        decoded = torch.zeros(tokens, self.width, dtype=torch.float32, device=buf.device).scatter(-1, index, values)
        decoded = torch.where((exponent == _NONFINITE_SCALE)[:, None], float("nan"), decoded)
        return decoded.view(*shape).to(dtype)

    @staticmethod
    def support_only(z: torch.Tensor) -> torch.Tensor:
        """The receiver's z with its gradient kept only on z's nonzero coordinates (the ones that arrived, less any
        kept value that rounded to 0), so that the top k of the gradient going back are those coordinates. The same
        values forward."""
        return z * (z != 0).to(z.dtype)
