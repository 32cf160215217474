"""TACO on megatron-core's local Column/RowParallelLinear: their TP traffic goes through ``megatron_taco.comm``.

:func:`compress_local_linear` installs on a *built* linear (whatever layer spec, builder or call
pattern produced it): it replaces the instance's ``_forward_impl`` (the matrix multiply that
megatron-core's ``forward`` calls) by one that takes the communication out of it. Then:

=====================  ============================  ===============================
linear                 forward                       backward
=====================  ============================  ===============================
Column, SP             all-gather of the input       reduce-scatter of the input grad
Column, no SP          (identity)                    all-reduce of the input grad
Row, SP                reduce-scatter of the output  all-gather of the output grad
Row, no SP             all-reduce of the output      (identity)
=====================  ============================  ===============================

Each direction is compressed with its own codec, or not (None). The configuration object is
captured in the autograd ``ctx``, so backward uses the settings of the forward that produced it.
The stock ``_forward_impl`` still does the matrix multiply (and weight-gradient accumulation).
The column SP path keeps the gathered input for the weight gradient instead of re-gathering it in
backward (more activation memory, one collective less). With ``None`` attached, or when no message
of the linear reaches ``min_bytes``, the linear runs megatron-core's own code exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron_taco import comm
from megatron_taco.codec import WireCodec
from megatron_taco.comm.policy import auto_options
from megatron_taco.megatron.telemetry import TELEMETRY

__all__ = ["LinearCompression", "compress_local_linear"]

_AUTO_OPTIONS: dict = {}


@dataclasses.dataclass
class LinearCompression:
    """How one linear's traffic is compressed. ``min_bytes=None``: measured per group on first use."""

    name: str
    fwd_codec: Optional[WireCodec]
    bwd_codec: Optional[WireCodec]
    min_bytes: Optional[int]
    chunk_bytes: int

    def __post_init__(self) -> None:
        # built once: options() runs on every collective of the linear
        self._fixed = None if self.min_bytes is None else comm.CommOptions(self.min_bytes, self.chunk_bytes)

    def options(self, group: dist.ProcessGroup, device: torch.device) -> comm.CommOptions:
        if self._fixed is not None:
            return self._fixed
        key = (group, self.chunk_bytes)  # the link probe runs once per process group
        if key not in _AUTO_OPTIONS:
            _AUTO_OPTIONS[key] = auto_options(group, device, chunk_bytes=self.chunk_bytes, report=True)[0]
        return _AUTO_OPTIONS[key]

    def codec(self, direction: str) -> Optional[WireCodec]:
        return self.fwd_codec if direction == "fwd" else self.bwd_codec

    def run(self, collective: Callable, x: torch.Tensor, group: dist.ProcessGroup, direction: str) -> torch.Tensor:
        """``collective`` (a ``megatron_taco.comm`` function) of ``x`` with this linear's codec for ``direction``,
        recorded in the telemetry."""
        codec, options = self.codec(direction), self.options(group, x.device)
        TELEMETRY.record((self.name, collective.__name__, direction), x, codec, comm.compresses(x, codec, options))
        return collective(x, group, codec, options)

    def goes_stock(self, group: dist.ProcessGroup, device: torch.device, messages: dict) -> bool:
        """Whether no message of ``messages`` ({(collective, direction): bytes}) would be compressed. Then
        the linear takes megatron-core's stock path (which overlaps its communication with compute) and
        the messages are recorded as sent uncompressed."""
        min_bytes = self.options(group, device).min_bytes
        if any(
            self.codec(direction) is not None and nbytes >= min_bytes for (_, direction), nbytes in messages.items()
        ):
            return False
        for (collective, direction), nbytes in messages.items():
            TELEMETRY.record_uncompressed((self.name, collective.__name__, direction), nbytes)
        return True


