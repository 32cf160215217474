"""The narrow-integer wire's Triton kernels (``codec.narrow_int_kernels``) against its torch code
(``NarrowIntCodec``): compress writes the same bytes, decompress the same values, bit for bit.

On CPU they run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest); on a CUDA machine the same tests
run the compiled kernels on the GPU. The torch code runs on the CPU (IEEE division: on a GPU torch divides by a
Python number as a multiply by its reciprocal).
"""

import pytest
import torch

from megatron_taco.codec.narrow_int import NarrowIntCodec
from megatron_taco.codec.narrow_int_kernels import compress_rows, decompress_rows
from megatron_taco.testing.tensors import kernel_device, student_t

DEVICE = kernel_device()
if DEVICE is None:
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 to run Triton kernels", allow_module_level=True)

# group 16 (16, 48: 3 groups), group 32 (96, 192: 6 groups, 288: 9 groups, 512); 768 and 2048: d = 2048's 8x rank
# under --mapl-wire auto and its --mapl-warmup-steps messages (d wide on the INT5 wire)
WIDTHS = (16, 48, 96, 192, 288, 512, 768, 2048)
CASES = [(width, bits) for bits in (5, 6) for width in WIDTHS]


def _ids(case):
    return f"w{case[0]}-b{case[1]}"


def _groups(codec: NarrowIntCodec, scales) -> torch.Tensor:
    """One token of Gaussian groups, group g scaled by scales[g % len(scales)]."""
    gen = torch.Generator().manual_seed(codec.width)
    scale = torch.tensor([scales[g % len(scales)] for g in range(codec.groups)]).repeat_interleave(codec.group)
    return torch.randn(codec.width, generator=gen) * scale


def _tie_token(codec: NarrowIntCodec, sign: float) -> torch.Tensor:
    """A token whose every group's largest value lands on a tie, y / step = +-(M - 1/2): group g is a e_j (j = g
    mod G, its rotation y = +-a G^-0.5 everywhere) with a such that fp32 a * G^-0.5 = (M - 1/2) (1 + k / 8) 2^e,
    whose step is (1 + k / 8) 2^e. ``NarrowIntCodec`` rounds it to even (M - 1), half away from zero to M. The 40
    targets' hits repeat over the groups of wide tokens."""
    inv_sqrt = torch.tensor(codec.group**-0.5, dtype=torch.float32)
    targets = [(codec.max_code - 0.5) * (1 + k / 8) * 2.0**e for e in (-2, 0, 3, -5, 1) for k in range(8)]
    ties = []
    for target in targets:  # a near target / G^-0.5: a few fp32 neighbours, one of which (mostly) hits it
        near = torch.tensor(target / float(inv_sqrt), dtype=torch.float32).view(torch.int32)
        candidates = (near + torch.arange(-4, 5, dtype=torch.int32)).view(torch.float32)
        hits = candidates[candidates * inv_sqrt == target]
        if hits.numel():
            ties.append(sign * hits[0])
    assert len(ties) >= 28, f"{len(ties)} of {len(targets)} targets hit"  # 40 hit at G 16, 35 / 30 at G 32 (5 / 6 bits)
    x = torch.zeros(codec.groups, codec.group)
    for g in range(codec.groups):
        x[g, g % codec.group] = ties[g % len(ties)]
    return x.flatten()


def _tokens(codec: NarrowIntCodec) -> torch.Tensor:
    """fp32 [tokens, width]: Gaussian, heavy-tailed, near-zero, zero, non-finite, overflowing, binade-spanning and
    tie tokens."""
    gen = torch.Generator().manual_seed(codec.width * 10 + codec.bits)
    width = codec.width
    heavy = student_t((2, width), gen, df=2)
    heavy[:, torch.randperm(width, generator=gen)[:3]] *= 1e3  # a few loud columns
    rows = [
        torch.randn(width, generator=gen),
        torch.randn(width, generator=gen) * 1e4,
        *heavy,
        torch.randn(width, generator=gen) * 1e-30,
        torch.randn(width, generator=gen) * 1e-38,  # y partly subnormal, y / 2^-126 near 1
        torch.randn(width, generator=gen) * 1e-40,  # subnormal fp32 (and bf16)
        torch.zeros(width),
        torch.where(torch.arange(width) == 5, float("nan"), torch.randn(width, generator=gen)),
        torch.where(torch.arange(width) == width - 1, float("inf"), torch.randn(width, generator=gen)),
        torch.full((width,), 3e38),  # finite, its rotation overflows
        torch.full((width,), 1e37),  # a sum of 32 is still finite: the largest steps
        _groups(codec, (1e6, 1e-6)),  # groups 40 binades apart: the far ones take the step 2^(E - 31)
        _groups(codec, [2.0 ** (-5 * g) for g in range(codec.groups)]),  # a ladder across the 31-binade edge
        _tie_token(codec, 1.0),
        _tie_token(codec, -1.0),
        torch.randint(-8, 9, (width,), generator=gen).float(),  # integers: ties galore with G = 16
    ]
    return torch.stack(rows)


