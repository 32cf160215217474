"""GPU time of MAPL's wire codecs: encode + decode of one boundary message, FP8 against INT5 (one GPU).

    python -m benchmarks.mapl_codec_time [--hidden 512,2048] [--ratios 8,16] [--tokens 8192] [--json FILE]

For each hidden size d and ``--mapl-ratio``, the wire ranks come from ``MaplConfig.wire_rank`` (FP8: r = 2d / R;
INT5: the largest multiple of 16 within the same bytes), z is [tokens, r] bf16 with heavy tails (Student-t, 3
degrees of freedom), and the time is the median of 20 CUDA-event timings of what ``CodecWireCommunicator`` does on
each side (``compress`` into the message, ``decompress`` back to bf16 with the header checked once, as after the
first message), after 5 warm-ups. A bf16 copy of h ([tokens, d]) is timed beside them as the scale of a
memory-bound pass. ``int5-torch`` is the INT5 wire's torch code (``backend="torch"``), the path before its Triton
kernels; the INT5 wire's message is also compared with the torch code's on the CPU (the same bytes, or a bug).
Answers: what does the INT5 wire cost per message against the FP8 wire, and what did its kernels buy?
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.provenance import write_gpu_rows
from megatron_taco.codec.narrow_int import NarrowIntCodec
from megatron_taco.config.mapl import INT5_BITS, MaplConfig
from megatron_taco.mapl.wire import wire_codec

WIRES = ("fp8", "int5", "int5-torch")  # int5-torch: NarrowIntCodec(backend="torch")
WARMUPS, TIMINGS = 5, 20


def _median_ms(fn) -> float:
    """Median milliseconds of ``fn`` on the current stream, after warm-ups."""
    for _ in range(WARMUPS):
        fn()
    times = []
    for _ in range(TIMINGS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_wire(hidden: int, ratio: float, wire: str, tokens: int) -> dict:
    """Encode and decode milliseconds of ``wire`` at ``hidden`` / ``ratio`` for one message of ``tokens``."""
    setting = MaplConfig(ratio=ratio, wire=wire.removesuffix("-torch"))
    rank = setting.wire_rank(hidden)
    codec = NarrowIntCodec(rank, INT5_BITS, backend="torch") if wire == "int5-torch" else wire_codec(setting, rank)
    torch.manual_seed(0)
    z = torch.distributions.StudentT(3.0).sample((tokens, rank)).to("cuda", torch.bfloat16)
    message = torch.empty(codec.compressed_nbytes(z.numel()), dtype=torch.uint8, device="cuda")
    codec.compress(z, out=message)
    # the kernels' bytes against the torch code's on the CPU (IEEE division; tests/test_narrow_int_kernels.py)
    same_as_cpu = (
        torch.equal(message.cpu(), NarrowIntCodec(rank, INT5_BITS).compress(z.cpu())) if wire == "int5" else None
    )
    codec.decompress(message, z.shape, torch.bfloat16, validate=True)  # the first message's check, once
    encode = _median_ms(lambda: codec.compress(z, out=message))
    decode = _median_ms(lambda: codec.decompress(message, z.shape, torch.bfloat16, validate=False))
    h = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    copy = _median_ms(lambda: h.clone())
    return {
        "hidden": hidden,
        "ratio": ratio,
        "wire": wire,
        "rank": rank,
        "tokens": tokens,
        "message_MiB": round(message.numel() / 2**20, 3),
        "encode_ms": round(encode, 3),
        "decode_ms": round(decode, 3),
        "bf16_copy_of_h_ms": round(copy, 3),
        "bytes_equal_cpu_torch": same_as_cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", default="512,2048", help="hidden sizes d, comma-separated")
    parser.add_argument("--ratios", default="8,16", help="--mapl-ratio values, comma-separated")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per message (4 x 2048: e2e's PP=2 model)")
    parser.add_argument("--json", help="write the rows and their provenance here")
    args = parser.parse_args()
    rows = [
        time_wire(int(hidden), float(ratio), wire, args.tokens)
        for hidden in args.hidden.split(",")
        for ratio in args.ratios.split(",")
        for wire in WIRES
    ]
    print(
        "| d | ratio | wire | r | message MiB | encode ms | decode ms | bf16 copy of h ms | bytes = CPU torch code's |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        cells = ("-" if value is None else str(value) for key, value in row.items() if key != "tokens")
        print("| " + " | ".join(cells) + " |", flush=True)
    if args.json:
        write_gpu_rows(
            args.json,
            "python -m benchmarks.mapl_codec_time "
            + " ".join(
                f"--{key} {value}"
                for key, value in (("hidden", args.hidden), ("ratios", args.ratios), ("tokens", args.tokens))
            ),
            rows,
        )


if __name__ == "__main__":
    main()