class _TensorParallelComm(torch.autograd.Function):
    """Collective ``forward_kind`` on the way forward, ``backward_kind`` on the gradient (None: identity).

    The four pairs the linears use (``megatron_taco.comm`` functions): (all_gather, reduce_scatter) and
    (reduce_scatter, all_gather) with SP, (None, all_reduce) and (all_reduce, None) without.
    """

    @staticmethod
    def forward(
        ctx, x, group, cfg: LinearCompression, forward_kind: Optional[Callable], backward_kind: Optional[Callable]
    ):
        ctx.group, ctx.cfg, ctx.backward_kind = group, cfg, backward_kind
        if forward_kind is None:
            return x.view_as(x)
        return cfg.run(forward_kind, x, group, "fwd")

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_kind is not None:
            grad = ctx.cfg.run(ctx.backward_kind, grad, ctx.group, "bwd")
        return grad, None, None, None, None


def _column_forward_impl(linear: ColumnParallelLinear, input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    cfg: Optional[LinearCompression] = linear.taco
    sp, allreduce = kwargs.get("sequence_parallel"), kwargs.get("allreduce_dgrad")
    if cfg is None or not (sp or allreduce):
        return linear.stock_forward_impl(input=input, **kwargs)
    nbytes = input.numel() * input.element_size()
    world = dist.get_world_size(linear.tp_group)
    # SP: all-gather of the shard forward, reduce-scatter of the gathered grad backward
    kinds = (comm.all_gather, comm.reduce_scatter) if sp else (None, comm.all_reduce)
    messages = {(kinds[1], "bwd"): nbytes * world if sp else nbytes}
    if sp:
        messages[(kinds[0], "fwd")] = nbytes
    if cfg.goes_stock(linear.tp_group, input.device, messages):
        return linear.stock_forward_impl(input=input, **kwargs)
    input = _TensorParallelComm.apply(input, linear.tp_group, cfg, *kinds)
    kwargs.update(sequence_parallel=False, allreduce_dgrad=False)
    return linear.stock_forward_impl(input=input, **kwargs)


def _row_forward_impl(linear: RowParallelLinear, input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    output = linear.stock_forward_impl(input=input, **kwargs)
    cfg: Optional[LinearCompression] = linear.taco
    # megatron-core's forward reads ``explicit_expert_comm`` after this returns: True makes it skip
    # its own reduction (done here, compressed); the stock value lets it reduce as usual.
    linear.explicit_expert_comm = linear.stock_explicit_expert_comm
    world = dist.get_world_size(linear.tp_group)
    if cfg is None or world == 1:
        return output
    nbytes = output.numel() * output.element_size()
    # SP: reduce-scatter of the full output forward, all-gather of the grad shard backward
    kinds = (comm.reduce_scatter, comm.all_gather) if linear.sequence_parallel else (comm.all_reduce, None)
    messages = {(kinds[0], "fwd"): nbytes}
    if linear.sequence_parallel:
        messages[(kinds[1], "bwd")] = nbytes // world
    if cfg.goes_stock(linear.tp_group, output.device, messages):
        return output
    linear.explicit_expert_comm = True
    return _TensorParallelComm.apply(output, linear.tp_group, cfg, *kinds)


def compress_local_linear(linear: torch.nn.Module, cfg: Optional[LinearCompression]) -> None:
    """Route a built megatron-core Column/RowParallelLinear's TP traffic through TACO (``None``: stock)."""
    if isinstance(linear, RowParallelLinear):
        if cfg is not None and not linear.skip_bias_add:
            raise ValueError(
                f"{cfg.name}: TACO needs skip_bias_add=True on a RowParallelLinear "
                "(the bias is added after the reduction)"
            )
        impl = _row_forward_impl
    elif isinstance(linear, ColumnParallelLinear):
        impl = _column_forward_impl
    else:
        raise TypeError(f"not a megatron-core Column/RowParallelLinear: {type(linear).__name__}")
    # the linear's own value: after a compressed forward its row path has set explicit_expert_comm for itself
    if cfg is not None and getattr(
        linear, "stock_explicit_expert_comm", getattr(linear, "explicit_expert_comm", False)
    ):
        raise ValueError(
            f"{cfg.name}: an expert linear (explicit_expert_comm=True) leaves its tensor-parallel communication to "
            "the MoE token dispatcher; TACO has none of its traffic to compress"
        )
    if not hasattr(linear, "stock_forward_impl"):  # install once; later calls only change the settings
        linear.stock_forward_impl = linear._forward_impl
        linear.stock_explicit_expert_comm = getattr(linear, "explicit_expert_comm", False)
        linear._forward_impl = impl.__get__(linear)
    linear.taco = cfg
