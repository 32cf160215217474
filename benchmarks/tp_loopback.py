"""TP=2 + SP's linears and their TACO traffic, computed in one process: loss studies of the TACO arms on one GPU.

NCCL refuses two ranks on one GPU and gloo carries CUDA tensors too slowly for a 5-seed study
(``results/logs/loss_compare_gloo_one_gpu_2026-12-02.md``). This runs a TP=1 model whose four linears per layer
(qkv, proj, fc1, fc2) compute what the two ranks of TP=2 + SP compute, message by message:

=====================  ==========================================  ==========================================
linear                 forward                                     backward
=====================  ==========================================  ==========================================
column (qkv, fc1)      all-gather of the 2 sequence shards:        each rank's partial input grad (its output
                       decode(encode(shard r)) in rank order       features' rows of W) reduce-scattered
row (proj, fc2)        each rank's partial output (its input       all-gather of the 2 shards of the
                       features' columns of W) reduce-scattered    output grad
=====================  ==========================================  ==========================================

The messages go through the same codec calls as ``megatron_taco.comm`` (``compress`` of a shard and
``decompress_rows`` of the gathered messages; ``compress_rows`` of a partial's destination chunks and the fp32
decode-sum in rank order), so a compressed arm quantizes exactly what TP=2 quantizes. Uncompressed, the partials
sum in their dtype (one rounding: NCCL's sum of two ranks). Rank r owns the r-th half of the query groups (qkv),
of the FFN features (fc1: of the gate and of the up projection when gated) and of the heads / FFN features that
proj / fc2 read. Each linear's codecs come from ``attach_taco``, so per-layer settings hold. Not simulated:
stochastic rounding (its noise is per rank), messages past ``chunk_bytes`` (the pipelined pieces) and
``--taco-min-bytes auto`` (a link probe): all three refused.
``tests/test_tp_loopback.py``: on CPU the losses equal a real TP=2 + SP run on gloo from the same weights.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from megatron_taco import comm
from megatron_taco.megatron.attach import _LINEAR_PATHS, unwrap
from megatron_taco.megatron.taco_linears import LinearCompression

__all__ = ["simulate_two_ranks"]

RANKS = 2


def _codec(cfg: Optional[LinearCompression], direction: str, message: torch.Tensor):
    """The codec TP=2 uses for ``message`` (a collective's input on one rank), or None (uncompressed): as
    ``comm.compresses`` decides with the linear's fixed ``--taco-min-bytes``."""
    if cfg is None:
        return None
    codec = cfg.codec(direction)
    if codec is not None and getattr(getattr(codec, "settings", None), "rounding", "nearest") != "nearest":
        raise ValueError(f"{cfg.name}: stochastic rounding draws per-rank noise, which the loopback does not simulate")
    if codec is not None and cfg.min_bytes is None:
        raise ValueError(f"{cfg.name}: --taco-min-bytes auto measures a link; the loopback needs a number")
    if codec is not None and message.is_cuda and 0 < cfg.chunk_bytes < message.numel() * message.element_size():
        raise ValueError(f"{cfg.name}: a message past --taco-chunk-bytes goes in pipelined pieces, not simulated")
    return codec if comm.compresses(message, codec, comm.CommOptions(cfg.min_bytes or 0, cfg.chunk_bytes)) else None


def _all_gather(shards: Sequence[torch.Tensor], codec) -> torch.Tensor:
    """What every rank holds after ``comm.all_gather`` of its shard (dim 0), every rank's shard in rank order."""
    if codec is None:
        return torch.cat(list(shards))
    messages = torch.stack([codec.compress(shard.contiguous()) for shard in shards])
    out = torch.empty((sum(s.shape[0] for s in shards), *shards[0].shape[1:]), dtype=shards[0].dtype,
                      device=shards[0].device)  # fmt: skip
    codec.decompress_rows(messages, out.view(len(shards), -1), validate=False)
    return out


def _reduce_scatter(partials: Sequence[torch.Tensor], codec) -> torch.Tensor:
    """The ranks' ``comm.reduce_scatter`` results of their ``partials``, concatenated in rank order (dim 0)."""
    if codec is None:
        return partials[0] + partials[1]  # one rounding to the partials' dtype
    world = len(partials)
    rows = partials[0].shape[0] // world
    # rank r's message to rank j: chunk j of its partial (compress_rows of the [world, chunk] view)
    messages = [codec.compress_rows(p.contiguous().view(world, -1)) for p in partials]
    out = torch.empty_like(partials[0])
    for j in range(world):
        received = torch.stack([m[j] for m in messages])  # what all_to_all_single hands rank j, in rank order
        codec.decompress_rows(received, out[j * rows : (j + 1) * rows].view(1, -1), validate=False)
    return out


class _TwoRankColumn(torch.autograd.Function):
    """Column-parallel linear of TP=2 + SP: y = all_gather(x) W^T + b; dL/dx = reduce_scatter(g_r W_r)."""

    @staticmethod
    def forward(ctx, x, weight, bias, cfg: Optional[LinearCompression], owned: List[torch.Tensor]):
        shards = x.chunk(RANKS)
        gathered = _all_gather(shards, _codec(cfg, "fwd", shards[0]))
        ctx.save_for_backward(gathered, weight)
        ctx.cfg, ctx.owned, ctx.has_bias = cfg, owned, bias is not None
        out = torch.matmul(gathered, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):
        gathered, weight = ctx.saved_tensors
        partials = [torch.matmul(grad[..., rows], weight[rows]) for rows in ctx.owned]
        grad_x = _reduce_scatter(partials, _codec(ctx.cfg, "bwd", partials[0]))
        grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), gathered.reshape(-1, gathered.shape[-1])
        return grad_x, grad_2d.t().matmul(x_2d), grad_2d.sum(0) if ctx.has_bias else None, None, None


