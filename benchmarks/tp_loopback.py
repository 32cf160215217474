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
decode-sum in rank order), so a compressed arm quantizes exactly what TP=2 quantizes; with stochastic rounding each
simulated rank draws its own noise from its own codec, seeded as on TP=2. Uncompressed, the partials
sum in their dtype (one rounding: NCCL's sum of two ranks). The output layer's two vocabulary halves go the same
way, uncompressed (TACO does not compress it). Left as TP=1 computes them: the vocabulary-parallel cross entropy's
fp32 reductions, and the gradients of the parameters SP replicates (norms, row biases), summed over the whole
sequence at once instead of two halves; in fp32 these differ by about 1e-7. Rank r owns the r-th half of the query groups (qkv),
of the FFN features (fc1: of the gate and of the up projection when gated) and of the heads / FFN features that
proj / fc2 read. Each linear's codecs come from ``attach_taco``, so per-layer settings hold. Not simulated: messages
past ``chunk_bytes`` (the pipelined pieces) and ``--taco-min-bytes auto`` (a link probe): both refused.
``tests/test_tp_loopback.py``: on CPU, from the same weights, the first-step gradients are a real TP=2 + SP run's
on gloo to 3e-5 and the losses of 4 steps to 5e-5; in bf16, each linear's partials round as TP=2's do.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron_taco import comm
from megatron_taco.codec.taco import TacoCodec
from megatron_taco.megatron.attach import _LINEAR_PATHS, SEEDS_PER_RANK, unwrap
from megatron_taco.megatron.taco_linears import LinearCompression

__all__ = ["simulate_two_ranks"]

RANKS = 2  # the simulated TP size (the uncompressed reduce-scatter below adds exactly two partials)


def _codecs(cfg: Optional[LinearCompression], direction: str, message: torch.Tensor) -> Optional[list]:
    """The codec each rank of TP=2 uses for ``message`` (a collective's input on one rank), or None (uncompressed):
    as ``comm.compresses`` decides with the linear's fixed ``--taco-min-bytes``. The ranks share one codec, except
    with stochastic rounding: rank r's codec has seed r * SEEDS_PER_RANK + serial (``attach_taco``; this process is
    rank 0), and each rank's count of calls advances once per collective, as on TP=2."""
    if cfg is None:
        return None
    codec = cfg.codec(direction)
    if codec is not None and cfg.min_bytes is None:
        raise ValueError(f"{cfg.name}: --taco-min-bytes auto measures a link; the loopback needs a number")
    if codec is not None and message.is_cuda and 0 < cfg.chunk_bytes < message.numel() * message.element_size():
        raise ValueError(f"{cfg.name}: a message past --taco-chunk-bytes goes in pipelined pieces, not simulated")
    if not comm.compresses(message, codec, cfg.options(None, message.device)):
        return None
    if codec.settings.rounding == "nearest":
        return [codec] * RANKS
    if id(codec) not in _RANK_CODECS:
        _RANK_CODECS[id(codec)] = [codec] + [
            _seeded_like(codec, codec.seed + SEEDS_PER_RANK * r) for r in range(1, RANKS)
        ]
    return _RANK_CODECS[id(codec)]


_RANK_CODECS: dict = {}  # id(rank 0's stochastic codec) -> every rank's (kept for the process, like the codecs)


def _seeded_like(codec: TacoCodec, seed: int) -> TacoCodec:
    """``codec``'s settings and backend with another stochastic-rounding seed (another rank's codec)."""
    s = codec.settings
    return TacoCodec(group_size=s.group_size, fmt=s.fmt, transform=s.transform, scales=s.scales,
                     backend=codec.backend, rounding=s.rounding, seed=seed)  # fmt: skip


def _all_gather(x: torch.Tensor, cfg: Optional[LinearCompression], direction: str) -> torch.Tensor:
    """What every rank holds after ``comm.all_gather`` of its shard of ``x`` (the RANKS shards of dim 0, in rank
    order): ``x`` itself when the message goes uncompressed."""
    shards = x.chunk(RANKS)
    codecs = _codecs(cfg, direction, shards[0])
    if codecs is None:
        return x
    messages = torch.stack([codec.compress(shard.contiguous()) for codec, shard in zip(codecs, shards)])
    out = torch.empty_like(x)
    codecs[0].decompress_rows(messages, out.view(RANKS, -1), validate=False)
    return out


def _reduce_scatter(partials: Sequence[torch.Tensor], cfg: Optional[LinearCompression], direction: str):
    """The ranks' ``comm.reduce_scatter`` results of their ``partials``, concatenated in rank order (dim 0)."""
    codecs = _codecs(cfg, direction, partials[0])
    if codecs is None:
        return partials[0] + partials[1]  # one rounding to the partials' dtype
    world = len(partials)
    rows = partials[0].shape[0] // world
    # rank r's message to rank j: chunk j of its partial (compress_rows of the [world, chunk] view)
    messages = [codec.compress_rows(p.contiguous().view(world, -1)) for codec, p in zip(codecs, partials)]
    out = torch.empty_like(partials[0])
    for j in range(world):
        received = torch.stack([m[j] for m in messages])  # what all_to_all_single hands rank j, in rank order
        codecs[j].decompress_rows(received, out[j * rows : (j + 1) * rows].view(1, -1), validate=False)
    return out


class _TwoRankColumn(torch.autograd.Function):
    """Column-parallel linear of TP=2 + SP: y = all_gather(x) W^T + b; dL/dx = reduce_scatter(g_r W_r)."""

    @staticmethod
    def forward(ctx, x, weight, bias, cfg: Optional[LinearCompression], owned: List[torch.Tensor]):
        gathered = _all_gather(x, cfg, "fwd")
        ctx.save_for_backward(gathered, weight)
        ctx.cfg, ctx.owned, ctx.has_bias = cfg, owned, bias is not None
        out = torch.matmul(gathered, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):
        gathered, weight = ctx.saved_tensors
        partials = [torch.matmul(grad[..., rows], weight[rows]) for rows in ctx.owned]
        grad_x = _reduce_scatter(partials, ctx.cfg, "bwd")
        grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), gathered.reshape(-1, gathered.shape[-1])
        return grad_x, grad_2d.t().matmul(x_2d), grad_2d.sum(0) if ctx.has_bias else None, None, None


