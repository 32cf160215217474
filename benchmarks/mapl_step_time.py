"""GPU time of MAPL's work at one pipeline boundary per training step, both stages, on one GPU.

    python -m benchmarks.mapl_step_time [--hidden 2048] [--ratios 8] [--micro-batches 4] [--json FILE]

What a PP=2 step of the Megatron-LM rows (``benchmarks/megatron_lm_check.py``: GPT, vocabulary 32000, learned
positions, 4 micro-batches of 4 x 2048 tokens) asks of MAPL, without the model and without the links: for each
micro-batch the sending stage projects its output h (bf16, [2048, 4, d]) to z and encodes it, the receiving stage
decodes z and rebuilds h from it; backward, the receiver's dL/dz is encoded, decoded and carried through the
sender's projection; then each stage takes its step of U (``StiefelMomentumSGD``: the QR retraction, timed apart
too, by Cholesky QR as ``retract_qr`` computes it and by Householder QR as it did before 2026-12-07). The
boundary is built as ``attach_mapl`` builds it (``--mapl-ratio`` R, the default wire and anchors), its parameters
cast to bf16 as Megatron's Float16Module casts them. The pair's gradient sums are left out (collectives; the one
GPU has no pair to talk to). Each phase is timed with CUDA events, median over 10 steps after 3 warm-ups.

``products``: ``bf16`` (the default since this benchmark: ``BoundaryCodec`` multiplies by U and B in the hidden
states' dtype) against ``fp32`` (``fp32_products=True``, every run before it). Answers: how much of the step does
MAPL take, and where?
"""

from __future__ import annotations

import argparse
import statistics
from typing import Dict, List

import torch

from benchmarks.provenance import write_gpu_rows
from megatron_taco.config.mapl import MaplConfig, auto_wire
from megatron_taco.mapl.boundary import BoundaryCodec
from megatron_taco.mapl.stiefel import StiefelMomentumSGD, householder_q, random_stiefel, retract_qr
from megatron_taco.mapl.wire import round_trip, wire_codec

SEQUENCE, MICRO_BATCH_SIZE, VOCAB = 2048, 4, 32000  # megatron_lm_check.py's GPT rows
WARMUPS, TIMINGS = 3, 10
PHASES = ("sender forward", "receiver forward", "receiver backward", "sender backward", "U steps (both)")


def _boundary(cfg: MaplConfig, hidden: int, rank: int, fp32_products: bool) -> BoundaryCodec:
    """Boundary 0 as ``attach_mapl`` builds it on either stage, bf16 as under Float16Module (U stays fp32)."""
    codec = BoundaryCodec(
        hidden_size=hidden,
        rank=rank,
        vocab_size=VOCAB,
        anchor_rank=cfg.anchor_rank,
        seed=0,
        boundary=0,
        positions=SEQUENCE,
        fp32_products=fp32_products,
    )
    return codec.bfloat16().cuda()


