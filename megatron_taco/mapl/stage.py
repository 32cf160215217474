"""MAPL's front door: pipeline stages with MAPL at their boundaries, and the process-group plumbing around them.

One entry point for every way of use (the trainer, the Megatron-LM launcher and the patch):

- :func:`attach_mapl` right after a GPTModel chunk is built: its boundary codecs, attached in place;
- :func:`start_mapl` once all chunks exist, before the optimizer: anchors from the embedding, pair groups,
  settings check; returns the :class:`MaplSync` that runs after the backward and after the optimizer step;
- :func:`schedule_inputs` for every call of megatron-core's pipeline schedule: the models as the schedule
  must see them (r-wide P2P) and, with VQ or the FP8 wire, the communicator that puts it on the wire;
  ``--mapl-warmup-steps`` (:meth:`MaplSync.warm_up` before each call): d-wide messages, h_rec + alpha (h - h_rec),
  for the first N iterations (on the FP8 / INT5 wire: its codec at rank d).

:class:`MaplStage` changes its GPTModel in place: on a stage that receives, the
r-wide tensor handed over by the schedule (``set_input_tensor``) is rebuilt to
d wide before the decoder; on a stage that sends, the decoder output is
projected to r wide. Megatron's schedule sizes its P2P buffers from
``config.hidden_size``; :class:`ScheduleView` shows the schedule a config copy
with ``hidden_size = r``, so the wire carries r-wide tensors forward and
backward while the model keeps its own config.

Token ids: every stage draws the same micro-batches (the data iterator runs on
every stage), so the receiver knows the tokens without communication; the cost
is one [b, s] int64 host-to-device copy per micro-batch per stage (8 bytes per
token against 2*d bytes of bf16 activation per token sent), measured at 42-59 us
for 4 x 2048 tokens on an H200, cheaper than sending them on any link
(benchmarks/results/mapl_token_ids.md).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_taco.codec.topk import TopKCodec
from megatron_taco.config.mapl import MaplConfig, MaplConfigError
from megatron_taco.mapl.anchor_init import start_anchors_from_embedding
from megatron_taco.mapl.boundary import BoundaryCodec
from megatron_taco.mapl.stiefel import StiefelMomentumSGD
from megatron_taco.mapl.telemetry import MAPL_TELEMETRY, SHAPE_MESSAGE_BYTES
from megatron_taco.mapl.vq import ResidualVQ, packed_width
from megatron_taco.mapl.wire import (
    CodecWireCommunicator,
    IndexWireCommunicator,
    WireRoundTrip,
    warm_up_wire_codec,
    wire_codec,
)

__all__ = [
    "CODEC_RANGE",
    "MaplStage",
    "ScheduleView",
    "MaplSync",
    "attach_mapl",
    "boundary_vq",
    "start_mapl",
    "schedule_inputs",
    "step_projections_with",
    "warmup_alpha",
]

# Profiler range around MAPL's own work (projection, anchors, VQ, replica synchronisation): a profile
# attributes the kernels launched inside it, and by the backward of ops recorded inside it, to the codec.
CODEC_RANGE = "mapl_codec"


class MaplStage:
    """One GPTModel chunk with MAPL at its boundaries, attached in place (no wrapper module).

    The codecs become submodules of the model (``mapl_recv_<g>`` / ``mapl_send_<g>`` for boundary g), so
    the model's state dict, Megatron's sharded checkpoints, DDP and the optimizer see the anchors, U and
    the codebooks like any other state; the model's ``forward`` and ``set_input_tensor`` are replaced on
    the instance, so every wrapper Megatron puts around it (Float16Module, DDP) keeps working unchanged.
    """

    def __init__(self, model: torch.nn.Module, recv: Optional[BoundaryCodec], send: Optional[BoundaryCodec]) -> None:
        self.module = model
        self.recv = recv
        self.send = send
        self.config = model.config
        self._received: Optional[torch.Tensor] = None
        # --mapl-warmup-steps: the sender sends h_rec + alpha (h - h_rec) d wide while alpha > 0 (MaplSync.warm_up)
        self.alpha = 0.0
        # bytes megatron-core sends before each tensor (its shape, in variable-shape mode), for the telemetry: after
        # and during the warm-up (d-wide messages need no shapes unless the model config asks for them)
        self.shape_message_bytes = 0
        self.warm_up_shape_message_bytes = 0
        # context anchors: (previous tokens n, the "before the start" row), alike at both boundaries of a stage
        self._context = next(((b.context, b.anchor_embedding.shape[0]) for b in self.boundaries() if b.context), None)
        for side, codec in (("recv", recv), ("send", send)):
            if codec is not None:
                model.add_module(f"mapl_{side}_{codec.boundary}", codec)
        if recv is not None:  # a replica of the sender's anchors (summed over the pair): Megatron's gradient norm
            for param in recv.parameters():  # counts a shared parameter once, as the tied output embedding
                if getattr(param, "mapl_anchor", False):
                    param.shared = True
        self._model_forward = model.forward
        self._model_set_input_tensor = model.set_input_tensor
        model.forward = self.forward
        model.set_input_tensor = self.set_input_tensor

    def set_input_tensor(self, input_tensor: Any) -> None:
        tensor = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor
        if self.recv is None:
            self._model_set_input_tensor(tensor)
        else:
            self._received = tensor

    def _local(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids [..., b, s] in the layout of the boundary tensors: [..., s(/tp with SP), b]."""
        tokens = ids.transpose(-1, -2)
        if self.config.sequence_parallel:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            rank = parallel_state.get_tensor_model_parallel_rank()
            tokens = tokens.chunk(tp, dim=-2)[rank]
        return tokens

    def _previous(self, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """[n, s(/tp), b]: the token j = 1..n places back (the vocabulary size where there is none), for context
        anchors; taken from the whole sequence before the SP split, so shard edges see their predecessors."""
        if not self._context:
            return None
        n, before_start = self._context
        padded = torch.nn.functional.pad(input_ids, (n, 0), value=before_start)
        seq = input_ids.shape[-1]
        return self._local(torch.stack([padded[..., n - j : n - j + seq] for j in range(1, n + 1)]))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: Any, **kwargs: Any):
        tokens = positions = previous = None
        if self.recv is not None or self.send is not None:
            tokens, positions = self._local(input_ids), self._local(position_ids)
            previous = self._previous(input_ids)
        dtype = self.config.pipeline_dtype
        training = torch.is_grad_enabled()  # validation's forward-only passes are not counted as traffic
        if self.recv is not None:
            with torch.profiler.record_function(CODEC_RANGE):
                if self.alpha > 0.0:  # the warm-up's message is the hidden state itself
                    hidden = self._received + self._touch_anchors(tokens, positions, previous)
                else:
                    received = self.recv.dequantize(self._received) if self.recv.vq is not None else self._received
                    if isinstance(self.recv.wire, TopKCodec):  # dL/dz goes back at the k coordinates that arrived
                        received = TopKCodec.support_only(received)
                    hidden = self.recv.reconstruct(received, tokens, dtype or self._received.dtype, positions, previous)
            if training and self._received.requires_grad:
                MAPL_TELEMETRY.watch_backward(
                    self.recv.boundary, self._received, hidden, self._shape_bytes(), self._wire(self.recv)
                )
            self._model_set_input_tensor(hidden)
        output = self._model_forward(input_ids, position_ids, attention_mask, **kwargs)
        if self.send is not None:
            activation = output
            with torch.profiler.record_function(CODEC_RANGE):
                output = self.send.project(output, tokens, positions, previous)
                if self.send.vq is not None:
                    output = self.send.quantize(output, None if self.alpha > 0.0 else dtype or output.dtype)
                if self.alpha > 0.0:
                    output = self._warm_up_message(activation, output, tokens, positions, previous)
            if training:  # with VQ the index wire sends the packed indices in place of the output
                MAPL_TELEMETRY.record_forward(
                    self.send.boundary,
                    getattr(output, "mapl_indices", output),
                    activation,
                    self._shape_bytes(),
                    self._wire(self.send),
                )
        return output

    def _shape_bytes(self) -> int:
        """The bytes megatron-core sends before each message now (its shape)."""
        return self.warm_up_shape_message_bytes if self.alpha > 0.0 else self.shape_message_bytes

    def _wire(self, codec: BoundaryCodec):
        """The codec of ``codec``'s P2P messages now (None: the pipeline dtype)."""
        return codec.warm_up_wire if self.alpha > 0.0 else codec.wire

    def _warm_up_message(
        self,
        activation: torch.Tensor,
        z: torch.Tensor,
        tokens: torch.Tensor,
        positions: Optional[torch.Tensor],
        previous: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """--mapl-warmup-steps: h_rec + alpha (h - h_rec), d wide, where h_rec is what the receiver would rebuild
        of ``z`` after MAPL's wire (the wire's round trip is made here, both directions, with this replica of the
        boundary; with VQ z holds the codebook values in fp32, as the receiver decodes them): alpha 1 sends h, alpha 0
        would be MAPL itself."""
        arrived = z if self.send.wire is None else WireRoundTrip.apply(z, self.send.wire, self.send.wire)
        if isinstance(self.send.wire, TopKCodec):
            arrived = TopKCodec.support_only(arrived)
        rebuilt = self.send.reconstruct(arrived, tokens, activation.dtype, positions, previous)
        return torch.lerp(rebuilt, activation, self.alpha)  # exactly h at alpha 1, h_rec at 0

    def _touch_anchors(
        self, tokens: torch.Tensor, positions: Optional[torch.Tensor], previous: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """A zero that depends on every anchor parameter of the receiving replica (the anchors of no token): the
        warm-up leaves them out of the forward, but megatron-core DDP's hooks must still see them, the parameter
        all-gather's (``--overlap-param-gather``) and the gradient reduction's (``--overlap-grad-reduce`` issues a
        bucket once each of its parameters got a gradient, here a zero one)."""
        none = self.recv(
            tokens[:0],
            None if positions is None else positions[:0],
            None if previous is None else previous[:, :0],
            self._received.dtype,
        )
        return 0.0 if none is None else none.sum()

    def boundaries(self) -> List[BoundaryCodec]:
        return [b for b in (self.recv, self.send) if b is not None]


class ScheduleView(torch.nn.Module):
    """What the pipeline schedule sees: the model, with a config whose hidden_size is the wire width.

    With a different width per boundary, or a model config that sets it (``variable_shapes``), megatron-core's
    P2P exchanges each tensor's shape before the tensor (its ``variable_seq_lengths`` mode): three int64 per message.
    """

    def __init__(self, model: torch.nn.Module, wire_width: int, variable_shapes: bool = False) -> None:
        super().__init__()
        self.module = model
        self.config = copy.copy(model.config)
        self.config.hidden_size = wire_width
        self.config.variable_seq_lengths = variable_shapes

    def forward(self, *args: Any, **kwargs: Any):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)  # finish_grad_sync, no_sync, ... of the wrapped DDP


_PAIR_GROUPS: Dict[tuple, dist.ProcessGroup] = {}


def _pair_groups() -> Dict[int, dist.ProcessGroup]:
    """For each boundary this rank touches, the 2-rank group {stage k, stage k+1} at its (TP, DP) position.

    Every rank creates every group (new_group is collective), in the same order.
    """
    world = dist.get_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    me = dist.get_rank()
    mine: Dict[int, dist.ProcessGroup] = {}
    # pipeline groups: all ranks of one pipeline, in stage order
    pipelines = []
    for rank in range(world):
        # megatron-core's pipeline group of `rank` is not queryable for other ranks; rebuild the
        # pipelines from this rank's own group layout: ranks are spaced by world / pp.
        stride = world // pp
        start = rank % stride
        pipeline = tuple(start + i * stride for i in range(pp))
        if pipeline not in pipelines:
            pipelines.append(pipeline)
    own = tuple(dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()))
    if own not in pipelines:
        raise RuntimeError(f"unexpected pipeline layout {own}; MAPL expects stages spaced by world/PP")
    chunks = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    for boundary in range(pp * chunks - 1):  # boundary g joins pipeline positions g and g + 1
        for pipeline in pipelines:
            ranks = tuple(sorted((pipeline[boundary % pp], pipeline[(boundary + 1) % pp])))
            if ranks not in _PAIR_GROUPS:
                _PAIR_GROUPS[ranks] = dist.new_group(list(ranks))
            if me in ranks:
                mine[boundary] = _PAIR_GROUPS[ranks]
    return mine