class _TwoRankRow(torch.autograd.Function):
    """Row-parallel linear of TP=2 + SP: y = reduce_scatter(x_r W_r^T); dL/dx = all_gather(g) W."""

    @staticmethod
    def forward(ctx, x, weight, cfg: Optional[LinearCompression]):
        partials = [torch.matmul(xr, wr.t()) for xr, wr in zip(x.chunk(RANKS, -1), weight.chunk(RANKS, 1))]
        ctx.save_for_backward(x, weight)
        ctx.cfg = cfg
        return _reduce_scatter(partials, cfg, "fwd")

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gathered = _all_gather(grad, ctx.cfg, "bwd")
        grad_2d, x_2d = gathered.reshape(-1, gathered.shape[-1]), x.reshape(-1, x.shape[-1])
        return torch.matmul(gathered, weight), grad_2d.t().matmul(x_2d), None


def _owned_rows(features: int, gated: bool, device) -> List[torch.Tensor]:
    """Output features of a column linear that rank r computes: the r-th half, of each of gate and up if gated."""
    index = torch.arange(features, device=device)
    blocks = index.chunk(2) if gated else (index,)
    return [torch.cat([block.chunk(RANKS)[r] for block in blocks]) for r in range(RANKS)]


def simulate_two_ranks(model_chunks) -> int:
    """Give every layer's qkv / proj / fc1 / fc2 and the output layer of a built TP=1 model (its TACO settings
    attached, or none) the two-rank arithmetic of TP=2 + SP. Returns the number of linears changed."""
    changed = 0
    for chunk in model_chunks:
        gpt = unwrap(chunk)
        config = gpt.config
        gated = bool(config.gated_linear_unit)
        sizes = dict(num_query_groups=config.num_query_groups or config.num_attention_heads,
                     ffn_hidden_size=config.ffn_hidden_size, seq_length=gpt.max_sequence_length)  # fmt: skip
        if any(size % RANKS for size in sizes.values()):
            raise ValueError(f"TP={RANKS} needs each of {sizes} divisible by {RANKS}")
        if config.hidden_dropout or config.attention_dropout:
            raise ValueError("the loopback needs dropout 0 (TP ranks draw their own dropout masks)")
        linears = [(name, getattr(getattr(layer, parent), attr)) for layer in gpt.decoder.layers
                   for name, (parent, attr) in _LINEAR_PATHS.items()]  # fmt: skip
        if getattr(gpt, "output_layer", None) is not None:
            linears.append(("output", gpt.output_layer))
        for name, linear in linears:
            if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
                raise TypeError(f"{name}: the loopback runs megatron-core's local linears, not {type(linear).__name__}")
            if linear.tp_group is not None and linear.tp_group.size() != 1:
                raise ValueError("simulate_two_ranks runs on a TP=1 model (it computes both ranks itself)")
            if isinstance(linear, ColumnParallelLinear):  # a tied output layer has no weight: the embedding's
                features, device = linear.output_size_per_partition, next(gpt.parameters()).device
                owned = _owned_rows(features, gated and name == "fc1", device)
                linear._forward_impl = _column_impl(linear, owned)
            else:
                linear._forward_impl = _row_impl(linear)
            changed += 1
    return changed


def _check_call(input: torch.Tensor, kwargs: dict) -> None:
    """What the two-rank functions do not reproduce of megatron-core's ``_forward_impl``: refused, not dropped."""
    if input.shape[0] % RANKS:
        raise ValueError(f"sequence length {input.shape[0]} is not divisible by the {RANKS} SP shards")
    if kwargs.get("gradient_accumulation_fusion") or kwargs.get("grad_output_buffer") is not None:
        raise ValueError("the loopback needs gradient_accumulation_fusion off and no deferred weight gradients")


def _column_impl(linear, owned):
    """megatron-core's ``_forward_impl`` signature; the linear's TACO settings read at each call."""

    def forward_impl(input, weight, bias, **kwargs):
        _check_call(input, kwargs)
        return _TwoRankColumn.apply(input, weight, bias, getattr(linear, "taco", None), owned)

    return forward_impl


def _row_impl(linear):
    """As ``_column_impl``; megatron-core adds a row linear's bias after its reduction (never passed here)."""

    def forward_impl(input, weight, bias, **kwargs):
        _check_call(input, kwargs)
        assert bias is None, "megatron-core adds a row linear's bias after the reduction"
        return _TwoRankRow.apply(input, weight, getattr(linear, "taco", None))

    return forward_impl