class _TwoRankRow(torch.autograd.Function):
    """Row-parallel linear of TP=2 + SP: y = reduce_scatter(x_r W_r^T); dL/dx = all_gather(g) W."""

    @staticmethod
    def forward(ctx, x, weight, cfg: Optional[LinearCompression]):
        partials = [torch.matmul(xr, wr.t()) for xr, wr in zip(x.chunk(RANKS, -1), weight.chunk(RANKS, 1))]
        ctx.save_for_backward(x, weight)
        ctx.cfg = cfg
        return _reduce_scatter(partials, _codec(cfg, "fwd", partials[0]))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        shards = grad.chunk(RANKS)
        gathered = _all_gather(shards, _codec(ctx.cfg, "bwd", shards[0]))
        grad_2d, x_2d = gathered.reshape(-1, gathered.shape[-1]), x.reshape(-1, x.shape[-1])
        return torch.matmul(gathered, weight), grad_2d.t().matmul(x_2d), None


def _owned_rows(features: int, gated: bool, device) -> List[torch.Tensor]:
    """Output features of a column linear that rank r computes: the r-th half, of each of gate and up if gated."""
    index = torch.arange(features, device=device)
    blocks = index.chunk(2) if gated else (index,)
    return [torch.cat([block.chunk(RANKS)[r] for block in blocks]) for r in range(RANKS)]


def simulate_two_ranks(model_chunks) -> int:
    """Give every layer's qkv / proj / fc1 / fc2 of a built TP=1 model (its TACO settings attached, or none) the
    two-rank arithmetic of TP=2 + SP. Returns the number of linears changed."""
    changed = 0
    for chunk in model_chunks:
        gpt = unwrap(chunk)
        gated = bool(gpt.config.gated_linear_unit)
        groups = gpt.config.num_query_groups or gpt.config.num_attention_heads
        if groups % RANKS or gpt.config.ffn_hidden_size % RANKS or gpt.max_sequence_length % RANKS:
            raise ValueError(f"TP={RANKS} needs query groups, FFN size and sequence length divisible by {RANKS}")
        for layer in gpt.decoder.layers:
            for name, (parent, attr) in _LINEAR_PATHS.items():
                linear = getattr(getattr(layer, parent), attr)
                if linear.tp_group is not None and linear.tp_group.size() != 1:
                    raise ValueError("simulate_two_ranks runs on a TP=1 model (it computes both ranks itself)")
                if name in ("qkv", "fc1"):
                    owned = _owned_rows(linear.weight.shape[0], gated and name == "fc1", linear.weight.device)
                    linear._forward_impl = _column_impl(linear, owned)
                else:
                    linear._forward_impl = _row_impl(linear)
                changed += 1
    return changed


def _column_impl(linear, owned):
    """megatron-core's ``_forward_impl`` signature; the linear's TACO settings read at each call."""

    def forward_impl(input, weight, bias, **kwargs):
        return _TwoRankColumn.apply(input, weight, bias, getattr(linear, "taco", None), owned)

    return forward_impl


def _row_impl(linear):
    """As ``_column_impl``; megatron-core adds a row linear's bias after its reduction (never passed here)."""

    def forward_impl(input, weight, bias, **kwargs):
        return _TwoRankRow.apply(input, weight, getattr(linear, "taco", None))

    return forward_impl