class MaplSync:
    """Keeps the two replicas of every boundary identical: summed gradients, identical updates."""

    def __init__(self, stages: List[MaplStage], lr: float, momentum: float, warmup_steps: int = 0) -> None:
        self.stages = stages
        self.warmup_steps = warmup_steps
        self.groups = _pair_groups()
        self.boundaries = [b for stage in stages for b in stage.boundaries()]
        # under SP each TP rank sees other tokens: U's gradient and the VQ statistics are summed over TP
        self.sequence_parallel = (
            parallel_state.get_tensor_model_parallel_world_size() > 1 and stages[0].config.sequence_parallel
        )
        self._check_pairs_agree()
        # {anchor parameter: (start, end) of its flattened elements this rank's distributed optimizer owns}
        self.anchor_shards: Dict[torch.nn.Parameter, Tuple[int, int]] = {}
        self.trainable = [b for b in self.boundaries if b.trainable]
        self.optimizer = (
            StiefelMomentumSGD(
                [b.projection for b in self.trainable],
                lr=lr,
                momentum=momentum,
                buffers=[b.projection_momentum for b in self.trainable],
            )
            if self.trainable
            else None
        )

    def _check_pairs_agree(self) -> None:
        """Both sides of every boundary must use the same settings, or the r-wide P2P would hang.

        Also learns each boundary's sending rank (the source of its codebook updates).
        """
        self.senders: Dict[int, int] = {}
        for boundary in self.boundaries:
            vq = boundary.vq
            sending = any(stage.send is boundary for stage in self.stages)
            mine = torch.tensor(
                [
                    boundary.hidden_size,
                    boundary.rank,
                    boundary.anchor_rank,
                    boundary.positions,
                    boundary.context,
                    int(boundary.trainable),
                    vq.levels if vq else 0,
                    vq.codes if vq else 0,
                    dist.get_rank() if sending else -1,
                ],
                dtype=torch.int64,
                device=boundary.projection.device,
            )
            group = self.groups[boundary.boundary]
            both = [torch.zeros_like(mine) for _ in range(2)]
            dist.all_gather(both, mine, group=group)
            if not torch.equal(both[0][:-1], both[1][:-1]):

                def describe(t: torch.Tensor) -> str:
                    return (
                        f"rank {int(t[1])} of {int(t[0])}, anchor rank {int(t[2])}, "
                        f"position anchors {int(t[3]) or 'off'}, context anchors {int(t[4]) or 'off'}, "
                        f"{'learned' if t[5] else 'fixed'} projection, "
                        f"VQ {f'{int(t[6])} levels x {int(t[7])} codes' if t[6] else 'off'}"
                    )

                ranks = dist.get_process_group_ranks(group)
                raise RuntimeError(
                    f"MAPL settings differ across pipeline boundary {boundary.boundary}: global rank {ranks[0]} "
                    f"uses {describe(both[0])}; global rank {ranks[1]} uses {describe(both[1])}"
                )
            self.senders[boundary.boundary] = int(max(both[0][-1], both[1][-1]))

    @torch.profiler.record_function(CODEC_RANGE)
    def finalize_grads(self, num_tokens: Optional[torch.Tensor] = None) -> None:
        """Sum U and anchor gradients over TP (U only; anchors via SP tagging), DP and the boundary pair.

        Under the distributed optimizer an anchor's gradient is DP-reduced only in this rank's shard of it, and the
        two stages of a boundary shard their anchors differently (their gradient buffers differ): each element is
        first taken from its owner over DP, then summed over the pair, so both replicas take the same update.

        ``num_tokens``: the global batch's token count under Megatron-LM's ``--calculate-per-token-loss`` (the loss
        is a sum; megatron-core divides every other gradient by it): U's gradient is divided by it too, instead of
        being averaged over DP."""
        tp_group = parallel_state.get_tensor_model_parallel_group()
        dp_group = parallel_state.get_data_parallel_group()
        for boundary in self.boundaries:
            pair = self.groups[boundary.boundary]
            if boundary.trainable:
                grad = boundary.projection.grad
                # autograd may leave a transposed (non-contiguous) gradient, and U itself is column-major (QR's):
                # collectives need both replicas' gradients contiguous (gloo sums the memory in order)
                grad = (torch.zeros_like(boundary.projection) if grad is None else grad).contiguous()
                boundary.projection.grad = grad
                if self.sequence_parallel:
                    dist.all_reduce(grad, group=tp_group)
                dist.all_reduce(grad, group=dp_group)
                if num_tokens is None:
                    grad /= parallel_state.get_data_parallel_world_size()  # DP-averaged, like the other gradients
                else:
                    grad /= num_tokens.to(grad.device).clamp(min=1)
                dist.all_reduce(grad, group=pair)
                MAPL_TELEMETRY.record_sync(boundary.boundary, grad)
            for param in (p for p in boundary.parameters() if getattr(p, "mapl_anchor", False)):
                grad = getattr(param, "main_grad", None)
                if grad is None:
                    grad = param.grad
                if grad is None:
                    continue
                if param in self.anchor_shards:  # the distributed optimizer reduced only each rank's own shard
                    start, end = self.anchor_shards[param]
                    owned = torch.zeros_like(grad)
                    owned.view(-1)[start:end] = grad.view(-1)[start:end]
                    dist.all_reduce(owned, group=dp_group)  # every element from its owner: DP-reduced everywhere
                    grad.copy_(owned)
                dist.all_reduce(grad, group=pair)
                MAPL_TELEMETRY.record_sync(boundary.boundary, grad)

    def follow_steps(self, optimizer: Any, base_lr: float) -> None:
        """Tie MAPL to megatron-core's ``optimizer``: U clipped and stepped with it (:func:`step_projections_with`),
        then the codebook step after every step (its rows in ``codebook_rows``)."""
        self.codebook_rows = 0
        sharded = _distributed_optimizers(optimizer)
        self.anchor_shards = _anchor_shards(sharded, self.boundaries)
        for sub in sharded:
            _one_step_count_per_parameter_after_loads(sub)

        def codebooks(updated: bool) -> None:
            self.codebook_rows = self.codebook_step(updated)

        step_projections_with(optimizer, self.optimizer, self.trainable, base_lr, after_step=codebooks)

    def warm_up(self, iteration: int) -> bool:
        """``--mapl-warmup-steps``: every stage's alpha for ``iteration`` (the iterations done, from 0; a resumed
        run passes its own); whether the boundaries still send d wide (:func:`schedule_inputs`' ``warming``). Says
        so once, on global rank 0, when the warm-up ends."""
        alpha = warmup_alpha(iteration, self.warmup_steps)
        if alpha == 0.0 and any(stage.alpha > 0.0 for stage in self.stages) and dist.get_rank() == 0:
            print(
                f"megatron_taco: MAPL warm-up over after {iteration} iterations (--mapl-warmup-steps "
                f"{self.warmup_steps}): z goes on MAPL's wire from now on",
                flush=True,
            )
        for stage in self.stages:
            stage.alpha = alpha
        return alpha > 0.0

    def start_forward_backward(self) -> None:
        """A step's forward-backward begins: U's gradients and the VQ statistics start from zero, as Megatron-LM's
        ``train_step`` zeroes every other gradient before it (its rerun state machine may run one step's
        forward-backward twice; the second run must not add to the first)."""
        for boundary in self.boundaries:
            boundary.projection.grad = None
            if boundary.vq is not None:
                boundary.vq.clear_step_statistics()

    @torch.profiler.record_function(CODEC_RANGE)
    def codebook_step(self, updated: bool = True) -> int:
        """VQ: senders fold this step's statistics into their EMA codebooks; changed rows stream to receivers.
        ``updated=False`` (the optimizer skipped the step, e.g. an fp16 overflow): the statistics are dropped.

        Returns the code words this rank sent or received. Boundaries go in ascending order on every
        rank, so the pair broadcasts of neighbouring boundaries cannot deadlock.
        """
        if not updated:
            for boundary in self.boundaries:
                if boundary.vq is not None:
                    boundary.vq.clear_step_statistics()
            return 0
        reduce_groups = (
            parallel_state.get_data_parallel_group(),
            parallel_state.get_tensor_model_parallel_group() if self.sequence_parallel else None,
        )
        rows = 0
        for boundary in sorted(self.boundaries, key=lambda b: b.boundary):
            if boundary.vq is None:
                continue
            sender = self.senders[boundary.boundary]
            target = boundary.vq.update_targets(reduce_groups) if sender == dist.get_rank() else None
            rows += boundary.vq.sync(self.groups[boundary.boundary], sender, target)
            MAPL_TELEMETRY.record_sync(boundary.boundary, nbytes=boundary.vq.sync_bytes)
        return rows