def _assert_same_bits(got: torch.Tensor, expected: torch.Tensor):
    """Equal bit for bit where the expected value is a number, NaN where it is NaN."""
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan), f"NaN at {torch.isnan(got).nonzero().tolist()}"
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[expected.element_size()]
    differ = (got.view(ints) != expected.view(ints)) & ~nan
    assert not differ.any(), f"{int(differ.sum())} values differ, first at {differ.nonzero()[0].tolist()}"


def _compress(x: torch.Tensor, codec: NarrowIntCodec) -> torch.Tensor:
    """The kernel's message of ``x`` read from rows of a wider tensor, written into the front of a larger buffer
    whose tail must stay untouched."""
    nbytes = x.shape[0] * codec.token_bytes
    buffer = torch.full((nbytes + 64,), 0xA5, dtype=torch.uint8, device=DEVICE)
    wide = torch.cat([x, torch.full((x.shape[0], 16), float("nan"), dtype=x.dtype)], 1).to(DEVICE)
    compress_rows(wide[:, : codec.width], buffer[:nbytes], codec.width, codec.bits)
    assert (buffer[nbytes:] == 0xA5).all(), "wrote past the message"
    return buffer[:nbytes].cpu()


def _decompress(message: torch.Tensor, codec: NarrowIntCodec, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's decode, into rows of a wider tensor whose other columns must stay untouched."""
    tokens = message.numel() // codec.token_bytes
    wide = torch.full((tokens, codec.width + 16), -7.0, dtype=dtype, device=DEVICE)
    decompress_rows(message.to(DEVICE), wide[:, : codec.width], codec.width, codec.bits)
    assert (wide[:, codec.width :] == -7.0).all(), "wrote past a row"
    return wide[:, : codec.width].cpu()


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernels_match_the_torch_codec(case, dtype):
    codec = NarrowIntCodec(*case)
    x = _tokens(codec).to(dtype)
    expected = codec.compress(x)
    got = _compress(x, codec)
    differ = got != expected
    assert not differ.any(), f"{int(differ.sum())} bytes differ, first at {differ.nonzero()[0].item()}"
    for out_dtype in dict.fromkeys((torch.float32, dtype)):  # fp32, and bf16 for bf16 tokens
        decoded = codec.decompress(expected, x.shape, out_dtype, validate=False)
        _assert_same_bits(_decompress(expected, codec, out_dtype), decoded)


@pytest.mark.parametrize("case", [(48, 6), (192, 5)], ids=_ids)
def test_float16_tokens_and_values(case):
    codec = NarrowIntCodec(*case)
    x = _tokens(codec).to(torch.float16)  # 3e38 and 1e37 become Inf, 1e-30 zeros
    expected = codec.compress(x)
    assert torch.equal(_compress(x, codec), expected)
    decoded = codec.decompress(expected, x.shape, torch.float16, validate=False)
    _assert_same_bits(_decompress(expected, codec, torch.float16), decoded)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_the_tokens_hold_the_hard_cases(case):
    """What the tokens above claim to hold, read back from the torch codec's message: NaN rows, the step floor,
    the 2^(E - 31) floor and exact ties."""
    codec = NarrowIntCodec(*case)
    x = _tokens(codec)
    rows = codec.compress(x).view(len(x), codec.token_bytes).long()
    top = rows[:, :1] - 127
    scales = rows[:, 1 : 1 + codec.groups]
    assert rows[8:11, 0].tolist() == [255, 255, 255]  # NaN, Inf, overflowing rotation
    assert rows[11, 0] >= 127 + 120  # steps near the largest fp32
    assert rows[7, 0] == 1 and (scales[7] == 0).all()  # zeros: the step 2^-126
    if codec.groups > 1:
        assert (scales[12, 1::2] >> 3 == 31).all()  # the 1e-6 groups: the floor 2^(E - 31)
    steps = (1 + (scales & 7) / 8) * 2.0 ** (top - (scales >> 3)).double()
    y = codec._rotate(x.view(len(x), codec.groups, codec.group)).double()
    ties = (2 * y / steps[..., None]) % 2 == 1  # y / step = n + 1/2
    assert ties[14:16].flatten(1).all()


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_decompress_matches_on_any_bytes(case):
    """Random rows decode as the torch code decodes them: codes of -M - 1, exponent bytes 0 and 5 (steps below
    2^-126: subnormal, zero), 254 (products overflow to Inf, Inf - Inf in the rotation) and 255 (NaN)."""
    codec = NarrowIntCodec(*case)
    gen = torch.Generator().manual_seed(case[0] + case[1])
    message = torch.randint(0, 256, (6 * codec.token_bytes,), dtype=torch.uint8, generator=gen)
    message[:: codec.token_bytes] = torch.tensor([0, 5, 40, 127, 254, 255], dtype=torch.uint8)
    for out_dtype in (torch.float32, torch.bfloat16):
        decoded = codec.decompress(message, (6, codec.width), out_dtype, validate=False)
        _assert_same_bits(_decompress(message, codec, out_dtype), decoded)


def test_the_codec_takes_the_kernels_with_the_torch_codes_bytes_and_checks(monkeypatch):
    """``NarrowIntCodec(backend="triton")`` (what "auto" is on CUDA tensors): the torch backend's bytes, into ``out``
    when given (checked), its decoded values in the asked dtype (fp64 through fp32), its check of the first message's
    codes; a backend that does not exist is one line."""
    from megatron_taco.codec import narrow_int_kernels

    calls = []
    for name in ("compress_rows", "decompress_rows"):
        kernel = getattr(narrow_int_kernels, name)
        monkeypatch.setattr(narrow_int_kernels, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    codec, torch_codec = NarrowIntCodec(192, 5, backend="triton"), NarrowIntCodec(192, 5, backend="torch")
    x = _tokens(torch_codec)[:7].to(DEVICE).view(7, 1, 192)
    expected = torch_codec.compress(x.cpu())
    decoded = torch_codec.decompress(expected, x.shape)
    assert torch.equal(torch_codec.compress(x), expected.to(DEVICE)) and calls == []  # the torch backend: no kernels
    out = torch.empty(7 * codec.token_bytes, dtype=torch.uint8, device=DEVICE)
    assert codec.compress(x, out=out) is out and torch.equal(out.cpu(), expected)
    assert torch.equal(codec.compress(x).cpu(), expected)
    assert calls == ["compress_rows", "compress_rows"]
    with pytest.raises(ValueError, match="out must be uint8 of shape"):
        codec.compress(x, out=out[1:])
    # strided: a message every other byte of a buffer, tokens read through a transpose
    spaced = torch.zeros(2 * out.numel(), dtype=torch.uint8, device=DEVICE)
    assert torch.equal(codec.compress(x.view(7, 192).t().contiguous().t(), out=spaced[::2]).cpu(), expected)
    assert (spaced[1::2] == 0).all()
    _assert_same_bits(codec.decompress(spaced[::2], x.shape).cpu(), decoded)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        _assert_same_bits(codec.decompress(out, x.shape, dtype).cpu(), torch_codec.decompress(expected, x.shape, dtype))
    out[codec.token_bytes - 5 :][:5] = 0  # the last 8 codes of token 0 at -M - 1: not this format's bytes
    with pytest.raises(ValueError, match=r"a code outside \[-15, 15\]"):
        codec.decompress(out, x.shape)
    codec.decompress(out, x.shape, validate=False)  # later messages go unchecked
    with pytest.raises(ValueError, match="backend 'te'; choose auto, torch or triton"):
        NarrowIntCodec(192, 5, backend="te")
    if DEVICE == "cpu":  # no GPU and no interpreter: one line, not Triton's "0 active drivers"
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="backend 'triton' needs CUDA tensors"):
            codec.compress(x)
