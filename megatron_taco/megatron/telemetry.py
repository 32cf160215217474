"""Per-layer TACO telemetry: bytes before/after compression and sampled codec error.

Every compressed-linear collective records its uncompressed payload bytes and
the bytes it put on the wire (the compressed message, or the payload when the
message went uncompressed); the all-gathers Transformer Engine sends itself in FP8 / FP4
(under ``--fp8-format`` / ``--fp4-format``) are counted apart; every Nth message per (linear, collective) also
measures the codec's relative L2 error on the local payload (a local round
trip: no extra communication). ``TELEMETRY`` is the process-wide instance the
trainer logs every ``--taco-log-interval`` steps. :meth:`TacoTelemetry.reset` starts a
new interval; what the intervals held adds up in :meth:`TacoTelemetry.run_total`,
for the end-of-run summary (:meth:`TacoTelemetry.start_run` clears that too).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_taco.codec import WireCodec

__all__ = ["TrafficRecord", "TacoTelemetry", "TELEMETRY"]


@dataclasses.dataclass
class TrafficRecord:
    calls: int = 0
    compressed_calls: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0
    error_sum: float = 0.0
    error_samples: int = 0
    te_calls: int = 0  # messages of a configured linear that Transformer Engine sent itself, quantized (FP8 / FP4)

    @property
    def mean_error(self) -> Optional[float]:
        return self.error_sum / self.error_samples if self.error_samples else None

    def add(self, other: "TrafficRecord") -> None:
        for field in dataclasses.fields(TrafficRecord):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def summed_over_ranks(self, device: torch.device) -> "TrafficRecord":
        """This record added up over all ranks (a collective over the default group: every rank calls it)."""
        fields = dataclasses.fields(TrafficRecord)
        values = torch.tensor([float(getattr(self, f.name)) for f in fields], dtype=torch.float64, device=device)
        if dist.is_initialized():
            dist.all_reduce(values)
        return TrafficRecord(
            *(v if f.type in (float, "float") else int(round(v)) for f, v in zip(fields, values.tolist()))
        )


Key = Tuple[str, str, str]  # (linear name, collective, direction)


class TacoTelemetry:
    def __init__(self) -> None:
        self.records: Dict[Key, TrafficRecord] = collections.defaultdict(TrafficRecord)
        self.error_sample_interval = 10
        self._earlier = TrafficRecord()  # the intervals before the last reset(), since start_run()

    def record(self, key: Key, payload: torch.Tensor, codec: Optional[WireCodec], compressed: bool) -> None:
        rec = self.records[key]
        rec.calls += 1
        nbytes = payload.numel() * payload.element_size()
        rec.payload_bytes += nbytes
        if compressed:
            rec.compressed_calls += 1
            rec.wire_bytes += codec.compressed_nbytes(payload.numel())
            interval = self.error_sample_interval
            if interval and rec.compressed_calls % interval == 1 % interval:
                with torch.no_grad():
                    probe = copy.copy(codec)  # its own call count: sampling must not move stochastic rounding's noise
                    decoded = probe.decompress(probe.compress(payload), payload.shape, torch.float32, validate=False)
                    ref = payload.float()
                    rec.error_sum += float((decoded - ref).norm() / ref.norm().clamp_min(1e-30))
                rec.error_samples += 1
        else:
            rec.wire_bytes += nbytes

    def record_uncompressed(self, key: Key, nbytes: int) -> None:
        """A message of a configured linear that went uncompressed without passing through TACO's collectives
        (megatron-core's or TE's own path, taken when no message of the linear reaches --taco-min-bytes)."""
        rec = self.records[key]
        rec.calls += 1
        rec.payload_bytes += nbytes
        rec.wire_bytes += nbytes

    def record_sent_by_te(self, key: Key) -> None:
        """A message of a configured linear that TE all-gathers itself in its own FP8 / FP4 (``--fp8-format`` /
        ``--fp4-format`` training gives the gather a quantizer): counted apart, its bytes are TE's."""
        self.records[key].te_calls += 1

    def reset(self) -> None:
        """Start a new interval (after a log line); the run total keeps what this one held."""
        for rec in self.records.values():
            self._earlier.add(rec)
        self.records.clear()

    def start_run(self) -> None:
        """Forget everything recorded so far: the interval and the run total."""
        self.records.clear()
        self._earlier = TrafficRecord()

    def run_total(self) -> TrafficRecord:
        """Every message recorded since start_run(), all linears together, across resets."""
        total = dataclasses.replace(self._earlier)
        for rec in self.records.values():
            total.add(rec)
        return total

    def pipeline_records(self) -> Dict[Key, TrafficRecord]:
        """This interval's records of every pipeline stage at this rank's TP / DP position, so that one rank's lines
        cover every layer (an object all-gather over megatron-core's pipeline group: every rank calls it)."""
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return dict(self.records)
        group = parallel_state.get_pipeline_model_parallel_group()
        stages = dist.get_world_size(group)
        if stages == 1:
            return dict(self.records)
        gathered: List[Optional[Dict[Key, TrafficRecord]]] = [None] * stages
        dist.all_gather_object(gathered, dict(self.records), group=group)
        merged: Dict[Key, TrafficRecord] = collections.defaultdict(TrafficRecord)
        for records in gathered:
            for key, rec in records.items():
                merged[key].add(rec)
        return dict(merged)

    def totals(self, records: Optional[Dict[Key, TrafficRecord]] = None) -> Tuple[int, int]:
        records = self.records if records is None else records
        payload = sum(r.payload_bytes for r in records.values())
        wire = sum(r.wire_bytes for r in records.values())
        return payload, wire

    def format_lines(self, records: Optional[Dict[Key, TrafficRecord]] = None) -> List[str]:
        """One line per layer (its linears and collectives together) plus a total, for the training log
        (``records``: e.g. :meth:`pipeline_records`; this rank's own by default)."""
        records = self.records if records is None else records
        by_layer: Dict[str, TrafficRecord] = collections.defaultdict(TrafficRecord)
        for (name, _, _), rec in records.items():
            layer = name.rsplit(" ", 1)[0]
            by_layer[layer].add(rec)
        lines = []
        for layer, rec in sorted(by_layer.items(), key=lambda item: int(item[0].split()[-1])):
            err = f"{rec.mean_error:.4f}" if rec.mean_error is not None else "-"
            by_te = f"; {rec.te_calls} all-gathers sent by Transformer Engine in FP8 / FP4" if rec.te_calls else ""
            lines.append(
                f"taco {layer}: {rec.compressed_calls}/{rec.calls} messages compressed, "
                f"{rec.payload_bytes / 2**20:.2f} MiB -> {rec.wire_bytes / 2**20:.2f} MiB "
                f"({rec.payload_bytes / rec.wire_bytes if rec.wire_bytes else 1:.2f}x), sampled rel.err {err}{by_te}"
            )
        payload, wire = self.totals(records)
        by_te = sum(r.te_calls for r in records.values())
        if payload or by_te:
            calls = sum(r.calls for r in records.values())
            uncompressed = calls - sum(r.compressed_calls for r in records.values())
            lines.append(
                f"taco total: {payload / 2**20:.2f} MiB -> {wire / 2**20:.2f} MiB ({payload / wire if wire else 1:.2f}x); "
                f"{uncompressed} of {calls} messages of configured linears went uncompressed (below --taco-min-bytes)"
                + (
                    f"; {by_te} more went as Transformer Engine's own FP8 / FP4 all-gathers (--fp8-format / "
                    "--fp4-format training; not in the bytes above)"
                    if by_te
                    else ""
                )
            )
        return lines

    def write_tensorboard(self, writer, step: int, records: Optional[Dict[Key, TrafficRecord]] = None) -> None:
        """Scalars per linear and collective (writer: a torch.utils.tensorboard SummaryWriter)."""
        for (name, collective, direction), rec in (self.records if records is None else records).items():
            tag = f"taco/{name.replace(' ', '_')}/{collective}_{direction}"
            writer.add_scalar(f"{tag}/payload_MiB", rec.payload_bytes / 2**20, step)
            writer.add_scalar(f"{tag}/wire_MiB", rec.wire_bytes / 2**20, step)
            if rec.mean_error is not None:
                writer.add_scalar(f"{tag}/rel_error", rec.mean_error, step)


TELEMETRY = TacoTelemetry()