def _distributed_optimizers(optimizer: Any) -> List[Any]:
    """The megatron-core DistributedOptimizers in ``optimizer`` (itself, or those it chains): they shard state and
    gradients over data-parallel ranks."""
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if hasattr(o, "model_param_gbuf_map")]


def _anchor_shards(sharded: List[Any], boundaries: List[BoundaryCodec]) -> Dict[torch.nn.Parameter, Tuple[int, int]]:
    """Under megatron-core's DistributedOptimizers ``sharded``: each anchor parameter's range of elements this
    data-parallel rank owns ((0, 0): none). Empty for the other optimizers (every rank's gradient is fully
    DP-reduced)."""
    if not sharded:
        return {}
    shards = {}
    for param in (p for b in boundaries for p in b.parameters() if getattr(p, "mapl_anchor", False)):
        shards[param] = (0, 0)
        for sub in sharded:
            if param in sub.model_param_gbuf_map:  # holds the parameters this rank owns a part of
                owned = sub._get_model_param_range_map(param)["param"]
                shards[param] = (owned.start, owned.end)
    return shards


def _one_step_count_per_parameter_after_loads(optimizer: Any) -> None:
    """megatron-core's DistributedOptimizer.load_state_dict, without Apex / TE (torch's Adam), gives every parameter
    the same ``step`` tensor; each step then advances it once per parameter this rank holds, so ranks bias-correct
    with other counts. Owners of the two replicas of an anchor element sit on different ranks, whose tables then
    drift apart: after every load each parameter gets its own copy again."""
    load = optimizer.load_state_dict

    @functools.wraps(load)
    def load_state_dict(*args, **kwargs):
        result = load(*args, **kwargs)
        for state in optimizer.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        return result

    optimizer.load_state_dict = load_state_dict


