"""The narrow-integer wire (``codec.narrow_int``, ``--mapl-wire int5``): sizes, a float64 reference, the layout's
bytes, tokens of zeros, far-below groups, non-finite tokens and messages that do not decode."""

from __future__ import annotations

import pytest
import torch

from megatron_taco.codec.narrow_int import NarrowIntCodec, narrow_int_rank
from megatron_taco.testing.tensors import near_zero_with_outlier_channels, student_t


def test_the_rank_is_the_largest_multiple_of_16_whose_bytes_fit():
    # 8x / 16x / 32x of d = 512 in bf16: 128 / 64 / 32 bytes per token; the FP8 wire keeps 128 / 64 / 32 values
    assert [narrow_int_rank(2 * 512 / ratio, 5) for ratio in (8, 16, 32)] == [192, 96, 32]
    assert [NarrowIntCodec(r, 5).token_bytes for r in (192, 96, 32)] == [1 + 6 + 120, 1 + 3 + 60, 1 + 1 + 20]
    assert NarrowIntCodec(208, 5).token_bytes > 128  # one more 16 breaks 8x
    assert (narrow_int_rank(128, 6), NarrowIntCodec(160, 6).token_bytes) == (160, 1 + 5 + 120)
    assert narrow_int_rank(11, 5) == 0  # 16 values need 12 bytes
    for bad, match in (((24, 5), "a positive multiple of 16"), ((32, 4), "choose 5 or 6")):
        with pytest.raises(ValueError, match=match):
            NarrowIntCodec(*bad)


