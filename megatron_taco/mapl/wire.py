"""Megatron-core's P2P communicator, with VQ indices instead of activations on the forward wire.

With residual VQ the forward message is L indices per token, packed into the
pipeline dtype ([s, b, w], w = L bytes / element size), while the backward message
is still the r-wide gradient dL/dz (the quantizer passes gradients straight through).
Autograd gives a tensor's gradient that tensor's shape, so the two directions cannot
share one tensor; the schedule is not changed, this communicator does the swap:

- send forward: the stage's output z_q carries its packed indices in ``mapl_indices``;
  those are sent instead of z_q (the schedule still holds z_q for the backward pass).
- receive forward: the packed indices arrive; the schedule gets an r-wide zero
  *carrier* (requires grad) holding them in ``mapl_indices``. The receiving stage
  decodes the indices and adds the carrier, so the carrier's gradient is dL/dz_q,
  r wide, and that is what the schedule sends back.

Both sides know both shapes (uniform r, fixed L and K), so the shape exchange of
megatron-core's variable-shape mode is answered locally: no extra messages.
"""

from __future__ import annotations

import copy
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

__all__ = ["IndexWireCommunicator"]


class IndexWireCommunicator(P2PCommunicator):
    def __init__(self, pp_group: dist.ProcessGroup, config, index_width: int) -> None:
        own = copy.copy(config)
        own.variable_seq_lengths = True  # receive buffers take the shapes from _communicate_shapes
        super().__init__(pp_group, own)
        self.index_width = index_width
        self._shape: Optional[Tuple[int, ...]] = None

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        if not (recv_prev or recv_next):
            return None, None
        seq, batch, width = self._shape
        return (seq, batch, self.index_width), (seq, batch, width)

    def _communicate(
        self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, wait_on_reqs=True
    ):
        if tensor_shape is not None:
            self._shape = tuple(tensor_shape)
        if tensor_send_next is not None:
            indices = getattr(tensor_send_next, "mapl_indices", None)
            if indices is None:
                raise RuntimeError(
                    "MAPL VQ: a stage sent an activation without VQ indices; every boundary of this "
                    "pipeline must use VQ (--mapl-vq-levels)"
                )
            tensor_send_next = indices
        received, grad, reqs = super()._communicate(
            tensor_send_next=tensor_send_next,
            tensor_send_prev=tensor_send_prev,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
            wait_on_reqs=wait_on_reqs,
        )
        if received is not None:
            carrier = torch.zeros(self._shape, dtype=received.dtype, device=received.device, requires_grad=True)
            carrier.mapl_indices = received.detach()
            received = carrier
        return received, grad, reqs
