"""MAPL's boundary inside one process: pipeline-boundary quality on one GPU (an exploration tool for leads).

    python -m benchmarks.mapl_loopback --variants 'none;8x;8x+subspace' --seeds 5 --steps 1500 \\
        --parallel 8 --json benchmarks/results/mapl_loopback.json

The model is the PP=2 study's (``mapl_quality.py``: GPT 8 layers, hidden 512, stdlib text; ``--vocab-size 8192``
swaps its 256 bytes for a BPE vocabulary trained on the training split with ``tokenizers``; ``--model gpt-125m``
takes configs/gpt-125m.yaml's 12 layers of 768 instead) built with PP=1; after half the layers (where PP=2 puts
its boundary) the hidden states go through MAPL's own
``BoundaryCodec`` and back: h -> z = (h - a(t)) U (bf16, the wire) -> z U^T + a(t). One codec serves both
ends, so autograd sums the two ends' gradients of U and of the anchors, which is what PP=2 does across its
pair of replicas (``MaplSync.finalize_grads``); U takes the same manifold step, clipped with the other
gradients (``step_projections_with``, which PP=2's ``MaplSync.follow_steps`` uses). A PP=2 run and this one
give the same losses to 5e-8 relative (``tests/test_mapl_loopback.py``, fp32 on CPU), with VQ too.

Variants: ``none`` (stock), ``R x`` (MAPL at ratio R, the shipped defaults: anchor rank 64, position
anchors, anchors from the embedding), ``tables`` (the equal-parameter baseline: the uncompressed model given
the same anchor tables, h + a(t, p) at the boundary, the tables starting at zero as in
``mapl_variants.AnchorsWithoutCompression``), ``+subspace`` (the lead of the MAPL issue: every layer before the
boundary writes its update through U, and the embedding enters as a(t) plus its part in U's span, so h - a(t)
stays in span(U) and the boundary drops nothing; the layers before it work in an r-dimensional stream
beside the anchors), ``+fp8`` / ``+int4`` (the same bytes per token spent on a wider z: rank 2d / R in FP8 or
4d / R in INT4, z and dL/dz through TACO's codec, Hadamard and one power-of-two scale per group of up to 128;
the scale bytes make the real ratio a little lower, and the report names it; ``+fp8`` is ``--mapl-wire fp8``),
``+int4sr`` (``+int4`` with dL/dz stochastically rounded: unbiased), ``+int4fwd`` (INT4 forward, dL/dz in FP8 at
the same rank: twice the backward bytes, a diagnostic of which direction's rounding costs), ``+int6`` / ``+int5``
(z and dL/dz as 6- or 5-bit integers under a 3-mantissa-bit scale byte per group of 32: at no more bytes than
the FP8 wire, rank 160 / 192 instead of 128 at 8x; ``+int5`` is ``--mapl-wire int5``), ``+int4e4m3`` (INT4 under
E4M3 scales per 32 values, TACO's NVFP4-style layout: rank 224 at 8x within the FP8 wire's bytes),
``+topk`` (``--mapl-wire topk``: U square, each token sends its k largest coordinates in FP8 and which they are,
k the most that keeps ratio R; dL/dz returns at the same k),
``+anchorsK`` (anchor rank K), ``+ulrF`` (U's manifold learning rate F, ``--mapl-lr``), ``+uadamF`` (U trained by
Riemannian Adam at learning rate F, ``mapl.stiefel.StiefelAdam``, instead of momentum SGD: a lead of the MAPL issue),
``+fp32`` (the boundary's products with U and B in fp32, as every run before 2026-12-07 computed them; since then
they run in the hidden states' dtype, ``BoundaryCodec``), ``+vqL`` (``--mapl-vq-levels L``: z at r = d / R goes
forward as L one-byte indices into residual codebooks of 255 codes (``mapl.vq.ResidualVQ``, EMA k-means after each
optimizer step, as ``MaplSync.codebook_step`` does it), dL/dz returns r-wide: the forward message is 2d / L times
smaller than h, the backward R times), ``+leakN`` (a warm-up into the bottleneck: for the first N steps the
receiver gets h_rec + alpha (h - h_rec), alpha falling linearly from 1 at the first step to 0 after N steps, so
the model starts uncompressed and U, which gets gradient in proportion to 1 - alpha, and the layers after the
boundary adapt while the dropped part fades; a lead of the MAPL issue: U's warm-up; in bf16, as ``--mapl-warmup-steps``
sent it until 2026-12-07), ``+wleakN`` (the warm-up as ``--mapl-warmup-steps`` sends it on the FP8 / INT5 wire: its
d-wide message, and the message's gradient, through the wire's codec at rank d: with INT5 3.04x fewer bytes than bf16
at d = 512).
Results are resumable (``--json``); the report gives each variant's mean validation
loss and the paired 95% interval of its difference to the first variant over the seeds (with ``+leakN``, beside
the wire's ratio, the run-average one: the warm-up's steps send h whole, with ``+wleakN`` on the wire). ``--report-only`` rewrites the report
from the json and trains nothing; ``--plot PNG`` draws each variant's loss over its run-average ratio.

``--pipeline-parallel 2`` trains ``none`` and ``R x`` as real PP=2 runs instead (two ranks each: megatron-core's
schedule, MAPL's r-wide P2P, ``MaplSync``), the same model, data, seeds and report: the headline form of the
MAPL issue on 2 GPUs, e.g. ``--pipeline-parallel 2 --variants 'none;8x;16x' --seeds 5 --steps 1500
--vocab-size 8192 --parallel 5``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Dict, List, Optional

import torch

from megatron_taco.codec import TacoCodec
from megatron_taco.codec.narrow_int import NarrowIntCodec, narrow_int_rank
from megatron_taco.codec.topk import TopKCodec
from megatron_taco.config.mapl import WIRES, MaplConfig
from megatron_taco.mapl.anchor_init import start_anchors_from_embedding
from megatron_taco.mapl.boundary import BoundaryCodec
from megatron_taco.mapl.stage import boundary_vq, step_projections_with, warmup_alpha
from megatron_taco.mapl.stiefel import StiefelAdam, StiefelMomentumSGD
from megatron_taco.mapl.vq import index_bytes
from megatron_taco.mapl.wire import (
    WireRoundTrip,
    compression_ratio,
    fp8_wire_codec,
    warm_up_wire_codec,
    wire_codec,
)
from megatron_taco.testing.distributed import run_distributed
from megatron_taco.training.data import cache_stdlib_text, stdlib_text_batches
from megatron_taco.training.model import ModelShape

from .loss_compare import _config_shape, paired_interval
from .mapl_cpu_study import MODEL as CPU_MODEL
from .mapl_quality import MODEL
from .provenance import project_commit

# the study's models (--model), each with its boundary after half its layers (PP=2's); the same text and
# tokens per step (4 x 4 sequences of 512): "gpt-125m" is configs/gpt-125m.yaml's layers (12 x 768, 12 heads, FFN
# 3072, tied embeddings), the MAPL issue's confirmation shape; "gpt-cpu" is the CPU study's 4 x 128 (seq 128), for
# exploring leads on CPU
MODELS = {
    "gpt-25m": MODEL,
    "gpt-125m": _config_shape("gpt-125m", seq_length=MODEL.seq_length, vocab_size=256),
    "gpt-cpu": CPU_MODEL,
}


class LoopbackBoundary(torch.nn.Module):
    """A MAPL boundary after decoder layer ``layer`` of a PP=1 GPTModel (a submodule of it, so Megatron's
    optimizer trains the anchors like any parameter); ``subspace``: the layers before it write through U."""

    def __init__(
        self,
        model: torch.nn.Module,
        codec: BoundaryCodec,
        layer: int,
        mode: str,
        wire=None,
        leak_steps: int = 0,
        leak_wire=None,
    ) -> None:
        super().__init__()
        self.codec = codec
        self.mode = mode
        self.wire = wire  # z -> what arrives of z (and of dL/dz backward) after the wire (None: bf16)
        self.leak_steps = leak_steps  # ``+leakN``: the dropped part h - h_rec fades out over these steps
        self.leak_wire = leak_wire  # ``+wleakN``: the warm-up's message -> what arrives of it (None: as it is)
        self.steps = 0  # optimizer steps taken (``_after_step``)
        self._ids = None
        model.add_module("mapl_loopback", self)
        model.register_forward_pre_hook(self._remember_ids)
        model.decoder.layers[layer - 1].register_forward_hook(self._through_boundary)
        if mode == "subspace":
            model.embedding.register_forward_hook(self._embedding_into_span)
            for index in range(layer):
                model.decoder.layers[index].register_forward_hook(self._update_through_span, with_kwargs=True)

    def _remember_ids(self, module, args) -> None:
        tokens, positions = args[0], args[1]  # [b, s]
        self._ids = (tokens.t(), positions.t() if self.codec.positions else None)

    def _in_span(self, x: torch.Tensor) -> torch.Tensor:
        u = self.codec.projection
        return (x.float() @ u) @ u.t()

    def _embedding_into_span(self, module, args, output: torch.Tensor) -> torch.Tensor:
        anchors = self.codec(*self._ids, None)
        return (anchors + self._in_span(output.float() - anchors)).to(output.dtype)

    def _update_through_span(self, module, args, kwargs, output):
        hidden_in = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        hidden_out = output[0] if isinstance(output, tuple) else output
        hidden = (hidden_in.float() + self._in_span(hidden_out.float() - hidden_in.float())).to(hidden_out.dtype)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    def _through_boundary(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        tokens, positions = self._ids
        if self.mode == "tables":  # nothing dropped: h + a(t, p) (``mapl_variants.AnchorsWithoutCompression``)
            hidden = (hidden.float() + self.codec(tokens, positions, None)).to(hidden.dtype)
        else:
            wire = self.codec.project(hidden, tokens, positions)  # in the hidden states' dtype, like the P2P message
            if self.wire is not None:
                wire = self.wire(wire)
            rebuilt = self.codec.reconstruct(wire, tokens, hidden.dtype, positions)
            alpha = warmup_alpha(self.steps, self.leak_steps)
            hidden = rebuilt if alpha == 0.0 else torch.lerp(rebuilt, hidden, alpha)  # as MaplStage's warm-up
            if alpha > 0.0 and self.leak_wire is not None:
                hidden = self.leak_wire(hidden)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


# Bits per value of z for the "+fp8" / "+int4*" variants: TACO's codec on z (forward) and dL/dz (backward), the
# Hadamard transform on, one power-of-two scale byte per group of a token's z. FP8 is --mapl-wire fp8's codec
# (``mapl.wire.fp8_wire_codec``); the INT4 wires exist only here: "int4" rounds both ways to nearest, "int4sr"
# rounds dL/dz stochastically, "int4fwd" sends dL/dz in FP8. "+topk" is --mapl-wire topk (``codec.topk``): U
# square, k FP8 values per token. "+int5" is --mapl-wire int5 (``codec.narrow_int``: 5-bit integers after a
# Hadamard of 32, a scale byte per group, the largest rank, a multiple of 16, within 2d / R bytes); "+int6" the same
# codec at 6 bits (loopback only). "+int4e4m3": INT4 under TACO's E4M3 group
# scales (groups of 32, one fp32 scale per message: the NVFP4-style layout), at the largest rank, a multiple of 32,
# whose bytes stay within the FP8 wire's 2d / R per token.
WIRE_BITS = {"fp8": 8, "int4": 4, "int4sr": 4, "int4fwd": 4, "int4e4m3": 4, "topk": 8, "int6": 6, "int5": 5}


def _int4_codec(rank: int, rounding: str) -> TacoCodec:
    """The INT4 wires' codec of a z (or dL/dz) of ``rank`` values: the Hadamard, one power-of-two scale byte per
    group of up to 128 values."""
    return TacoCodec(min(128, rank), "int4", "ash", "e8m0", rounding=rounding)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A row of the study: ``mode`` "none" (stock), "compress" (MAPL at ``ratio``), "subspace" (MAPL with the
    layers before the boundary writing through U) or "tables" (uncompressed, MAPL's anchor tables added).
    ``wire``: "bf16" (z as the pipeline dtype), or "fp8" / "int4": z and its gradient through TACO's codec at
    the rank that keeps the bytes per token of ratio R (r = 2d / R for FP8, 4d / R for INT4; the scale bytes
    make the real ratio a little lower: ``wire_ratio``); "int6" / "int5": ``NarrowIntCodec`` at the largest rank,
    a multiple of 16, within 2d / R bytes per token. ``anchor_rank``: the anchors' k; ``u_lr``: U's manifold
    learning rate (``--mapl-lr``); ``u_adam_lr``: U by Riemannian Adam at this learning rate; None: the defaults.
    ``fp32_products``: the boundary multiplies by U and B in fp32 (``BoundaryCodec``; every run before 2026-12-07's
    bf16 products). ``vq_levels``: z goes forward as that many residual-VQ indices (``--mapl-vq-levels``; bf16 wire
    rank d / R, dL/dz back r-wide). ``leak_steps``: ``+leakN``'s warm-up into the bottleneck; ``leak_on_wire``
    (``+wleakN``): its d-wide messages through the wire's codec."""

    mode: str
    ratio: float = 1.0
    wire: str = "bf16"
    anchor_rank: Optional[int] = None
    u_lr: Optional[float] = None
    u_adam_lr: Optional[float] = None
    fp32_products: bool = False
    vq_levels: int = 0
    leak_steps: int = 0
    leak_on_wire: bool = False

    def rank(self, hidden_size: int) -> int:
        if self.wire == "topk":  # every coordinate is a candidate: U is square
            return hidden_size
        if self.wire == "int4e4m3":  # r / 2 code bytes and r / 32 scale bytes <= 2d / R
            rank = int(hidden_size * 2 / self.ratio * 32 / 17)
            return rank - rank % 32
        if self.wire == "int5":  # --mapl-wire int5's own rule
            return self.mapl_config(hidden_size).wire_rank(hidden_size)
        if self.wire == "int6":  # the same rule at 6 bits
            return narrow_int_rank(2 * hidden_size / self.ratio, 6)
        return int(hidden_size * 16 / WIRE_BITS.get(self.wire, 16) / self.ratio)

    def wire_codec(self, hidden_size: int):
        """The codec of the z message (None: bf16)."""
        if self.wire == "int6":
            return NarrowIntCodec(self.rank(hidden_size), 6)
        if self.wire == "int4e4m3":
            return TacoCodec(32, "int4", "ash", "e4m3")
        if self.wire.startswith("int4"):
            return _int4_codec(self.rank(hidden_size), "nearest")
        return wire_codec(self.mapl_config(hidden_size), self.rank(hidden_size))

    def grad_codec(self, hidden_size: int):
        """The codec of the dL/dz message: the z message's, but for "int4sr" (stochastic rounding, codec seed 0:
        each compress draws new noise; the same in every run) and "int4fwd" (FP8)."""
        rank = self.rank(hidden_size)
        if self.wire == "int4sr":
            return _int4_codec(rank, "stochastic")
        return fp8_wire_codec(rank) if self.wire == "int4fwd" else self.wire_codec(hidden_size)

    def wire_round_trip(self, hidden_size: int):
        """What z and dL/dz come out as after the wire (a function of z; None: z as it is, bf16)."""
        codec, grad_codec = self.wire_codec(hidden_size), self.grad_codec(hidden_size)
        if self.wire == "topk":  # the receiving stage keeps dL/dz on what arrived, as at PP=2 (``MaplStage``)
            return lambda z: TopKCodec.support_only(WireRoundTrip.apply(z, codec, grad_codec))
        return None if codec is None else (lambda z: WireRoundTrip.apply(z, codec, grad_codec))

    def leak_codec(self, hidden_size: int):
        """The codec of the warm-up's d-wide messages, both directions: ``+wleakN``'s, the FP8 / INT5 wire's at
        rank d, as ``--mapl-warmup-steps`` sends them (None: as they are, ``+leakN``)."""
        return warm_up_wire_codec(self.mapl_config(hidden_size), hidden_size) if self.leak_on_wire else None

    def leak_round_trip(self, hidden_size: int):
        """What the warm-up's d-wide message and its gradient come out as after the wire (a function of the message;
        None: as it is, ``+leakN``)."""
        codec = self.leak_codec(hidden_size)
        return None if codec is None else (lambda message: WireRoundTrip.apply(message, codec, codec))

    def wire_ratio(self, hidden_size: int) -> float:
        """bf16 bytes of h over the wire bytes of z, per token (scales included, the message header not; forward:
        "int4fwd" sends twice these bytes backward, VQ's dL/dz returns r-wide in bf16)."""
        if self.vq_levels:
            return 2 * hidden_size / (self.vq_levels * index_bytes(self.mapl_config(hidden_size).vq_codes))
        return compression_ratio(hidden_size, self.rank(hidden_size), self.wire_codec(hidden_size), 2)

    def run_average_ratio(self, hidden_size: int, steps: int) -> float:
        """bf16 bytes of h over the boundary's bytes summed over a run of ``steps``: the warm-up sends h at ratio W
        (``+leakN``: 1; ``+wleakN``: the wire codec's at rank d, 3.04 for INT5 at d = 512) for its share f = N / steps,
        the wire's ratio R after it: 1 / (f / W + (1 - f) / R)."""
        if self.mode in ("none", "tables"):
            return 1.0
        share = min(self.leak_steps, steps) / steps
        warm = compression_ratio(hidden_size, hidden_size, self.leak_codec(hidden_size), 2)
        return 1 / (share / warm + (1 - share) / self.wire_ratio(hidden_size))

    def mapl_config(self, hidden_size: int) -> MaplConfig:
        """MAPL's settings of this variant (INT4 aside, the loopback's own wire)."""
        given = dict(
            anchor_rank=self.anchor_rank,
            lr=self.u_lr,
            vq_levels=self.vq_levels or None,
            warmup_steps=self.leak_steps or None,
        )
        if self.wire in ("topk", "int5"):  # the flag's ratio sets k (r = d) or r
            given.update(ratio=self.ratio, wire=self.wire)
        else:
            # a --mapl-wire value, or bf16 with the loopback's own wire around it
            given.update(rank=self.rank(hidden_size), wire=self.wire if self.wire in WIRES else "bf16")
        return MaplConfig(**{k: v for k, v in given.items() if v is not None})