def time_step(hidden: int, ratio: float, products: str, micro_batches: int) -> dict:
    """Median GPU milliseconds per phase of one training step's MAPL work at one boundary."""
    wire_name, _ = auto_wire(ratio, 0, hidden, 2, True)  # --mapl-wire auto, as for a bf16 PP=2 run
    cfg = MaplConfig(ratio=ratio, wire=wire_name)
    rank = cfg.wire_rank(hidden)
    wire = wire_codec(cfg, rank)
    sender, receiver = (_boundary(cfg, hidden, rank, products == "fp32") for _ in range(2))
    optimizers = [StiefelMomentumSGD([b.projection], cfg.lr, cfg.momentum) for b in (sender, receiver)]
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, VOCAB, (SEQUENCE, MICRO_BATCH_SIZE), device="cuda", generator=generator)
    positions = torch.arange(SEQUENCE, device="cuda")[:, None].expand(SEQUENCE, MICRO_BATCH_SIZE)
    shape = (SEQUENCE, MICRO_BATCH_SIZE, hidden)
    outputs = [
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(micro_batches)
    ]
    grads = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(micro_batches)]

    def step() -> List[torch.cuda.Event]:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
        events[0].record()
        sent = []
        for h in outputs:
            h = h.detach().requires_grad_()
            z = sender.project(h, tokens, positions)
            sent.append((z, round_trip(wire, z.detach())))
        events[1].record()
        rebuilt = []
        for _, arrived in sent:
            arrived = arrived.requires_grad_()
            rebuilt.append((arrived, receiver.reconstruct(arrived, tokens, torch.bfloat16, positions)))
        events[2].record()
        returned = []
        for (arrived, h_hat), g in zip(rebuilt, grads):
            h_hat.backward(g)
            returned.append(round_trip(wire, arrived.grad))
        events[3].record()
        for (z, _), dz in zip(sent, returned):
            z.backward(dz)
        events[4].record()
        total = sender.projection.grad + receiver.projection.grad  # what the pair's all-reduce leaves on both
        for boundary, optimizer in zip((sender, receiver), optimizers):
            optimizer.step([total])
            boundary.projection.grad = None
            boundary.zero_grad(set_to_none=True)
        events[5].record()
        return events

    for _ in range(WARMUPS):
        step()
    per_phase: Dict[str, List[float]] = {phase: [] for phase in PHASES}
    totals = []
    for _ in range(TIMINGS):
        events = step()
        torch.cuda.synchronize()
        for phase, start, end in zip(PHASES, events, events[1:]):
            per_phase[phase].append(start.elapsed_time(end))
        totals.append(events[0].elapsed_time(events[-1]))
    medians = {phase: round(statistics.median(times), 3) for phase, times in per_phase.items()}
    return {
        "hidden": hidden,
        "ratio": ratio,
        "wire": wire_name,
        "rank": rank,
        "products": products,
        "micro_batches": micro_batches,
        "tokens_per_micro_batch": SEQUENCE * MICRO_BATCH_SIZE,
        **{f"{phase} ms": ms for phase, ms in medians.items()},
        "step ms (both stages)": round(statistics.median(totals), 3),
    }


def _retraction_ms(hidden: int, rank: int) -> Dict[str, float]:
    """Median milliseconds of one retraction of a step's y = U - lr m (d x r), what each stage's U step ends with:
    ``retract_qr`` (Cholesky QR) and Householder QR (``retract_qr`` before 2026-12-07)."""
    u = random_stiefel(hidden, rank, torch.Generator().manual_seed(0)).cuda()
    y = u - 5e-4 * torch.randn(hidden, rank, device="cuda")
    timed = {"Cholesky QR": retract_qr, "Householder QR": lambda y: householder_q(y.double()).float()}
    medians = {}
    for name, retract in timed.items():
        times = []
        for index in range(WARMUPS + TIMINGS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            retract(y)
            end.record()
            torch.cuda.synchronize()
            if index >= WARMUPS:
                times.append(start.elapsed_time(end))
        medians[f"one retraction ms ({name})"] = round(statistics.median(times), 3)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", default="2048", help="hidden sizes d, comma-separated")
    parser.add_argument("--ratios", default="8", help="--mapl-ratio values, comma-separated")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (megatron_lm_check's 4)")
    parser.add_argument("--json", help="write the rows and their provenance here")
    args = parser.parse_args()
    rows = []
    for hidden in map(int, args.hidden.split(",")):
        for ratio in map(float, args.ratios.split(",")):
            for products in ("fp32", "bf16"):
                row = time_step(hidden, ratio, products, args.micro_batches)
                row.update(_retraction_ms(hidden, row["rank"]))
                rows.append(row)
                print(row, flush=True)
    if args.json:
        write_gpu_rows(
            args.json,
            f"python -m benchmarks.mapl_step_time --hidden {args.hidden} --ratios {args.ratios} "
            f"--micro-batches {args.micro_batches}",
            rows,
        )


if __name__ == "__main__":
    main()