def step_projections_with(
    optimizer: Any,
    manifold: Optional[StiefelMomentumSGD],
    boundaries: List[BoundaryCodec],
    base_lr: float,
    after_step: Optional[Callable[[bool], None]] = None,
) -> None:
    """Put the boundaries' U under megatron-core's ``optimizer`` (as ``get_megatron_optimizer`` builds it):
    U's gradient counts in the gradient norm that ``clip_grad`` clips (once per boundary), and every
    ``optimizer.step()`` is followed by U's manifold step with the same clip coefficient, the schedule's
    learning-rate factor and this backward's loss scale (skipped with the step); then ``after_step(updated)``."""
    state: Dict[str, Any] = {"loss_scale": 1.0}
    if boundaries:
        _count_projections_in_grad_norm(optimizer, boundaries, state)
    step = optimizer.step

    @functools.wraps(step)
    def step_with_projections(*args, **kwargs):
        state["loss_scale"] = optimizer.get_loss_scale().clone()  # U's gradient carries this backward's scale
        # the schedule's factor now: a group's lr over its own peak (decoupled or scaled groups have other peaks)
        group = optimizer.param_groups[0]
        lr_scale = group["lr"] / group.get("max_lr", base_lr)
        updated, grad_norm, zeros = step(*args, **kwargs)
        if updated and boundaries:
            clip = optimizer.config.clip_grad
            # megatron-core's clip_grad_by_total_norm_fp32, applied to U
            coeff = min(1.0, clip / (float(grad_norm) + 1.0e-6)) if clip > 0.0 and grad_norm is not None else 1.0
            with torch.profiler.record_function(CODEC_RANGE):
                grads = [_projection_grad(b) * (coeff / state["loss_scale"]) for b in boundaries]
                manifold.step(grads, lr_scale=lr_scale)
        for b in boundaries:  # used, or dropped with a skipped step
            b.projection.grad = None
        if after_step is not None:
            after_step(updated)
        return updated, grad_norm, zeros

    optimizer.step = step_with_projections