def _reference(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 from the format's definition: groups rotated by the orthonormal Hadamard (a matrix), steps max / M
    (at least 2^-126) rounded up to 3 mantissa bits and at least 2^(E - 31), E the token's largest step exponent;
    each value rounded to the nearest multiple of its step (ties to even), rotated back."""
    width = x.shape[-1]
    group = 32 if width % 32 == 0 else 16
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < group:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    hadamard /= group**0.5  # symmetric and orthonormal: its own inverse
    max_code = 2 ** (bits - 1) - 1
    y = x.double().reshape(-1, width // group, group) @ hadamard
    need = torch.clamp(y.abs().amax(-1) / max_code, min=2.0**-126)
    exponent = torch.floor(torch.log2(need))
    step = torch.ceil(need / 2**exponent * 8) / 8 * 2**exponent  # 3 mantissa bits, up
    top = torch.floor(torch.log2(step)).amax(-1, keepdim=True)
    step = torch.maximum(step, 2 ** (top - 31))
    codes = torch.round(y / step[..., None]).clamp(-max_code, max_code)
    return ((codes * step[..., None]) @ hadamard).reshape(x.shape)


@pytest.mark.parametrize("width,bits", [(192, 5), (96, 5), (48, 5), (160, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draw", [student_t, near_zero_with_outlier_channels])
def test_round_trip_is_the_reference_on_realistic_tokens(width, bits, dtype, draw):
    gen = torch.Generator().manual_seed(width + bits)
    x = draw((40, 2, width), gen).to(dtype)
    x[0, 0] = 0  # a token of zeros
    codec = NarrowIntCodec(width, bits)
    x[1, 0, : codec.group] *= 1e-15  # a group more than 31 binades below its token's largest: the floor 2^(E - 31)
    message = codec.compress(x)
    assert message.dtype == torch.uint8 and message.numel() == 80 * codec.token_bytes
    decoded = codec.decompress(message, x.shape, torch.float32)
    reference = _reference(x, bits)
    # fp32 rotations against float64 ones: a relative 1e-6 of the token's size (observed <= 2e-7)
    size = x.double().abs().amax(-1, keepdim=True)
    assert ((decoded.double() - reference).abs() <= 1e-6 * size).all()
    assert torch.equal(decoded[0, 0], torch.zeros(width))
    difference = (decoded.double() - x.double()).flatten()
    error = difference.norm() / x.double().norm()
    bias = difference.mean() / (difference.std() / difference.numel() ** 0.5)  # t-statistic of the signed error
    assert error < (0.06 if bits == 5 else 0.03) and abs(bias) < 4, (error, bias)  # INT5 <= 0.048, INT6 <= 0.023
    assert codec.decompress(message, x.shape, dtype).dtype == dtype


def _hadamard16(v: torch.Tensor) -> torch.Tensor:
    """The orthonormal Hadamard of 16 (entries +-1/4): exact on small dyadic values, so a token built as H y
    rotates back to exactly y."""
    h = torch.ones(1, 1)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return v @ (h / 4)


def _packed(codes, bits: int) -> list:
    """Each 8 codes (offset by 2^(b-1)) as one little-endian word of b bytes, the first code lowest."""
    out = []
    for w in range(0, len(codes), 8):
        word = sum((c + 2 ** (bits - 1)) << (bits * i) for i, c in enumerate(codes[w : w + 8]))
        out += [(word >> (8 * b)) & 0xFF for b in range(bits)]
    return out


def test_the_layout_is_exponent_byte_scale_bytes_and_packed_codes():
    """One token of 48 values (groups of 16), built so that its rotated groups are exact multiples of known steps:
    group 0 steps 2^-2 (15 the largest code), group 1 (1 + 4 / 8) 2^-5, group 2 far below (the floor 2^(-2 - 31)).
    Ties go to the even code (2.5 -> 2, 3.5 -> 4, -2.5 -> -2)."""
    first = [15, -15, 7, -8, 1, 0, 2.5, 3.5, -2.5, 9, -3, 4, 11, -12, 5, 6]
    second = [14, -15, 0, 1, 2, 3, -4, 5, 6, -7, 8, 9, -10, 11, 12, 13]
    y = torch.tensor([[v * 0.25 for v in first] + [v * 1.5 * 2**-5 for v in second] + [1e-15] * 16])
    x = torch.cat([_hadamard16(y[:, 16 * g : 16 * (g + 1)]) for g in range(3)], 1)
    codec = NarrowIntCodec(48, 5)
    message = codec.compress(x)
    codes = [15, -15, 7, -8, 1, 0, 2, 4, -2, 9, -3, 4, 11, -12, 5, 6] + second + [0] * 16
    expected = [-2 + 127, 0, (3 << 3) | 4, (31 << 3) | 0] + _packed(codes, 5)
    assert message.tolist() == expected
    decoded = codec.decompress(message, x.shape)
    steps = [0.25] * 16 + [1.5 * 2**-5] * 16 + [2.0**-33] * 16
    rotated = torch.tensor([[c * s for c, s in zip(codes, steps)]])
    assert torch.equal(decoded, torch.cat([_hadamard16(rotated[:, 16 * g : 16 * (g + 1)]) for g in range(3)], 1))
    tiny = codec.compress(torch.full((1, 48), 1e-40))  # steps at least 2^-126: exponent byte 1, codes 0
    assert tiny[0].item() == 1 and torch.equal(codec.decompress(tiny, (1, 48)), torch.zeros(1, 48))


def test_a_token_with_a_nan_an_inf_or_an_overflowing_rotation_decodes_as_nan_and_others_are_untouched():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=gen)
    x[1, 3], x[2, 60] = float("nan"), float("inf")
    x[3] = 3e38  # finite, but its rotation overflows fp32
    codec = NarrowIntCodec(64, 5)
    message = codec.compress(x)
    decoded = codec.decompress(message, x.shape)
    assert decoded[1:].isnan().all()
    assert torch.equal(decoded[0], codec.decompress(codec.compress(x[0]), (64,)))
    assert message.view(4, -1)[:, 0].tolist() == [message[0].item(), 255, 255, 255]


def test_out_and_bad_messages():
    codec = NarrowIntCodec(32, 5)
    x = torch.randn(3, 32)
    out = torch.empty(3 * codec.token_bytes, dtype=torch.uint8)
    assert codec.compress(x, out=out) is out and torch.equal(out, codec.compress(x))
    with pytest.raises(ValueError, match="out must be uint8 of shape"):
        codec.compress(x, out=torch.empty(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not whole tokens of 32"):
        codec.compress(torch.randn(40))
    with pytest.raises(ValueError, match="a message of 10 bytes for 3 tokens of 22 bytes"):
        codec.decompress(out[:10], (3, 32))
    bad = out.clone()
    bad[2:22] = 0  # code pattern 0 is -16: outside [-15, 15]
    with pytest.raises(ValueError, match=r"a code outside \[-15, 15\]"):
        codec.decompress(bad, (3, 32))
    codec.decompress(bad, (3, 32), validate=False)  # the wire checks only its first message
