"""Codec settings, element formats (FP8, INT8, FP4 E2M1, INT4) and the wire format of one compressed message.

A message is one contiguous uint8 buffer::

    [ header (16 B) | codes (n_groups * G bytes, or G / 2 for 4-bit) | scales (n_groups * scale_bytes) ]
    (+ 4 bytes with scales="e4m3": the message's fp32 scale, little-endian, after the group scales)

The header lets a receiver refuse a buffer made with other settings instead of
decoding garbage::

    bytes 0-3   magic b"TACO"
    byte  4     wire-format version
    byte  5     transform (low nibble) | element format (high nibble)
    byte  6     log2(group size) (low nibble) | rounding (high nibble: 0 nearest, 1 stochastic)
    byte  7     scale storage (low nibble) | encoder (high nibble: 0 TACO's kernels or reference, 1 Transformer
                Engine's cast; informational: every decoder reads both, so it is not part of the settings)
    bytes 8-15  element count, little-endian uint64

Codes are FP8 bit patterns or two's-complement INT8, one byte per element, or 4-bit codes (FP4 E2M1 bit
patterns, or two's-complement INT4) packed two per byte, element 2i in the low
nibble (the last group is zero-padded; padding never reaches the output). Scales are per group: ``dual`` stores (s_q, s_a) as two
fp32, ``fp32`` stores one folded fp32 scale, ``e8m0`` one biased power-of-two
exponent byte, ``e4m3`` one E4M3 byte that multiplies the message's fp32 scale (the NVFP4 layout: 4-bit
formats, G=16).
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from typing import Dict, Optional, Tuple

import torch

__all__ = [
    "HEADER_BYTES",
    "ElementFormat",
    "ELEMENT_FORMATS",
    "FP8_FORMATS",
    "TRANSFORMS",
    "ROUNDINGS",
    "SCALE_MODES",
    "MESSAGE_SCALE_BYTES",
    "GROUP_SIZES",
    "SUPPORTED_INPUT_DTYPES",
    "NAN_CODE",
    "ENCODERS",
    "CodecSettings",
    "describe_settings_bytes",
    "WireFormatError",
    "header_bytes",
    "header_words",
    "check_header",
]

HEADER_BYTES = 16
WIRE_VERSION = 1
MAGIC = b"TACO"


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    """What one element travels as: an FP8 or FP4 float grid, or the integers of INT8 / INT4."""

    name: str
    torch_dtype: Optional[torch.dtype]  # the FP8 dtype whose bit patterns are the codes (None: integer or 4-bit)
    max_value: float
    mantissa_bits: int
    min_normal_exp: int  # exponent of the smallest normal number (floats)
    code_id: int
    bits: int = 8  # 8: one code per byte; 4: two per byte
    integer: bool = False  # INT8 / INT4: round to the integers -M..M


ELEMENT_FORMATS: Dict[str, ElementFormat] = {
    "e4m3": ElementFormat("e4m3", torch.float8_e4m3fn, 448.0, 3, -6, 0),
    "e5m2": ElementFormat("e5m2", torch.float8_e5m2, 57344.0, 2, -14, 1),
    # symmetric INT8: -127..127, a uniform grid (the code -128 is never written): at the same bytes as FP8, 4x
    # less error on TP traffic (codec_error.md), but values far below their group's max round to 0
    "int8": ElementFormat("int8", None, 127.0, 0, 0, 4, integer=True),
    # FP4 E2M1 (the OCP MX / NVFP4 element): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
    "e2m1": ElementFormat("e2m1", None, 6.0, 1, 0, 2, bits=4),
    # symmetric INT4: -7..7 (the code -8 is never written)
    "int4": ElementFormat("int4", None, 7.0, 0, 0, 3, bits=4, integer=True),
}
FP8_FORMATS: Dict[str, ElementFormat] = {k: f for k, f in ELEMENT_FORMATS.items() if f.torch_dtype is not None}
TRANSFORMS = {"ash": 0, "none": 1}
SCALE_MODES = {"dual": (2, 8), "fp32": (1, 4), "e8m0": (3, 1), "e4m3": (4, 1)}  # name: (wire id, bytes per group)
MESSAGE_SCALE_BYTES = {"e4m3": 4}  # scale modes with one fp32 scale per message besides the group scales
GROUP_SIZES = (16, 32, 64, 128, 256)
# nearest: ties to even; stochastic (4-bit formats): up with probability equal to the distance from the code
# below, in grid steps, so the expected decode is the input (for gradient traffic)
ROUNDINGS = {"nearest": 0, "stochastic": 1}
SUPPORTED_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# who wrote a message's codes and scales (header byte 7, high nibble); TE's block quantizer writes the same
# codes as TACO's kernels and a scale within one fp32 ulp (codec/te_cast.py), so decoders accept either
ENCODERS = {"taco": 0, "te": 1}
NAN_CODE = 0x7F  # a NaN bit pattern in both E4M3 (fn) and E5M2 (integer and 4-bit codes: the scale carries NaN)


@dataclasses.dataclass(frozen=True)
class CodecSettings:
    """Validated settings of one codec. ``transform="none"`` is per-group quantization without Hadamard;
    ``fmt`` is the element format (FP8 E4M3 / E5M2, INT8, FP4 E2M1, INT4)."""

    group_size: int = 128
    fmt: str = "e4m3"
    transform: str = "ash"
    scales: str = "fp32"
    eps: float = 1e-6
    rounding: str = "nearest"

    def __post_init__(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {self.group_size!r}")
        if self.fmt not in ELEMENT_FORMATS:
            raise ValueError(f"fmt must be one of {sorted(ELEMENT_FORMATS)}, got {self.fmt!r}")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {sorted(TRANSFORMS)}, got {self.transform!r}")
        if self.scales not in SCALE_MODES:
            raise ValueError(f"scales must be one of {sorted(SCALE_MODES)}, got {self.scales!r}")
        if self.scales == "dual" and self.transform != "ash":
            raise ValueError("scales='dual' stores the adaptive scale of transform='ash'; use 'fp32' or 'e8m0'")
        if self.scales == "e4m3" and self.format.bits != 4:
            raise ValueError(
                f"scales='e4m3' (E4M3 group scales times a message scale) is built for the 4-bit "
                f"formats (e2m1, int4), not {self.fmt}"
            )
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {sorted(ROUNDINGS)}, got {self.rounding!r}")
        if self.rounding == "stochastic" and self.format.bits != 4:
            raise ValueError(f"stochastic rounding is built for the 4-bit formats (e2m1, int4), not {self.fmt}")

    @property
    def format(self) -> ElementFormat:
        return ELEMENT_FORMATS[self.fmt]

    @property
    def code_bytes(self) -> int:
        """Bytes of one group's codes (G for 8-bit formats, G / 2 for 4-bit ones)."""
        return self.group_size * self.format.bits // 8

    @property
    def scale_bytes(self) -> int:
        return SCALE_MODES[self.scales][1]

    def settings_bytes(self) -> bytes:
        """Bytes 4-7 of the header: everything a decoder must agree on."""
        return bytes(
            [
                WIRE_VERSION,
                TRANSFORMS[self.transform] | (self.format.code_id << 4),
                (self.group_size.bit_length() - 1) | (ROUNDINGS[self.rounding] << 4),
                SCALE_MODES[self.scales][0],
            ]
        )

    def describe(self) -> str:
        rounding = " rounding=stochastic" if self.rounding == "stochastic" else ""
        return f"group_size={self.group_size} fmt={self.fmt} transform={self.transform} scales={self.scales}{rounding}"

    def num_groups(self, numel: int) -> int:
        return -(-numel // self.group_size)

    def compressed_nbytes(self, numel: int) -> int:
        groups = self.num_groups(numel)
        return HEADER_BYTES + groups * (self.code_bytes + self.scale_bytes) + MESSAGE_SCALE_BYTES.get(self.scales, 0)

    def layout(self, numel: int) -> Tuple[int, int, int]:
        """(number of groups, byte offset of codes, byte offset of scales) in a message."""
        groups = self.num_groups(numel)
        return groups, HEADER_BYTES, HEADER_BYTES + groups * self.code_bytes


def describe_settings_bytes(raw: bytes) -> str:
    version, packed, group_byte, scale_byte = raw
    scale_id = scale_byte & 0xF
    if version != WIRE_VERSION:
        return f"wire version {version}"
    transform = {v: k for k, v in TRANSFORMS.items()}.get(packed & 0xF, f"?{packed & 0xF}")
    fmt = {f.code_id: f.name for f in ELEMENT_FORMATS.values()}.get(packed >> 4, f"?{packed >> 4}")
    scales = {v[0]: k for k, v in SCALE_MODES.items()}.get(scale_id, f"?{scale_id}")
    rounding = {v: k for k, v in ROUNDINGS.items()}.get(group_byte >> 4, f"?{group_byte >> 4}")
    rounding = "" if rounding == "nearest" else f" rounding={rounding}"
    encoder = {v: k for k, v in ENCODERS.items()}.get(scale_byte >> 4, f"?{scale_byte >> 4}")
    encoder = "" if encoder == "taco" else f" encoder={encoder}"
    return f"group_size={1 << (group_byte & 0xF)} fmt={fmt} transform={transform} scales={scales}{rounding}{encoder}"


class WireFormatError(ValueError):
    """A compressed buffer does not match what the decoder expects."""


def header_bytes(settings: CodecSettings, numel: int, encoder: str = "taco") -> bytes:
    settings_bytes = bytearray(settings.settings_bytes())
    settings_bytes[3] |= ENCODERS[encoder] << 4
    return MAGIC + bytes(settings_bytes) + struct.pack("<Q", numel)


@functools.lru_cache(maxsize=4096)
def header_words(settings: CodecSettings, numel: int) -> Tuple[int, int, int, int]:
    """The header as four little-endian int32 words (what the compress kernel stores)."""
    return struct.unpack("<4i", header_bytes(settings, numel))


def check_header(settings: CodecSettings, buf: torch.Tensor, numel: int) -> None:
    """Raise :class:`WireFormatError` naming both settings when ``buf`` was not made by ``settings``."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise WireFormatError(
            f"a compressed message is a 1-D uint8 tensor, got {buf.dtype} of shape {tuple(buf.shape)}"
        )
    expected = settings.compressed_nbytes(numel)
    if buf.numel() < HEADER_BYTES:
        raise WireFormatError(f"buffer of {buf.numel()} bytes is shorter than the {HEADER_BYTES}-byte header")
    raw = bytes(buf[:HEADER_BYTES].cpu().tolist())
    if raw[:4] != MAGIC:
        raise WireFormatError(f"not a TACO message (magic {raw[:4]!r})")
    if raw[4:7] + bytes([raw[7] & 0xF]) != settings.settings_bytes() or raw[7] >> 4 not in ENCODERS.values():
        raise WireFormatError(
            f"codec settings mismatch: message was compressed with {describe_settings_bytes(raw[4:8])}, "
            f"decoder uses {settings.describe()}"
        )
    (sent_numel,) = struct.unpack("<Q", raw[8:16])
    if sent_numel != numel:
        raise WireFormatError(f"message holds {sent_numel} elements, decoder expects {numel}")
    if buf.numel() != expected:
        raise WireFormatError(f"message is {buf.numel()} bytes, expected {expected} for {numel} elements")
