"""One pipeline boundary's MAPL codec: a Stiefel projection U and factorised token anchors.

    sender:    z     = (h - a(t)) U          [s, b, d] -> [s, b, r]
    receiver:  h_hat = z U^T + a(t)          [s, b, r] -> [s, b, d]
    anchors:   a(t)  = E[t] B,  E in R^{V x k},  B in R^{k x d}
               (+ P[p] B for models with learned absolute positions: the receiver knows the
               positions p too, so position information need not take up wire width)
               (+ sum_j C_j[t_{i-j}] B, j = 1..n, with context anchors: the receiver knows the
               whole sequence, so what the residual stream holds about the previous n tokens
               can be added back too; C_j has a row V for "before the start")

Both stages of the boundary hold a replica of this module (same seed, same
initial values). The anchors start here as small seeded noise; by default the
trainer then sets them from the model's input embedding on every rank
(:mod:`megatron_taco.mapl.anchor_init`, ``--mapl-anchor-init``). U is a float32 buffer: it is not seen by the regular
optimizer (no Adam, no weight decay) and is updated by
:class:`~megatron_taco.mapl.stiefel.StiefelMomentumSGD` with the gradient
summed over both replicas. E and B are ordinary parameters (trained by the
regular optimizer) whose gradients are also summed over the pair, so the
replicas stay identical. Because the projection sits inside autograd, the
backward message dL/dz is r-wide too.

With residual VQ (:mod:`megatron_taco.mapl.vq`) the sender also quantizes z and
the wire carries the code indices; the quantizer passes gradients straight
through (dL/dz := dL/dz_q), so the backward message stays r-wide.

In a bf16 model the products with U and B run in bf16 on tensor cores (U and B stay fp32 and are cast for the
product): in fp32 on CUDA cores they made MAPL's boundary step at d = 2048, rank 768 twice as slow
(benchmarks/results/mapl_step_time.md), for rounding far below the wire's and no measured loss. Other dtypes (fp16,
with its loss scaling; fp32) keep fp32 products, as does ``fp32_products=True`` (the benchmarks' comparison).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_taco.mapl.stiefel import random_stiefel
from megatron_taco.mapl.vq import ResidualVQ, pack_indices, unpack_indices

__all__ = ["BoundaryCodec"]


class BoundaryCodec(torch.nn.Module):
    def __init__(
        self,
        hidden_size: int,
        rank: int,
        vocab_size: int,
        anchor_rank: int,
        seed: int,
        boundary: int,
        trainable: bool = True,
        sequence_parallel: bool = False,
        vq: Optional[ResidualVQ] = None,
        positions: int = 0,
        context: int = 0,
        fp32_products: bool = False,
    ) -> None:
        super().__init__()
        self.boundary = boundary
        self.fp32_products = fp32_products
        self.hidden_size, self.rank, self.anchor_rank = hidden_size, rank, anchor_rank
        self.positions = positions if anchor_rank > 0 else 0  # position anchors share the anchors' basis
        self.context = context if anchor_rank > 0 else 0  # so do context anchors
        self.trainable = trainable
        gen = torch.Generator().manual_seed(seed * 7919 + boundary)
        projection = random_stiefel(hidden_size, rank, gen)
        self.register_buffer("projection", projection.requires_grad_(trainable))
        if trainable:  # the manifold optimizer's momentum: a buffer, so checkpoints of the model keep it
            self.register_buffer("projection_momentum", torch.zeros_like(projection, requires_grad=False))
        if anchor_rank > 0:
            self.anchor_embedding = torch.nn.Parameter(torch.randn(vocab_size, anchor_rank, generator=gen) * 0.02)
            self.anchor_basis = torch.nn.Parameter(torch.randn(anchor_rank, hidden_size, generator=gen) * 0.02)
            anchors = [self.anchor_embedding, self.anchor_basis]
            if self.positions:
                self.anchor_position = torch.nn.Parameter(torch.randn(positions, anchor_rank, generator=gen) * 0.02)
                anchors.append(self.anchor_position)
            if self.context:  # zero start: the previous tokens' share is learned (both replicas start equal)
                self.anchor_context = torch.nn.Parameter(torch.zeros(self.context, vocab_size + 1, anchor_rank))
                anchors.append(self.anchor_context)
            for param in anchors:
                # with SP each TP rank sees other tokens: finalize_model_grads all-reduces these over TP
                param.sequence_parallel = sequence_parallel
                param.mapl_anchor = True
        self.vq = vq
        self.wire = None  # the codec of a compressed P2P wire (``mapl.wire.wire_codec``), for the telemetry
        self.warm_up_wire = None  # the codec of the warm-up's d-wide messages (``mapl.wire.warm_up_wire_codec``)

    def _apply(self, fn, recurse: bool = True):
        """Moves apply to U and the codebooks; casts do not (Megatron's Float16Module halves the whole model,
        MAPL state stays fp32). U stays a leaf that collects its gradient (a device move alone would make it
        the output of a copy, whose .grad autograd never fills)."""
        before = dict(self.named_buffers())
        super()._apply(fn, recurse)
        for name, after in list(self.named_buffers()):
            old = before[name]
            kept = old.detach().to(after.device) if after.dtype != old.dtype else after.detach()
            owner = self.get_submodule(name.rpartition(".")[0]) if "." in name else self
            owner._buffers[name.rpartition(".")[2]] = kept.requires_grad_(old.requires_grad)
        return self

    def forward(
        self,
        tokens: torch.Tensor,
        positions: Optional[torch.Tensor],
        previous: Optional[torch.Tensor],
        dtype: torch.dtype = torch.float32,
    ) -> Optional[torch.Tensor]:
        """a for tokens and positions [s, b] and previous tokens [n, s, b] as [s, b, d] in ``dtype`` (None: no
        anchors): the coefficients summed in fp32, their product with B in ``dtype``.

        The anchors are read through the module call, so the hooks of wrappers see it: megatron-core DDP's
        forward pre-hook waits there for the anchors' parameter all-gather (``--overlap-param-gather``)."""
        if self.anchor_rank == 0:
            return None
        coefficients = self.anchor_embedding[tokens].float()
        if self.positions:
            coefficients = coefficients + self.anchor_position[positions].float()
        for j in range(self.context):
            coefficients = coefficients + self.anchor_context[j][previous[j]].float()
        return coefficients.to(dtype) @ self.anchor_basis.to(dtype)

    def _compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the products with U and B for hidden states of ``dtype``: bf16 for bf16, else fp32."""
        return torch.bfloat16 if dtype == torch.bfloat16 and not self.fp32_products else torch.float32

    def project(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        previous: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """[s, b, d] -> [s, b, r] (in the hidden states' dtype)."""
        compute_dtype = self._compute_dtype(hidden.dtype)
        anchors = self(tokens, positions, previous, compute_dtype)
        centred = hidden.to(compute_dtype) if anchors is None else hidden.to(compute_dtype) - anchors
        return (centred @ self.projection.to(compute_dtype)).to(hidden.dtype)

    def quantize(self, z: torch.Tensor, wire_dtype: Optional[torch.dtype]) -> torch.Tensor:
        """Sender with VQ: z_q (value) with z's gradient, its packed indices attached as ``mapl_indices`` for the
        index wire in ``wire_dtype``; ``None`` (``--mapl-warmup-steps``: no indices go on a wire): z_q in fp32,
        exactly as the receiver decodes it, and no indices."""
        indices, quantized = self.vq.encode(z, record=torch.is_grad_enabled() and self.training)
        if wire_dtype is None:
            return quantized + (z.float() - z.float().detach())  # the value z_q exactly, the gradient z's
        output = z + (quantized.to(z.dtype) - z).detach()  # straight-through: dL/dz = dL/dz_q
        output.mapl_indices = pack_indices(indices, self.vq.codes, wire_dtype)
        return output

    def dequantize(self, carrier: torch.Tensor) -> torch.Tensor:
        """Receiver with VQ: z_q (fp32) decoded from the carrier's indices, with the carrier's gradient."""
        indices = unpack_indices(carrier.mapl_indices, self.vq.levels, self.vq.codes)
        return carrier.float() + self.vq.decode(indices)

    def reconstruct(
        self,
        z: torch.Tensor,
        tokens: torch.Tensor,
        dtype: torch.dtype,
        positions: Optional[torch.Tensor] = None,
        previous: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """[s, b, r] -> [s, b, d] in ``dtype``."""
        compute_dtype = self._compute_dtype(dtype)
        hidden = z.to(compute_dtype) @ self.projection.transpose(0, 1).to(compute_dtype)
        anchors = self(tokens, positions, previous, compute_dtype)
        return (hidden if anchors is None else hidden + anchors).to(dtype)
