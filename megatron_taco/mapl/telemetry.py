"""MAPL traffic: the bytes each pipeline boundary carried, against the uncompressed activation.

Counted from the tensors handed to the pipeline schedule, on the rank that sends them:

- forward, by the stage before the boundary: the r-wide projection (with VQ: the packed
  indices, which is what :class:`~megatron_taco.mapl.wire.IndexWireCommunicator` sends), against
  the d-wide activation the stage computed, in its dtype (what the schedule would send without MAPL);
- backward, by the stage after it: the gradient of the tensor it received (r wide, taken by a
  gradient hook when autograd computes it), against the d-wide gradient of the reconstructed
  activation that the stage would otherwise send back;
- with a different width per boundary (``--mapl-ranks``), megatron-core sends each tensor's shape
  first: three int64 (24 bytes) per message, added to the wire bytes;
- replica sync, once per step over the boundary's pair group (no counterpart without MAPL): the U and
  anchor gradients summed over the two replicas (each rank of a 2-rank all-reduce sends the tensor's
  bytes) and, with VQ, the code words the sender streams to the receiver.

Only training passes count (autograd on): validation's forward-only passes are not recorded.
Each rank records what it sends; :meth:`MaplTelemetry.summed` adds the ranks up (every pipeline,
every TP and DP rank), so the numbers are the bytes that crossed each boundary in the whole job.
``MAPL_TELEMETRY`` is the process-wide instance the trainer reports every ``--taco-log-interval``
steps and at the end of the run.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

__all__ = [
    "SHAPE_MESSAGE_BYTES",
    "format_bytes",
    "BoundaryTraffic",
    "compared",
    "boundary_name",
    "describe_boundary",
    "describe_total",
    "MaplTelemetry",
    "format_lines",
    "write_tensorboard",
    "MAPL_TELEMETRY",
]

SHAPE_MESSAGE_BYTES = 3 * 8  # megatron-core's variable-shape mode: the [s, b, h] shape as int64 before each tensor


def _nbytes(tensor: torch.Tensor, codec=None) -> int:
    """Bytes of ``tensor`` on the wire: as it is, or as one message of ``codec`` (``mapl.wire.wire_codec``'s)."""
    return tensor.numel() * tensor.element_size() if codec is None else codec.compressed_nbytes(tensor.numel())


def format_bytes(nbytes: float) -> str:
    """Bytes in B, KiB, MiB, GiB or TiB, 4 significant digits."""
    value, unit = float(nbytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.4g} {unit}"


@dataclasses.dataclass
class BoundaryTraffic:
    """One boundary's messages and bytes, each direction: as sent (wire) and as they would be without MAPL."""

    forward_messages: int = 0
    forward_wire: int = 0
    forward_uncompressed: int = 0
    backward_messages: int = 0
    backward_wire: int = 0
    backward_uncompressed: int = 0
    sync: int = 0

    def add(self, other: "BoundaryTraffic") -> None:
        for field in dataclasses.fields(BoundaryTraffic):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def as_list(self) -> List[int]:
        return [getattr(self, field.name) for field in dataclasses.fields(BoundaryTraffic)]

    @property
    def wire(self) -> int:
        """Activation traffic sent, both directions (replica sync not included)."""
        return self.forward_wire + self.backward_wire

    @property
    def uncompressed(self) -> int:
        return self.forward_uncompressed + self.backward_uncompressed


def compared(uncompressed: float, wire: float, summary: bool = False) -> str:
    """'U -> W (Nx)' for log lines; 'W sent vs U uncompressed (Nx)' (``summary``) for the end-of-run summary."""
    ratio = f"{uncompressed / wire:.2f}x" if wire else "-"
    if summary:
        return f"{format_bytes(wire)} sent vs {format_bytes(uncompressed)} uncompressed ({ratio})"
    return f"{format_bytes(uncompressed)} -> {format_bytes(wire)} ({ratio})"


def boundary_name(boundary: int, pipeline_parallel: int) -> str:
    """'boundary g (stage a -> b)': boundary g joins pipeline positions g and g + 1 (chunks of the interleaved
    schedule sit at position chunk * PP + stage)."""
    return f"boundary {boundary} (stage {boundary % pipeline_parallel} -> {(boundary + 1) % pipeline_parallel})"


def describe_boundary(traffic: BoundaryTraffic, steps: int, summary: bool = False) -> str:
    """'forward ..., backward ..., replica sync S' per step (see :func:`compared`)."""
    steps = max(steps, 1)
    return (
        f"forward {compared(traffic.forward_uncompressed / steps, traffic.forward_wire / steps, summary)}, "
        f"backward {compared(traffic.backward_uncompressed / steps, traffic.backward_wire / steps, summary)}, "
        f"replica sync {format_bytes(traffic.sync / steps)}"
    )


def describe_total(traffic: List[BoundaryTraffic], summary: bool = False) -> str:
    """All boundaries and both directions together (see :func:`compared`), then with the replica sync added."""
    uncompressed, wire = sum(t.uncompressed for t in traffic), sum(t.wire for t in traffic)
    synced = wire + sum(t.sync for t in traffic)
    with_sync = f"{uncompressed / synced:.2f}x" if synced else "-"
    return (
        f"{compared(uncompressed, wire, summary)}; with replica sync {format_bytes(synced)}"
        f"{' sent' if summary else ''} ({with_sync})"
    )


class MaplTelemetry:
    def __init__(self) -> None:
        self.records: Dict[int, BoundaryTraffic] = {}  # this rank's sends in the current interval, by boundary
        self._earlier: Dict[int, BoundaryTraffic] = {}  # the intervals before the last reset(), since start_run()

    def _record(self, boundary: int) -> BoundaryTraffic:
        return self.records.setdefault(boundary, BoundaryTraffic())

    def record_forward(
        self, boundary: int, sent: torch.Tensor, activation: torch.Tensor, header: int = 0, codec=None
    ) -> None:
        """The stage before ``boundary`` hands ``sent`` to the schedule in place of ``activation`` (sent as one
        message of ``codec`` if given)."""
        rec = self._record(boundary)
        rec.forward_messages += 1
        rec.forward_wire += _nbytes(sent, codec) + header
        rec.forward_uncompressed += _nbytes(activation)

    def record_sync(self, boundary: int, tensor: Optional[torch.Tensor] = None, nbytes: int = 0) -> None:
        """This rank sent ``tensor`` (or ``nbytes``) to the other replica of ``boundary``."""
        self._record(boundary).sync += nbytes if tensor is None else _nbytes(tensor)

    def watch_backward(
        self, boundary: int, received: torch.Tensor, activation: torch.Tensor, header: int = 0, codec=None
    ) -> None:
        """The stage after ``boundary`` rebuilt ``activation`` from ``received``: record the gradient of
        ``received`` (what the schedule sends back, as one message of ``codec`` if given) when autograd
        computes it."""
        uncompressed = _nbytes(activation)

        def hook(grad: torch.Tensor) -> None:
            rec = self._record(boundary)
            rec.backward_messages += 1
            rec.backward_wire += _nbytes(grad, codec) + header
            rec.backward_uncompressed += uncompressed

        received.register_hook(hook)

    def reset(self) -> None:
        """Start a new interval (after a log line); the run total keeps what this one held."""
        for boundary, rec in self.records.items():
            self._earlier.setdefault(boundary, BoundaryTraffic()).add(rec)
        self.records.clear()

    def start_run(self) -> None:
        """Forget everything recorded so far: the interval and the run total."""
        self.records.clear()
        self._earlier.clear()

    def summed(self, boundaries: int, device: torch.device, run: bool = False) -> List[BoundaryTraffic]:
        """Every boundary's traffic of the interval (``run``: since start_run()) summed over all ranks.

        A collective over the default group: every rank calls it at the same point."""
        local = [BoundaryTraffic() for _ in range(boundaries)]
        for source in [self._earlier, self.records] if run else [self.records]:
            for boundary, rec in source.items():
                local[boundary].add(rec)
        table = torch.tensor([t.as_list() for t in local], dtype=torch.int64, device=device)
        if dist.is_initialized():
            dist.all_reduce(table)
        return [BoundaryTraffic(*map(int, row)) for row in table.tolist()]


def format_lines(traffic: List[BoundaryTraffic], steps: int, pipeline_parallel: int) -> List[str]:
    """The periodic log lines: per boundary, uncompressed -> sent per step; then the interval's total."""
    lines = [
        f"mapl {boundary_name(g, pipeline_parallel)} per step, all ranks: {describe_boundary(t, steps)}"
        for g, t in enumerate(traffic)
    ]
    lines.append(
        f"mapl total over {steps} step{'s' if steps != 1 else ''}, all boundaries and ranks: {describe_total(traffic)}"
    )
    return lines


def write_tensorboard(writer, step: int, traffic: List[BoundaryTraffic], steps: int) -> None:
    """Per boundary and direction, MiB per step sent and uncompressed (writer: a SummaryWriter)."""
    steps = max(steps, 1)
    for g, t in enumerate(traffic):
        for direction in ("forward", "backward"):
            tag = f"mapl/boundary_{g}/{direction}"
            writer.add_scalar(f"{tag}/wire_MiB_per_step", getattr(t, f"{direction}_wire") / steps / 2**20, step)
            writer.add_scalar(
                f"{tag}/uncompressed_MiB_per_step", getattr(t, f"{direction}_uncompressed") / steps / 2**20, step
            )
        writer.add_scalar(f"mapl/boundary_{g}/replica_sync_MiB_per_step", t.sync / steps / 2**20, step)


MAPL_TELEMETRY = MaplTelemetry()