def _projection_grad(boundary: BoundaryCodec) -> torch.Tensor:
    """U's gradient of this step (zero where the step gave it none)."""
    grad = boundary.projection.grad
    return torch.zeros_like(boundary.projection) if grad is None else grad


def _count_projections_in_grad_norm(optimizer: Any, boundaries: List[BoundaryCodec], state: Dict[str, Any]) -> None:
    """Add U's gradients (divided by ``state["loss_scale"]``) to the list megatron-core takes its gradient norm of
    (0.16: ``get_main_grads_for_grad_norm``, 0.19: ``get_grads_for_grad_norm``; one sub-optimizer's: the norm
    is over all of them). A boundary's U has one replica per stage of its pair, TP rank and, in a distributed
    optimizer's group, DP rank: with c replicas in the norm's group, each adds its gradient / sqrt(c), so the
    squares sum to the gradient's once."""
    subs = getattr(optimizer, "chained_optimizers", None)
    nested = subs is not None and (
        type(optimizer).__name__ != "ChainedOptimizer" or any(hasattr(o, "chained_optimizers") for o in subs)
    )
    if nested:  # e.g. 0.19's layer-wise optimizers: their norm is not the sum of the sub-optimizers' lists
        raise MaplConfigError(
            f"MAPL puts U under --clip-grad through megatron-core's standard optimizers; {type(optimizer).__name__} "
            "(chained optimizers nested or a custom norm) is not supported: use --optimizer adam or sgd"
        )
    target = next(o for o in (subs or [optimizer]) if o.get_parameters())
    name = "get_grads_for_grad_norm" if hasattr(target, "get_grads_for_grad_norm") else "get_main_grads_for_grad_norm"
    grads_for_norm = getattr(target, name)
    group = target.get_grad_stats_parallel_group()
    device = boundaries[0].projection.device
    count = torch.tensor([max(b.boundary for b in boundaries) + 1], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    replicas = torch.zeros(int(count), device=device)
    for b in boundaries:
        replicas[b.boundary] += 1
    dist.all_reduce(replicas, group=group)
    weights = [1.0 / math.sqrt(float(replicas[b.boundary])) for b in boundaries]

    @functools.wraps(grads_for_norm)
    def with_projections(*args, **kwargs):
        grads = grads_for_norm(*args, **kwargs)
        if args or kwargs.get("grad_norm_group") is not None:  # 0.19's separate groups: U is in the main norm
            return grads
        return list(grads) + [_projection_grad(b) * (w / state["loss_scale"]) for b, w in zip(boundaries, weights)]

    setattr(target, name, with_projections)


def warmup_alpha(iteration: int, warmup_steps: int) -> float:
    """``--mapl-warmup-steps``' alpha after ``iteration`` iterations: 1 at the first, falling linearly to 0 at
    ``warmup_steps`` (0: no warm-up)."""
    return max(0.0, 1.0 - iteration / warmup_steps) if warmup_steps else 0.0


def _variable_shapes(cfg: MaplConfig, config: Any, warming: bool) -> bool:
    """Whether the schedule's P2P sends each tensor's shape first: widths that differ per boundary (not during the
    warm-up, where every message is d wide), or a model config with ``variable_seq_lengths`` (set by custom model
    providers; Megatron-LM's parser sets it False)."""
    return (not cfg.uniform and not warming) or bool(getattr(config, "variable_seq_lengths", False))


def attach_mapl(
    model: torch.nn.Module, cfg: MaplConfig, seed: int, codec_class: Type[BoundaryCodec] = BoundaryCodec
) -> MaplStage:
    """Attach the boundary codecs of one freshly built GPTModel chunk (receive side, send side).

    Boundaries are numbered along the whole pipeline: chunk ``vp_stage`` of stage s sits at position
    vp_stage * PP + s, and boundary g joins positions g and g + 1. Both replicas of a boundary start from
    the same seed. Vocabulary, positions and hidden size are read from the model.
    """
    config = model.config
    if getattr(config, "variable_seq_lengths", False) and (cfg.wire != "bf16" or cfg.vq_levels):
        raise MaplConfigError(
            f"{f'--mapl-wire {cfg.wire}' if cfg.wire != 'bf16' else '--mapl-vq-levels'} with a model whose config sets "
            "variable_seq_lengths: that wire's messages have one size for the whole run; pass --mapl-wire bf16"
        )
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    widths = cfg.wire_ranks(config.hidden_size, pp, config.virtual_pipeline_model_parallel_size)
    position = (getattr(model, "vp_stage", None) or 0) * pp + parallel_state.get_pipeline_model_parallel_rank()
    positions = model.max_sequence_length if cfg.anchors_positions(model.position_embedding_type) else 0
    device = next(model.parameters()).device

    def boundary(index: int) -> BoundaryCodec:
        rank = widths[index]
        return codec_class(
            hidden_size=config.hidden_size,
            rank=rank,
            vocab_size=model.vocab_size,
            anchor_rank=cfg.anchor_rank,
            seed=seed,
            boundary=index,
            trainable=not cfg.fixed_projection,
            sequence_parallel=config.sequence_parallel,
            positions=positions,
            context=cfg.context_anchors,
            vq=boundary_vq(cfg, rank, seed, index),
        ).to(device)

    stage = MaplStage(
        model, boundary(position - 1) if position > 0 else None, boundary(position) if position < len(widths) else None
    )
    for codec in stage.boundaries():  # what the telemetry counts: the wire's messages (None: the tensors)
        codec.wire = wire_codec(cfg, codec.rank)
        codec.warm_up_wire = warm_up_wire_codec(cfg, config.hidden_size)
    # where megatron-core sends each tensor's shape first: counted in the MAPL telemetry
    stage.shape_message_bytes = SHAPE_MESSAGE_BYTES if _variable_shapes(cfg, config, warming=False) else 0
    stage.warm_up_shape_message_bytes = SHAPE_MESSAGE_BYTES if _variable_shapes(cfg, config, warming=True) else 0
    return stage


def boundary_vq(cfg: MaplConfig, rank: int, seed: int, boundary: int) -> Optional[ResidualVQ]:
    """The residual codebooks of one boundary of wire width ``rank`` (None without ``--mapl-vq-levels``); both
    sides build them from the same seed."""
    if not cfg.vq_levels:
        return None
    return ResidualVQ(
        rank,
        cfg.vq_levels,
        cfg.vq_codes,
        cfg.vq_decay,
        cfg.vq_sync_rows,
        cfg.vq_sync_tolerance,
        seed=seed * 7919 + boundary,
    )


def start_mapl(stages: List[MaplStage], cfg: MaplConfig) -> "MaplSync":
    """Once every chunk of every rank is built (a collective): anchors from the embedding (``--mapl-anchor-init
    embedding``), the boundary pair groups and the check that both sides of each boundary agree."""
    boundaries = [b for stage in stages for b in stage.boundaries()]
    if cfg.anchor_init == "embedding" and cfg.anchor_rank > 0:
        start_anchors_from_embedding([stage.module for stage in stages], boundaries)
    return MaplSync(stages, lr=cfg.lr, momentum=cfg.momentum, warmup_steps=cfg.warmup_steps)


_WIRE_COMMUNICATORS: Dict[tuple, CodecWireCommunicator] = {}


def schedule_inputs(
    models: List[torch.nn.Module], cfg: MaplConfig, warming: bool = False
) -> Tuple[List["ScheduleView"], Dict[str, Any]]:
    """The models as megatron-core's pipeline schedule must see them (P2P buffers of the wire width) and the
    extra schedule arguments (with VQ: the communicator that puts the indices on the forward wire; with
    ``wire="fp8"`` / ``"int5"`` / ``"topk"``: the one that sends z and dL/dz as that wire's messages).
    ``warming``: during ``--mapl-warmup-steps`` (``MaplSync.warm_up``) every message is d wide: on the FP8 / INT5
    wire (its codec at rank d), else in the pipeline dtype (megatron-core's own P2P)."""
    config = models[0].config
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    widths = cfg.wire_ranks(config.hidden_size, pp, config.virtual_pipeline_model_parallel_size)
    width = config.hidden_size if warming else max(widths)
    views = [ScheduleView(m, width, variable_shapes=_variable_shapes(cfg, config, warming)) for m in models]
    codec = warm_up_wire_codec(cfg, width) if warming else wire_codec(cfg, widths[0])  # a few Python attributes
    if codec is not None:
        group = parallel_state.get_pipeline_model_parallel_group()
        key = (cfg, id(group), config.pipeline_dtype, width)
        if key not in _WIRE_COMMUNICATORS:  # one per run and width: its codec caches headers, checks the first settings
            _WIRE_COMMUNICATORS[key] = CodecWireCommunicator(group, views[0].config, codec)
        return views, dict(
            p2p_communicator=_WIRE_COMMUNICATORS[key], pg_collection=ProcessGroupCollection.use_mpu_process_groups()
        )
    if warming:
        return views, {}
    if not cfg.vq_levels:
        return views, {}
    communicator = IndexWireCommunicator(
        parallel_state.get_pipeline_model_parallel_group(),
        views[0].config,
        packed_width(cfg.vq_levels, cfg.vq_codes, config.pipeline_dtype),
    )
    return views, dict(p2p_communicator=communicator, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