def _parse(variant: str) -> Variant:
    """'none', 'tables' (option '+anchorsK'), 'Rx' or 'Rx' with options '+subspace', '+fp8' / '+int4' / '+int4sr' /
    '+int4fwd' / '+int4e4m3' / '+int6' / '+int5' / '+topk',
    '+anchorsK', '+ulrF' (U's learning rate F), '+uadamF' (U by Riemannian Adam at learning rate F), '+fp32'
    (the products with U and B in fp32), '+vqL' (L residual-VQ indices forward), '+leakN' (the warm-up into the
    bottleneck over N steps) or '+wleakN' (its messages on the +fp8 / +int5 wire)."""
    if variant == "none":
        return Variant(variant)
    ratio, *extras = variant.split("+")
    fields = dict(mode="compress")
    if ratio == "tables":  # the uncompressed model with the anchor tables: nothing on a wire
        if any(not e.startswith("anchors") for e in extras):
            raise ValueError(f"variant {variant!r}: tables takes only +anchorsK (it sends nothing compressed)")
        fields, ratio = dict(mode="tables"), "1x"
    for extra in extras:
        if extra == "subspace":
            fields["mode"] = "subspace"
        elif extra in WIRE_BITS and "wire" not in fields:
            fields["wire"] = extra
        elif extra.startswith("anchors") and extra[7:].isdigit():
            fields["anchor_rank"] = int(extra[7:])
        elif extra.startswith("ulr") and _positive_float(extra[3:]):
            fields["u_lr"] = float(extra[3:])
        elif extra.startswith("uadam") and _positive_float(extra[5:]) and "u_lr" not in fields:
            fields["u_adam_lr"] = float(extra[5:])
        elif extra == "fp32":
            fields["fp32_products"] = True
        elif extra.startswith("vq") and extra[2:].isdigit() and int(extra[2:]) > 0:
            fields["vq_levels"] = int(extra[2:])
        elif (
            extra.startswith(("leak", "wleak")) and _positive_int(extra.split("leak")[1]) and "leak_steps" not in fields
        ):
            fields["leak_steps"] = int(extra.split("leak")[1])
            fields["leak_on_wire"] = extra.startswith("w")  # +wleakN: the warm-up's messages on the wire
        else:
            ratio = ""
    if fields.get("leak_on_wire") and fields.get("wire") not in ("fp8", "int5"):
        raise ValueError(f"variant {variant!r}: +wleakN sends the warm-up on the wire: it needs +fp8 or +int5")
    if fields.get("vq_levels") and fields.get("wire", "bf16") != "bf16":
        raise ValueError(f"variant {variant!r}: +vqL sends indices, not z: it takes no wire (+{fields['wire']})")
    if not ratio.endswith("x") or len(extras) != len(set(extras)):
        raise ValueError(
            f"variant {variant!r}: expected none, tables (option +anchorsK), or Rx with options +subspace, +fp8, "
            "+int4, +int4sr, +int4fwd, +int4e4m3, +int6, +int5 or +topk, +anchorsK, +ulrF or +uadamF, +fp32, +vqL, +leakN or +wleakN"
        )
    return Variant(ratio=float(ratio[:-1]), **fields)


