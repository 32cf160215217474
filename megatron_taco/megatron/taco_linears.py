"""Column/RowParallelLinear subclasses whose TP traffic goes through ``megatron_taco.comm``.

Placed in the layer spec (:func:`megatron_taco.megatron.specs.transformer_layer_spec`),
they behave exactly like megatron-core's linears until a :class:`LinearCompression`
is attached (``attach.attach_taco``). Then:

=====================  ============================  ===============================
linear                 forward                       backward
=====================  ============================  ===============================
Column, SP             all-gather of the input       reduce-scatter of the input grad
Column, no SP          (identity)                    all-reduce of the input grad
Row, SP                reduce-scatter of the output  all-gather of the output grad
Row, no SP             all-reduce of the output      (identity)
=====================  ============================  ===============================

Each direction is compressed with its own codec, or not (None). The
configuration object is captured in the autograd ``ctx``, so backward uses the
settings of the forward that produced it. The stock ``_forward_impl`` still does
the matrix multiply (and weight-gradient accumulation); the wrappers only take
the communication out of it. The column SP path keeps the gathered input for
the weight gradient instead of re-gathering it in backward (more activation
memory, one collective less).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron_taco import comm
from megatron_taco.codec import TacoCodec
from megatron_taco.comm.policy import auto_options
from megatron_taco.megatron.telemetry import TELEMETRY

_AUTO_OPTIONS: dict = {}


@dataclasses.dataclass
class LinearCompression:
    """How one linear's traffic is compressed. ``min_bytes=None``: measured per group on first use."""

    name: str
    fwd_codec: Optional[TacoCodec]
    bwd_codec: Optional[TacoCodec]
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
            _AUTO_OPTIONS[key] = auto_options(group, device, chunk_bytes=self.chunk_bytes)[0]
        return _AUTO_OPTIONS[key]

    def compresses_any(self, group: dist.ProcessGroup, device: torch.device, fwd_bytes: int, bwd_bytes: int) -> bool:
        """Whether a forward or backward message of these sizes would go compressed. When neither would,
        the linear takes megatron-core's stock path, which overlaps its communication with compute."""
        min_bytes = self.options(group, device).min_bytes
        return (self.fwd_codec is not None and fwd_bytes >= min_bytes) or (
            self.bwd_codec is not None and bwd_bytes >= min_bytes
        )


def _run(kind: str, x: torch.Tensor, group, codec: Optional[TacoCodec], cfg: LinearCompression, direction: str):
    options = cfg.options(group, x.device)
    TELEMETRY.record((cfg.name, kind, direction), x, codec, comm.compresses(x, codec, options))
    return getattr(comm, kind)(x, group, codec, options)


class _TensorParallelComm(torch.autograd.Function):
    """Collective ``forward_kind`` on the way forward, ``backward_kind`` on the gradient (None: identity).

    The four pairs the linears use: (all_gather, reduce_scatter) and (reduce_scatter, all_gather) with SP,
    (None, all_reduce) and (all_reduce, None) without.
    """

    @staticmethod
    def forward(ctx, x, group, cfg: LinearCompression, forward_kind: Optional[str], backward_kind: Optional[str]):
        ctx.group, ctx.cfg, ctx.backward_kind = group, cfg, backward_kind
        if forward_kind is None:
            return x.view_as(x)
        return _run(forward_kind, x, group, cfg.fwd_codec, cfg, "fwd")

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_kind is not None:
            grad = _run(ctx.backward_kind, grad, ctx.group, ctx.cfg.bwd_codec, ctx.cfg, "bwd")
        return grad, None, None, None, None


class TacoColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear whose input gather / input-grad reduction can be compressed."""

    taco: Optional[LinearCompression] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stock_forward_impl = self._forward_impl
        self._forward_impl = self._taco_forward_impl

    def _taco_forward_impl(self, input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        cfg = self.taco
        sp, allreduce = kwargs.get("sequence_parallel"), kwargs.get("allreduce_dgrad")
        if cfg is None or not (sp or allreduce):
            return self._stock_forward_impl(input=input, **kwargs)
        nbytes = input.numel() * input.element_size()
        world = dist.get_world_size(self.tp_group)
        # SP: all-gather of the shard forward, reduce-scatter of the gathered grad backward
        fwd_bytes, bwd_bytes = (nbytes, nbytes * world) if sp else (0, nbytes)
        if not cfg.compresses_any(self.tp_group, input.device, fwd_bytes, bwd_bytes):
            return self._stock_forward_impl(input=input, **kwargs)
        kinds = ("all_gather", "reduce_scatter") if sp else (None, "all_reduce")
        input = _TensorParallelComm.apply(input, self.tp_group, cfg, *kinds)
        kwargs.update(sequence_parallel=False, allreduce_dgrad=False)
        return self._stock_forward_impl(input=input, **kwargs)


class TacoRowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose output reduce-scatter / all-reduce can be compressed."""

    taco: Optional[LinearCompression] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stock_explicit_expert_comm = self.explicit_expert_comm
        self._stock_forward_impl = self._forward_impl
        self._forward_impl = self._taco_forward_impl

    def set_taco(self, cfg: Optional[LinearCompression]) -> None:
        """Attach (or detach with None)."""
        if cfg is not None and not self.skip_bias_add:
            raise ValueError("TacoRowParallelLinear needs skip_bias_add=True (the bias is added after the reduction)")
        self.taco = cfg

    def _taco_forward_impl(self, input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        output = self._stock_forward_impl(input=input, **kwargs)
        cfg = self.taco
        # megatron-core's forward reads ``explicit_expert_comm`` after this returns: True makes it skip
        # its own reduction (done here, compressed); the stock value lets it reduce as usual.
        self.explicit_expert_comm = self._stock_explicit_expert_comm
        if cfg is None or dist.get_world_size(self.tp_group) == 1:
            return output
        nbytes = output.numel() * output.element_size()
        world = dist.get_world_size(self.tp_group)
        # SP: reduce-scatter of the full output forward, all-gather of the grad shard backward
        fwd_bytes, bwd_bytes = (nbytes, nbytes // world) if self.sequence_parallel else (nbytes, 0)
        if not cfg.compresses_any(self.tp_group, output.device, fwd_bytes, bwd_bytes):
            return output
        self.explicit_expert_comm = True
        kinds = ("reduce_scatter", "all_gather") if self.sequence_parallel else ("all_reduce", None)
        return _TensorParallelComm.apply(output, self.tp_group, cfg, *kinds)
