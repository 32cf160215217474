"""``TacoCodec``: the public TACO codec (Adaptive Scale-Hadamard + group-scaled FP8, FP4 E2M1 or INT4).

    codec = TacoCodec(group_size=128, fmt="e4m3", transform="ash")
    buf = codec.compress(x)                    # uint8 1-D: the whole wire message
    y = codec.decompress(buf, x.shape, x.dtype)

On CUDA tensors the fused Triton kernels run; elsewhere the torch reference
(:mod:`megatron_taco.codec.reference`) does. ``backend`` forces either one
("triton" also runs on CPU tensors under ``TRITON_INTERPRET=1``). Both produce
the same bytes. ``backend="te"`` compresses with Transformer Engine's FP8 block quantizer
(:mod:`megatron_taco.codec.te_cast`; CUDA, FP8, group 128, fp32 scales) and decodes with the Triton kernels.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from megatron_taco.codec import reference, te_cast
from megatron_taco.codec.format import (
    SUPPORTED_INPUT_DTYPES,
    CodecSettings,
    check_header,
    header_bytes,
)

__all__ = ["BACKENDS", "TacoCodec", "describe_backend"]

BACKENDS = ("auto", "torch", "triton", "te")
DEFAULT_SCALES = "fp32"


def describe_backend(backend: str, cuda: bool) -> str:
    """Which encoder runs, in words, for start-up lines ("auto" says what it picked and why)."""
    if backend == "auto":
        if not cuda:
            return "torch reference (auto: no GPU)"
        return "triton (auto: Triton's kernels measured faster than Transformer Engine's cast, kernels.md)"
    return {"te": "te (Transformer Engine's FP8 cast; Triton transform and decode)"}.get(backend, backend)


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"TacoCodec compresses torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_INPUT_DTYPES:
        raise TypeError(f"TacoCodec accepts float32, bfloat16 and float16 tensors, got {x.dtype}")


def _check_output_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_INPUT_DTYPES:
        raise TypeError(f"TacoCodec decodes to float32, bfloat16 or float16, got {dtype}")


class TacoCodec:  # a WireCodec (megatron_taco.codec.interface)
    """Compress float tensors to one FP8, INT8 or 4-bit wire message and back.

    Args:
        group_size: G in {16, 32, 64, 128, 256}: elements sharing one scale and one Hadamard.
        fmt: "e4m3" (max 448, default), "e5m2" (max 57344) or "int8" (-127..127); 4-bit: "e2m1" (FP4, max 6) or
            "int4" (-7..7).
        transform: "ash" (adaptive scale + Hadamard) or "none" (per-group quantization only).
        scales: "fp32" (one folded scale per group, default), "dual" (the paper's
            s_q and s_a, 8 bytes per group), "e8m0" (one power-of-two byte) or, for the 4-bit formats, "e4m3"
            (one E4M3 byte per group times one fp32 scale per message: NVFP4's layout, with group_size=16).
        backend: "auto" (Triton kernels on CUDA tensors, torch otherwise: on H200 they beat TE's cast,
            benchmarks/results/kernels.md), "torch", "triton", "te" (TE's cast, Triton's transform and decode).
        rounding: "nearest" (ties to even) or, for the 4-bit formats, "stochastic" (unbiased: for gradients).
        seed: stochastic rounding's seed; call k of ``compress_rows`` uses hash32(hash32(seed) ^ k), the same on
            both backends: a run started again reproduces (a resumed one draws new noise: the count is not saved).
    """

    def __init__(
        self,
        group_size: int = 128,
        fmt: str = "e4m3",
        transform: str = "ash",
        scales: str = DEFAULT_SCALES,
        backend: str = "auto",
        rounding: str = "nearest",
        seed: int = 0,
    ) -> None:
        self.settings = CodecSettings(
            group_size=group_size, fmt=fmt, transform=transform, scales=scales, rounding=rounding
        )
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "te":
            te_cast.check_te_settings(self.settings)
        self.backend = backend
        self._headers: dict = {}
        self.seed = seed
        self._calls = 0  # compress calls so far: stochastic rounding draws new noise for each

    def __repr__(self) -> str:
        return f"TacoCodec({self.settings.describe()}, backend={self.backend})"

    def settings_bytes(self) -> bytes:
        """Header bytes 4-7: what every decoder must agree on."""
        return self.settings.settings_bytes()

    def describe(self) -> str:
        return self.settings.describe()

    @property
    def group_size(self) -> int:
        return self.settings.group_size

    def compressed_nbytes(self, numel: int) -> int:
        """Size in bytes of the message for ``numel`` elements (header included)."""
        return self.settings.compressed_nbytes(numel)

    def compression_ratio(self, numel: int, dtype: torch.dtype = torch.bfloat16) -> float:
        """Uncompressed bytes over message bytes."""
        return numel * torch.empty((), dtype=dtype).element_size() / self.compressed_nbytes(numel)

    def _use_triton(self, x: torch.Tensor) -> bool:
        """Triton kernels for this tensor (TE's backend decodes with them too)."""
        if self.backend == "te" and not x.is_cuda:
            raise ValueError("backend 'te' (Transformer Engine) needs CUDA tensors")
        return self.backend in ("triton", "te") or (self.backend == "auto" and x.is_cuda)

    def _header(self, numel: int, device: torch.device, encoder: str = "taco") -> torch.Tensor:
        key = (numel, device, encoder)
        if key not in self._headers:
            raw = header_bytes(self.settings, numel, encoder)
            self._headers[key] = torch.tensor(list(raw), dtype=torch.uint8, device=device)
        return self._headers[key]

    def compress(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Encode ``x`` (any shape, contiguous or not) into one uint8 message (written to ``out`` if given)."""
        _check_input(x)
        nbytes = self.compressed_nbytes(x.numel())
        if out is None:
            out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
        elif out.dtype != torch.uint8 or out.shape != (nbytes,):
            raise ValueError(f"out must be a uint8 tensor of {nbytes} elements")
        self.compress_rows(x.reshape(1, -1), out.view(1, -1))
        return out

    def compress_rows(self, rows: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Encode each row of a 2-D tensor as its own message: [R, m] -> uint8 [R, nbytes].

        Rows may be strided views (e.g. the destination chunks of a reduce-scatter).
        """
        _check_input(rows)
        if rows.dim() != 2:
            raise ValueError(f"compress_rows takes a 2-D tensor, got shape {tuple(rows.shape)}")
        if rows.shape[1] > 1 and rows.stride(1) != 1:
            rows = rows.contiguous()
        numel = rows.shape[1]
        nbytes = self.compressed_nbytes(numel)
        if out is None:
            out = torch.empty(rows.shape[0], nbytes, dtype=torch.uint8, device=rows.device)
        elif out.dtype != torch.uint8 or out.shape != (rows.shape[0], nbytes) or out.stride(1) != 1:
            raise ValueError(f"out must be a uint8 tensor of shape {(rows.shape[0], nbytes)} with unit column stride")
        call_seed = reference.hash32(reference.hash32(self.seed & 0xFFFFFFFF) ^ (self._calls & 0xFFFFFFFF))
        self._calls += 1
        if self.backend == "te" and self._use_triton(rows):
            te_cast.compress_rows_te(rows, out, self.settings, self._header(numel, rows.device, "te"))
            return out
        if self._use_triton(rows):
            from megatron_taco.codec import kernels

            kernels.compress_rows(rows, out, self.settings, call_seed)
            return out
        groups, codes_at, scales_at = self.settings.layout(numel)
        header = self._header(numel, rows.device)
        stochastic = self.settings.rounding == "stochastic"
        noise = (
            reference.uniform_noise(call_seed, rows.shape[0], groups * self.group_size, rows.device)
            if stochastic
            else None
        )
        for r, (row, message) in enumerate(zip(rows, out)):
            padded = torch.zeros(groups * self.group_size, dtype=torch.float32, device=rows.device)
            padded[:numel] = row
            row_noise = noise[r].view(groups, self.group_size) if stochastic else None
            codes, scales = reference.encode_groups(padded.view(groups, self.group_size), self.settings, row_noise)
            message[:codes_at] = header
            message[codes_at:scales_at] = codes.reshape(-1)
            message[scales_at:] = scales.contiguous().view(torch.uint8).reshape(-1)
        return out

    def _split(self, buf: torch.Tensor, numel: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(codes [groups, G], scales [groups, k]) views of one message."""
        groups, codes_at, scales_at = self.settings.layout(numel)
        codes = buf[codes_at:scales_at].view(groups, self.settings.code_bytes)
        if self.settings.scales == "e4m3":  # the group bytes and the message scale, as they lie
            return codes, buf[scales_at:]
        scale_dtype = torch.uint8 if self.settings.scales == "e8m0" else torch.float32
        per_group = self.settings.scale_bytes // torch.empty((), dtype=scale_dtype).element_size()
        return codes, buf[scales_at:].view(scale_dtype).view(groups, per_group)

    def decompress(
        self,
        buf: torch.Tensor,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        validate: bool = True,
    ) -> torch.Tensor:
        """Decode a message into a tensor of ``shape`` and ``dtype``.

        ``validate`` checks the header on the host (a device sync on GPU); the
        collectives check settings once per process group instead.
        """
        return self.decompress_sum(buf.view(1, -1), shape, dtype, validate)

    def decompress_sum(
        self,
        bufs: torch.Tensor,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        validate: bool = True,
    ) -> torch.Tensor:
        """Decode N messages (rows of a [N, nbytes] uint8 tensor) and sum them in fp32, in row order."""
        _check_output_dtype(dtype)
        if bufs.dim() != 2:
            raise ValueError(f"decompress_sum takes a [N, nbytes] uint8 tensor, got shape {tuple(bufs.shape)}")
        out = torch.empty(shape, dtype=dtype, device=bufs.device)
        self.decompress_rows(bufs, out.view(1, -1), validate)
        return out

    def decompress_rows(self, bufs: torch.Tensor, out: torch.Tensor, validate: bool = True) -> torch.Tensor:
        """Decode into each row of ``out`` [R, m] the fp32 sum of its N = len(bufs) / R messages.

        With R = len(bufs) every message has its own output row (an all-gather's
        step); with R = 1 all messages are summed (a reduce-scatter's step).
        """
        _check_output_dtype(out.dtype)
        rows, numel = out.shape
        if bufs.dim() != 2 or bufs.dtype != torch.uint8 or rows == 0 or bufs.shape[0] == 0 or bufs.shape[0] % rows:
            raise ValueError(
                f"decompress_rows takes uint8 messages [N, nbytes] with N >= 1 a multiple of the {rows} output rows, "
                f"got {bufs.dtype} of shape {tuple(bufs.shape)}"
            )
        if out.shape[1] > 1 and out.stride(1) != 1:
            raise ValueError("decompress_rows needs output rows with unit column stride")
        if validate:
            for message in bufs:
                check_header(self.settings, message, numel)
        if self._use_triton(bufs):
            from megatron_taco.codec import kernels

            kernels.decompress_rows(bufs, out, self.settings)
            return out
        per_row = bufs.shape[0] // rows
        for r in range(rows):
            parts = [self._split(message, numel) for message in bufs[r * per_row : (r + 1) * per_row]]
            total = reference.decode_sum_groups([c for c, _ in parts], [s for _, s in parts], self.settings)
            out[r] = total.reshape(-1)[:numel]
        return out