def _positive_int(text: str) -> bool:
    return text.isdigit() and int(text) > 0


def _positive_float(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def train_config(shape: ModelShape, seed: int, steps: int, lr: float, warmup: int, micro_batch_size: int = 4,
                 micro_batches: int = 4, clip_grad: float = 1.0):  # fmt: skip
    """The run's TrainConfig at PP=1 (a PP=2 twin: ``dataclasses.replace(cfg, pipeline_parallel=2, mapl=...)``)."""
    from megatron_taco.training.loop import TrainConfig

    return TrainConfig(
        shape,
        micro_batch_size=micro_batch_size,
        num_microbatches=micro_batches,
        dtype="bf16" if torch.cuda.is_available() else "fp32",
        lr=lr,
        lr_warmup_iters=warmup,
        lr_decay_style="cosine",
        lr_decay_iters=steps,
        min_lr=lr / 10,
        clip_grad=clip_grad,
        seed=1234 + seed,
    )


def _loopback_trainer(cfg, variant: Variant):
    """(trainer, codec): a PP=1 Trainer of ``cfg`` with ``variant``'s boundary after half the layers, and that
    boundary's codec (None for ``none``)."""
    from megatron_taco.training import loop
    from megatron_taco.training.loop import Trainer

    shape = cfg.shape
    defaults = variant.mapl_config(shape.hidden_size) if variant.mode != "none" else None
    state = {}
    build = loop.build_gpt_model

    def build_with_boundary(*args, **kwargs):
        # on its device first: megatron-core builds the word embedding there and the positions on the CPU
        model = build(*args, **kwargs).to(loop._device())
        if defaults is not None:
            codec = BoundaryCodec(  # as attach_mapl builds boundary 0 of a PP=2 run
                hidden_size=shape.hidden_size,
                rank=defaults.wire_rank(shape.hidden_size, 0),
                vocab_size=model.vocab_size,
                anchor_rank=defaults.anchor_rank,
                seed=kwargs.get("seed", 0),
                boundary=0,
                positions=model.max_sequence_length if defaults.anchors_positions(shape.position_embedding) else 0,
                fp32_products=variant.fp32_products,
                vq=boundary_vq(defaults, defaults.wire_rank(shape.hidden_size, 0), kwargs.get("seed", 0), 0),
            ).to(loop._device())
            start_anchors_from_embedding([model], [codec])
            if variant.mode == "tables":  # h already holds the embedding: the tables start at zero, a = 0
                with torch.no_grad():
                    codec.anchor_embedding.zero_()
                    if codec.positions:
                        codec.anchor_position.zero_()
            wire = variant.wire_round_trip(shape.hidden_size)
            if codec.vq is not None:  # z_q forward, dL/dz_q as dL/dz back (straight-through), as MaplStage sends them
                wire = functools.partial(codec.quantize, wire_dtype=torch.bfloat16)
            layer = shape.num_layers // 2
            leak_wire = variant.leak_round_trip(shape.hidden_size)
            state["boundary"] = LoopbackBoundary(model, codec, layer, variant.mode, wire, variant.leak_steps, leak_wire)
        return model

    loop.build_gpt_model = build_with_boundary
    try:
        trainer = Trainer(cfg)
    finally:
        loop.build_gpt_model = build
    codec = state["boundary"].codec if state else None
    if codec is not None and variant.mode != "tables":  # U clipped and stepped with the optimizer, as in PP=2
        manifold = (
            StiefelAdam([codec.projection], lr=variant.u_adam_lr)
            if variant.u_adam_lr
            else StiefelMomentumSGD(
                [codec.projection], lr=defaults.lr, momentum=defaults.momentum, buffers=[codec.projection_momentum]
            )
        )
        after_step = _after_step(state["boundary"])
        step_projections_with(trainer.optimizer, manifold, [codec], cfg.lr, after_step=after_step)
    return trainer, codec


def _after_step(boundary: LoopbackBoundary):
    """After each optimizer step: count it (``+leakN``), and with VQ ``MaplSync.codebook_step`` on one rank: the
    sender's EMA update, then the changed rows into the active codebooks (a skipped step drops its statistics)."""
    vq = boundary.codec.vq

    def step(updated: bool) -> None:
        boundary.steps += int(updated)
        if vq is None:
            return
        if not updated:
            vq.clear_step_statistics()
            return
        vq.sync(None, 0, vq.update_targets(()))  # the whole world is this one rank

    return step


def _parameters(trainer) -> int:
    """Distinct trained parameters of the whole model: a replica (``shared``: the tied output embedding on the
    last stage, the receiving stage's anchors) counts once."""
    import torch.distributed as dist

    from megatron_taco.training import loop

    count = sum(p.numel() for m in trainer.models for p in m.parameters() if not getattr(p, "shared", False))
    total = torch.tensor([count], dtype=torch.int64, device=loop._device())
    dist.all_reduce(total)
    return int(total)


def train_loopback(
    cfg, variant: str, steps: int, data_seed: int, eval_iters: int, label: str = "", pipeline_parallel: int = 1
) -> dict:
    """Train ``cfg`` with ``variant``: at PP=1 its boundary after half the layers (the loopback), at
    ``pipeline_parallel`` 2 the real PP=2 run with MAPL at the boundary (two ranks). Returns the training
    losses, the final validation loss and the parameter count."""
    from megatron_taco.training.loop import Trainer

    parsed = _parse(variant)
    shape = cfg.shape
    codec = None  # the loopback's boundary (at PP=2 MAPL's own stages hold it)
    if pipeline_parallel == 1:
        trainer, codec = _loopback_trainer(cfg, parsed)
    else:
        mapl = None
        if parsed.mode == "compress":
            mapl = parsed.mapl_config(shape.hidden_size)
        trainer = Trainer(dataclasses.replace(cfg, pipeline_parallel=pipeline_parallel, mapl=mapl))
    parameters = _parameters(trainer)
    # (a square U spans everything: how far it moved has no subspace measure)
    learned = codec is not None and parsed.mode != "tables" and parsed.rank(shape.hidden_size) < shape.hidden_size
    start = codec.projection.detach().clone() if learned else None
    mbs = cfg.micro_batch_size
    data = stdlib_text_batches("train", shape.vocab_size, shape.seq_length, mbs, seed=data_seed)
    losses, grad_norms = [], []
    began = time.perf_counter()
    for step in range(1, steps + 1):
        result = trainer.train_step(data)
        losses.append(result["loss"])
        grad_norms.append(result["grad_norm"])
        if (step % 250 == 0 or step == steps) and torch.distributed.get_rank() == 0:
            print(f"  {label}: step {step}/{steps}, train loss {losses[-1]:.4f}, "
                  f"{time.perf_counter() - began:.0f} s", flush=True)  # fmt: skip
    seconds = time.perf_counter() - began
    valid = trainer.evaluate(stdlib_text_batches("valid", shape.vocab_size, shape.seq_length, mbs, seed=2), eval_iters)
    trainer.close()
    run = dict(train=losses, valid=valid, parameters=parameters, grad_norms=grad_norms, seconds=seconds)
    if learned:
        run["u_moved"] = subspace_distance(start, codec.projection.detach())
    return run


def subspace_distance(u: torch.Tensor, v: torch.Tensor) -> float:
    """How far span(V) is from span(U) (both d x r, orthonormal columns): sqrt(1 - ||U^T V||_F^2 / r), the RMS
    sine of their principal angles (0: the same subspace, 1: orthogonal)."""
    overlap = torch.linalg.matrix_norm(u.double().T @ v.double()) ** 2 / u.shape[1]
    return float(torch.sqrt(torch.clamp(1 - overlap, min=0)))


def _run(
    variant: str, seed: int, steps: int, lr: float, warmup: int, eval_iters: int, vocab_size: int, pp: int,
    model: str = "gpt-25m",
) -> dict:  # fmt: skip
    """One run of the study on this rank."""
    cfg = train_config(dataclasses.replace(MODELS[model], vocab_size=vocab_size), seed, steps, lr, warmup)
    label = f"{variant} | seed {seed}"
    return train_loopback(cfg, variant, steps, 1 + seed, eval_iters, label=label, pipeline_parallel=pp)


def _dtype(results: dict) -> str:
    """The runs' dtype (``train_config``: bf16 on a GPU, fp32 on CPU), from the hardware the json names."""
    return "fp32" if str(results.get("hardware", "")).startswith("CPU") else "bf16"


def _vocabulary_words(vocab_size: int) -> str:
    if vocab_size == 256:
        return "byte-level vocabulary"
    return f"BPE vocabulary of {vocab_size} tokens (tokenizers, trained on the training split)"


def _invocations(results: dict, variants: List[str]) -> List[str]:
    """Where the json holds runs of several invocations (it is resumed and extended): one line per commit, date and
    hardware naming its runs, as the header's line names only the last invocation's."""
    groups: Dict[str, List[str]] = {}
    for variant in variants:
        for key in sorted(k for k in results["runs"] if k.startswith(f"{variant} | ")):
            run = results["runs"][key]
            where = f"commit {run.get('commit')}, {run.get('date')}, {run.get('hardware', 'hardware not recorded')}"
            groups.setdefault(where, []).append(key)
    if len(groups) < 2:
        return []
    return ["- Runs of more than one invocation:"] + [
        f"  - {where}: {', '.join(keys)}" for where, keys in groups.items()
    ]


def report(args, results: dict) -> List[str]:
    runs = results["runs"]
    variants = args.variants.split(";")
    base = variants[0]
    shape = MODELS[args.model]
    lines = [
        "# MAPL boundary quality in one process (PP=1 loopback)"
        if args.pipeline_parallel == 1
        else "# MAPL boundary quality at PP=2 (two ranks per run)",
        "",
        f"- Command: `python -m benchmarks.mapl_loopback {' '.join(args.argv)}`",
        f"- Commit: {results.get('commit')}; date: {results.get('date')}; hardware: {results.get('hardware')}",
        f"- Model: {args.model}, GPT {shape.num_layers} layers, hidden {shape.hidden_size}, FFN {shape.ffn_hidden_size}, "
        f"seq {shape.seq_length}, {_vocabulary_words(args.vocab_size)}, {_dtype(results)}; MAPL boundary after layer "
        f"{shape.num_layers // 2} (PP=2's); "
        f"{args.steps} steps of 4 x 4 sequences, Adam lr {args.lr} with {args.warmup} warm-up steps and cosine "
        f"decay to {args.lr / 10:g}; Python stdlib text, validation on held-out files ({args.eval_iters} batches).",
        "- Seeds: seed s sets the initialisation (1234 + s) and the data order (1 + s); the same seeds on every "
        "variant, so differences are paired.",
        "- An exploration tool: the headline rows of the MAPL issue need PP=2 on GPUs."
        if args.pipeline_parallel == 1
        else "- Real PP=2: megatron-core's pipeline schedule, MAPL's r-wide P2P and MaplSync across the pair.",
        *_invocations(results, variants),
        "",
        f"| variant | parameters | seeds | validation loss, mean (sd) | vs {base}: mean difference | 95% interval "
        "| U moved from its start |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant in variants:
        seeds = sorted(int(k.split("seed ")[1]) for k in runs if k.startswith(f"{variant} | "))
        if not seeds:
            continue
        valid = [runs[f"{variant} | seed {s}"]["valid"] for s in seeds]
        sd = f"{statistics.stdev(valid):.4f}" if len(valid) > 1 else "-"
        diff = _paired_differences(runs, variant, base, seeds)
        if variant == base or not diff:
            cells = "-", "-"
        else:
            mean, _, low, high = paired_interval(diff)
            cells = f"{mean:+.2f}%", "-" if low != low else f"[{low:+.2f}%, {high:+.2f}%]"
        count = runs[f"{variant} | seed {seeds[0]}"]["parameters"]
        parsed = _parse(variant)
        label = variant
        if parsed.mode != "none" and parsed.mode != "tables":
            width = (
                f"k {parsed.mapl_config(shape.hidden_size).topk_values(shape.hidden_size)} of {shape.hidden_size}"
                if parsed.wire == "topk"
                else f"r {parsed.rank(shape.hidden_size)}"
            )
            backward = ", dL/dz in FP8" if parsed.wire == "int4fwd" else ""  # twice the forward bytes back
            if parsed.vq_levels:  # indices forward, r-wide bf16 back
                backward = f" forward: {parsed.vq_levels} indices; dL/dz r-wide, {parsed.ratio:g}x"
            over_run = (
                f"; {parsed.run_average_ratio(shape.hidden_size, args.steps):.2f}x over the run"
                if parsed.leak_steps
                else ""
            )
            label += f" ({width}, {parsed.wire_ratio(shape.hidden_size):.2f}x{backward}{over_run})"
        moved = [runs[f"{variant} | seed {s}"].get("u_moved") for s in seeds]
        moved_cell = "-" if None in moved else f"{statistics.mean(moved):.3f}"
        lines.append(
            f"| {label} | {count:,} | {len(seeds)} | {statistics.mean(valid):.4f} ({sd}) | {cells[0]} | {cells[1]} "
            f"| {moved_cell} |"
        )
    if any("u_moved" in run for run in runs.values()):
        lines += [
            "",
            "U moved: the RMS sine of the principal angles between U at the end and at the start (0: the "
            "same subspace, 1: orthogonal), mean over seeds; - where the runs did not record it.",
        ]
    return lines


def _paired_differences(runs: dict, variant: str, base: str, seeds) -> List[float]:
    """The validation loss of ``variant`` against ``base``, in %, for each of ``seeds`` that both ran."""
    paired = [s for s in seeds if f"{variant} | seed {s}" in runs and f"{base} | seed {s}" in runs]
    return [100 * (runs[f"{variant} | seed {s}"]["valid"] / runs[f"{base} | seed {s}"]["valid"] - 1) for s in paired]


def plot_bytes_and_loss(path: str, args, results: dict) -> bool:
    """A PNG of each MAPL variant's validation loss against the first variant (mean and 95% interval over the
    paired seeds) over its run-average ratio (log scale): constant ratios and ``+leakN`` warm-ups as two markers,
    the picture of which buys more loss per byte. False when there is nothing to draw."""
    runs, variants = results["runs"], args.variants.split(";")
    hidden, base, points = MODELS[args.model].hidden_size, variants[0], []
    for variant in variants[1:]:
        parsed = _parse(variant)
        diff = _paired_differences(runs, variant, base, range(args.seeds))
        if parsed.mode in ("none", "tables") or len(diff) < 2:
            continue
        mean, _, low, high = paired_interval(diff)
        points.append((variant, parsed.run_average_ratio(hidden, args.steps), mean, low, high, parsed.leak_steps > 0))
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for warm, marker, colour, name in (
        (False, "o", "C0", "the wire's ratio all run"),
        (True, "s", "C3", "+leakN / +wleakN"),
    ):
        chosen = [p for p in points if p[5] == warm]
        if chosen:
            ax.errorbar(
                [p[1] for p in chosen], [p[2] for p in chosen],
                yerr=[[p[2] - p[3] for p in chosen], [p[4] - p[2] for p in chosen]],
                fmt=marker, color=colour, capsize=3, label=name,
            )  # fmt: skip
        for index, (variant, x, mean, *_) in enumerate(chosen):  # labels above and below in turn: fewer overlaps
            ax.annotate(variant, (x, mean), textcoords="offset points", xytext=(5, 4 - 14 * (index % 2)), fontsize=7)
    ax.set_xscale("log")
    times = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}x")
    ax.xaxis.set_major_formatter(times)
    ax.xaxis.set_minor_formatter(times)
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xlabel("run-average ratio: bf16 bytes of h over the boundary's bytes, whole run (log)")
    ax.set_ylabel(f"validation loss vs {base} (%, 95% interval)")
    ax.set_title(f"{args.model}, {args.steps} steps, seeds 0-{args.seeds - 1}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="none;8x;8x+subspace;16x;16x+subspace", help="';'-separated")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--eval-iters", type=int, default=20)
    parser.add_argument(
        "--vocab-size", type=int, default=256, help="256: bytes; more: a BPE vocabulary of this size (tokenizers)"
    )
    parser.add_argument(
        "--pipeline-parallel",
        type=int,
        default=1,
        choices=(1, 2),
        help="1: the loopback (one process per run); 2: real PP=2 runs (two ranks each: 2 GPUs, or gloo on CPU)",
    )
    parser.add_argument(
        "--model",
        default="gpt-25m",
        choices=sorted(MODELS),
        help="gpt-25m: 8 x 512; gpt-125m: 12 x 768 (confirmation); gpt-cpu: 4 x 128 (leads on CPU)",
    )
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (processes on the one GPU)")
    parser.add_argument("--json", required=True, help="results so far (read to resume, rewritten after every run)")
    parser.add_argument(
        "--report-only", action="store_true", help="train nothing: rewrite the report (and --plot) from --json as is"
    )
    parser.add_argument("--plot", help="also draw each variant's loss over its run-average ratio into this PNG")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else __import__("sys").argv[1:]
    for variant in args.variants.split(";"):
        try:
            parsed = _parse(variant)
        except ValueError as exc:
            parser.error(f"--variants: {exc}")
        loopback_only = (
            parsed.mode not in ("none", "compress")
            or parsed.wire not in WIRES
            or parsed.u_adam_lr
            or parsed.fp32_products
            or parsed.leak_steps
        )
        if args.pipeline_parallel == 2 and loopback_only:
            parser.error(
                f"--variants: {variant!r} is a loopback variant; at --pipeline-parallel 2 use none or Rx, with "
                "+fp8, +int5 or +topk (--mapl-wire), +anchorsK or +ulrF"
            )
    if args.warmup >= args.steps:  # one line here, not a traceback from every run
        parser.error(
            f"--warmup {args.warmup} must be below --steps {args.steps} (the cosine decay follows the warm-up)"
        )
    if args.vocab_size < 256 or args.vocab_size > 65536:
        parser.error(f"--vocab-size {args.vocab_size}: expected 256 (bytes) or a BPE size up to 65536")
    setup = {k: getattr(args, k) for k in ("steps", "lr", "warmup", "eval_iters")}
    if args.vocab_size != 256:  # (files of byte-level loopback runs keep their set-up)
        setup["vocab_size"] = args.vocab_size
    if args.pipeline_parallel != 1:
        setup["pipeline_parallel"] = args.pipeline_parallel
    if args.model != "gpt-25m":  # (files of the first model's runs keep their set-up)
        setup["model"] = args.model
    if args.report_only and not os.path.exists(args.json):
        parser.error(f"--report-only: {args.json} does not exist")
    results = {"runs": {}}
    if os.path.exists(args.json):
        with open(args.json) as f:
            results = json.load(f)
        if results.get("setup") != setup:
            raise SystemExit(f"{args.json} holds runs of another set-up ({results.get('setup')}); use another --json")
    report_path = os.path.splitext(args.json)[0] + ".md"
    if args.report_only:  # the json's header (the last invocation's commit, date, hardware) stays
        _write_report(args, results, report_path)
        _plot(args, results)
        return
    on_gpu = torch.cuda.is_available()
    if args.pipeline_parallel == 2 and on_gpu and torch.cuda.device_count() < 2:
        # (PP=2 over gloo with both ranks on one H200 failed in megatron-core's P2P receive, 2026-12-02)
        parser.error(
            f"--pipeline-parallel 2 needs 2 GPUs ({torch.cuda.device_count()} found); the loopback "
            "(--pipeline-parallel 1) computes the same boundary on one"
        )
    results.update(
        setup=setup,
        date=datetime.date.today().isoformat(),
        commit=project_commit(),
        hardware=torch.cuda.get_device_name(0) if on_gpu else f"CPU ({os.cpu_count()} cores)",
    )
    if on_gpu:  # CUDA is initialised here (the GPU's name), so runs start fresh, not forked
        os.environ.setdefault("TACO_TEST_START_METHOD", "spawn")

    def save():
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        _write_report(args, results, report_path)

    if args.vocab_size != 256:  # trained and tokenized once here, read from the cache by every run
        cache_stdlib_text(args.vocab_size)
    todo = [
        (v, s) for s in range(args.seeds) for v in args.variants.split(";") if f"{v} | seed {s}" not in results["runs"]
    ]
    print(f"mapl_loopback: {len(todo)} runs to train", flush=True)
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = {
            pool.submit(
                run_distributed, _run, args.pipeline_parallel, v, s, args.steps, args.lr, args.warmup,
                args.eval_iters, args.vocab_size, args.pipeline_parallel, args.model,
                backend="nccl" if on_gpu else "gloo", timeout=24 * 3600,
            ): (v, s)
            for v, s in todo
        }  # fmt: skip
        for future in as_completed(futures):
            v, s = futures[future]
            try:
                run = future.result()[0]
            except Exception as exc:  # the other runs go on; this one is reported and left to a re-run
                print(f"  {v} | seed {s}: FAILED: {exc}", flush=True)
                continue
            results["runs"][f"{v} | seed {s}"] = dict(
                run, commit=results["commit"], date=results["date"], hardware=results["hardware"]
            )
            print(f"  {v} | seed {s}: final train {run['train'][-1]:.4f} valid {run['valid']:.4f}", flush=True)
            save()
    save()
    _plot(args, results)
    print("\n".join(report(args, results)), flush=True)


def _write_report(args, results: dict, path: str) -> None:
    with open(path, "w") as f:
        f.write("\n".join(report(args, results)) + "\n")


def _plot(args, results: dict) -> None:
    """``--plot``: once, after the runs (the report is rewritten after each)."""
    if args.plot and not plot_bytes_and_loss(args.plot, args, results):
        print(f"mapl_loopback: --plot {args.plot}: no MAPL variant with 2 paired seeds to draw", flush=True)


if __name__ == "__main__":
    main()
