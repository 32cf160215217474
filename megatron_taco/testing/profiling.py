"""Attribute a profiled step's work to a codec marked by a profiler range.

A codec built from ordinary operators (MAPL's projection and anchors are GEMMs and element-wise ops) cannot be
told from the model by kernel names. Its forward operators run inside a ``torch.profiler.record_function``
range; its backward operators run later, outside any range, in the autograd engine, where the profiler tags
each node's ``evaluate_function`` event with the autograd sequence number of the forward operator that
created the node. So: the codec's host operators are those inside the range, plus those under the backward
events whose sequence number only forward operators inside the range carry.
"""

from __future__ import annotations

from typing import Iterator, List

from torch.autograd import DeviceType

__all__ = ["codec_operators"]

BACKWARD_EVENT = "autograd::engine::evaluate_function"


def _enclosing(op) -> Iterator:
    """The operator and its host-side parents, innermost first."""
    while op is not None:
        yield op
        op = op.cpu_parent


def codec_operators(events, range_name: str) -> List:
    """Host operators (``FunctionEvent``) of one profile that belong to the code inside ``range_name``,
    forward and backward; their ``kernels`` are the codec's device work."""
    host = [e for e in events if e.device_type == DeviceType.CPU]

    def forward_nodes(inside: bool) -> set:
        return {
            op.sequence_nr
            for op in host
            if op.sequence_nr >= 0
            and not any(a.name.startswith(BACKWARD_EVENT) for a in _enclosing(op))
            and any(a.name == range_name for a in _enclosing(op)) == inside
        }

    # an operator that creates no autograd node reports the next sequence number, which a node created after
    # the range may then take: numbers seen outside the range too are not the codec's
    codec_nodes = forward_nodes(True) - forward_nodes(False)
    return [
        op
        for op in host
        if any(
            a.name == range_name or (a.name.startswith(BACKWARD_EVENT) and a.sequence_nr in codec_nodes)
            for a in _enclosing(op)
        )
    ]
