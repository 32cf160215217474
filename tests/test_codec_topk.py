"""The top-k sparse wire (``codec.topk``, ``--mapl-wire topk``): sizes, a float64 reference, the layout's bytes,
non-finite tokens and messages that do not decode."""

from __future__ import annotations

import pytest
import torch

from megatron_taco.codec.topk import TopKCodec, topk_count, topk_token_bytes
from megatron_taco.testing.tensors import near_zero_with_outlier_channels, student_t


def test_k_is_the_most_values_whose_bytes_keep_the_ratio():
    # bitmask (d / 8 bytes) or packed indices (ceil(log2 d) bits each), whichever is shorter
    assert [topk_count(d, r) for d, r in ((128, 8), (512, 8), (512, 16), (768, 8), (128, 32))] == [16, 63, 29, 95, 3]
    assert topk_token_bytes(512, 63) == 1 + 63 + 64  # bitmask
    assert topk_token_bytes(512, 29) == 1 + 29 + 33  # 29 indices of 9 bits
    assert topk_token_bytes(512, 64) > 2 * 512 / 8  # one more value breaks 8x
    assert topk_count(16, 32) == 0  # 1 byte per token holds no value
    with pytest.raises(ValueError, match="needs 0 < k <= width"):
        TopKCodec(16, 0)


def _reference(x: torch.Tensor, k: int) -> torch.Tensor:
    """float64: each token's k largest |x| rounded to E4M3 under 2^ceil(log2(amax / 448)), zeros elsewhere."""
    x = x.double()
    index = x.abs().topk(k, dim=-1).indices
    values = x.gather(-1, index)
    amax = values.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / 448))), torch.ones_like(amax))
    coded = (values / scale).float().to(torch.float8_e4m3fn).double() * scale
    return torch.zeros_like(x).scatter(-1, index, coded)


@pytest.mark.parametrize("width,k", [(128, 16), (512, 63), (512, 29), (64, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draw", [student_t, near_zero_with_outlier_channels])
def test_round_trip_is_the_reference_on_realistic_tokens(width, k, dtype, draw):
    gen = torch.Generator().manual_seed(width + k)
    x = draw((40, 2, width), gen).to(dtype)
    x[0, 0] = 0.0  # a token of zeros: scale 1, zeros out
    x[1, 0, : k + 3] = 1.0  # ties: any k of the equal values, the same decode
    x[2, 0] *= 1e-30  # a tiny token: scale byte far below 127
    codec = TopKCodec(width, k)
    message = codec.compress(x)
    assert message.dtype == torch.uint8 and message.numel() == 80 * topk_token_bytes(width, k)
    decoded = codec.decompress(message, x.shape, torch.float32)
    reference = _reference(x.float(), k)
    assert torch.equal(decoded.double(), reference)
    kept = reference != 0
    error = (decoded.double() - x.double())[kept].norm() / x.double()[kept].norm()
    assert 0.01 < error < 0.04, error  # E4M3 under one scale per token
    bias = ((decoded.double() - x.double())[kept] / x.double()[kept].abs()).mean()
    assert abs(bias) < 5e-3, bias  # round to nearest: no signed drift
    assert (decoded.abs().amax(-1) <= x.float().abs().amax(-1) * 1.0625).all()  # never past the next E4M3 step
    assert codec.decompress(message, x.shape, dtype).dtype == dtype
    out = torch.empty_like(message)
    assert codec.compress(x, out=out) is out and torch.equal(out, message)


def test_the_layout_is_scale_codes_then_positions():
    x = torch.zeros(1, 32)
    x[0, 2], x[0, 9], x[0, 5] = 3.5, -1.5, 0.25  # 3.5 / 448 = 2^-7 exactly: the scale is 2^-7, not 2^-6
    # e = -7: byte 120; codes 3.5 * 2^7 = 448 (E4M3's max), 0.25 * 2^7 = 32, -1.5 * 2^7 = -192, by position
    codes = torch.tensor([448.0, 32.0, -192.0]).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    indexed = TopKCodec(32, 3)  # 3 indices of 5 bits (2 bytes) beat a 32-bit mask (4 bytes)
    assert not indexed.bitmask and indexed.compress(x).tolist() == [120] + codes + [2 | (5 << 5) & 255, 5 >> 3 | 9 << 2]
    masked = TopKCodec(16, 3)  # 12 index bits or a 16-bit mask: 2 bytes either way, the mask
    assert masked.bitmask and masked.compress(x[:, :16]).tolist() == [120] + codes + [(1 << 2) | (1 << 5), 1 << 1]
    assert TopKCodec(512, 63).bitmask and not TopKCodec(512, 29).bitmask


def test_a_non_finite_token_decodes_as_nan_and_the_others_are_unchanged():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=gen)
    clean = TopKCodec(64, 8).decompress(TopKCodec(64, 8).compress(x), x.shape)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[2, 7] = bad
        decoded = TopKCodec(64, 8).decompress(TopKCodec(64, 8).compress(y), y.shape)
        assert decoded[2].isnan().all()
        assert torch.equal(decoded[[0, 1, 3]], clean[[0, 1, 3]])


def test_a_message_that_cannot_be_this_wires_is_refused():
    codec = TopKCodec(64, 8)
    message = codec.compress(torch.randn(3, 64))
    with pytest.raises(ValueError, match="not whole tokens of 64"):
        codec.compress(torch.randn(3, 60))
    with pytest.raises(ValueError, match="a message of"):
        codec.decompress(message[:-1], (3, 64))
    broken = message.clone().view(3, -1)
    broken[1, 1 + 8 :] = 255  # indices 63, 63, ...: not ascending
    with pytest.raises(ValueError, match="not 8 ascending positions below 64"):
        codec.decompress(broken.flatten(), (3, 64))
    masked = TopKCodec(512, 63)
    message = masked.compress(torch.randn(2, 512)).view(2, -1).clone()
    message[0, -1] ^= 0x80  # one position more or less in the mask
    with pytest.raises(ValueError, match="does not mark 63 positions"):
        masked.decompress(message.flatten(), (2, 512))
    with pytest.raises(ValueError, match="out must be uint8"):
        codec.compress(torch.randn(3, 64), out=torch.empty(5, dtype=torch.uint8))


def test_support_only_keeps_the_gradient_where_values_arrived():
    z = torch.tensor([[0.0, 2.0, 0.0, -1.0]], requires_grad=True)
    out = TopKCodec.support_only(z)
    out.backward(torch.tensor([[5.0, 6.0, 7.0, 8.0]]))
    assert torch.equal(out.detach(), z.detach()) and z.grad.tolist() == [[0.0, 6.0, 0.0, 8.0]]
