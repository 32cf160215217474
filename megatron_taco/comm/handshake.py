"""One-time agreement check of the compression settings across a process group.

Ranks that compress with different settings would exchange buffers of
different sizes (a hang, or garbage). Before the first compressed collective
on a group, every rank all-gathers a 24-byte fingerprint of its settings and
every rank raises the same error, naming each rank's settings, when they
differ. The result is cached per (group ranks, settings), so it costs one
small collective per group and setting for the whole run.

That check runs only where a rank compresses: ranks of which one takes the stock
path for a message (another ``min_bytes``, TACO off for that linear) and another
TACO's collective never meet in it (a size-mismatch error on gloo, a hang on
NCCL). :func:`ensure_same_plan` compares the whole plan, every linear's settings,
once when the settings are attached.
"""

from __future__ import annotations

import functools
import struct
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from megatron_taco.codec import WireCodec
from megatron_taco.codec.format import describe_settings_bytes

__all__ = ["SettingsMismatchError", "describe_codec", "ensure_same_plan", "ensure_same_settings"]

_AGREED: Set[Tuple[object, bytes]] = set()  # (process group, fingerprint) pairs already checked


class SettingsMismatchError(RuntimeError):
    """Ranks of one process group were started with different compression settings."""


@functools.lru_cache(maxsize=None)
def _fingerprint(settings: Optional[bytes], min_bytes: int, chunk_bytes: int) -> bytes:
    """24 bytes: b"TACO", the codec's settings bytes (zeros: uncompressed), min_bytes, chunk_bytes (ranks that
    split a message into other chunks exchange buffers of other sizes)."""
    return b"TACO" + (settings or b"\0\0\0\0") + struct.pack("<qq", min_bytes, chunk_bytes)


def _describe(fingerprint: bytes) -> str:
    settings, (min_bytes, chunk_bytes) = fingerprint[4:8], struct.unpack("<qq", fingerprint[8:24])
    what = "uncompressed" if settings == b"\0\0\0\0" else describe_settings_bytes(settings)
    return f"{what}, min_bytes={min_bytes}, chunk_bytes={chunk_bytes}"


def describe_codec(codec: Optional[WireCodec]) -> str:
    """A codec's settings as the mismatch errors name them (``uncompressed`` for None)."""
    return "uncompressed" if codec is None else describe_settings_bytes(codec.settings_bytes())


def ensure_same_settings(
    group: Optional[dist.ProcessGroup],
    codec: Optional[WireCodec],
    min_bytes: int,
    chunk_bytes: int,
    device: torch.device,
) -> None:
    """Raise :class:`SettingsMismatchError` on every rank if the group's ranks disagree."""
    group = group if group is not None else dist.group.WORLD
    mine = _fingerprint(codec.settings_bytes() if codec is not None else None, min_bytes, chunk_bytes)
    if (group, mine) in _AGREED:
        return
    ranks = dist.get_process_group_ranks(group)
    world = len(ranks)
    local = torch.tensor(list(mine), dtype=torch.uint8, device=device)
    gathered = torch.empty(world * len(mine), dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(gathered, local, group=group)
    everyone = [bytes(row.tolist()) for row in gathered.view(world, -1).cpu()]
    if any(fp != mine for fp in everyone):
        detail = "; ".join(f"rank {ranks[i]}: {_describe(fp)}" for i, fp in enumerate(everyone))
        raise SettingsMismatchError(f"compression settings differ across the process group: {detail}")
    _AGREED.add((group, mine))


def ensure_same_plan(group: dist.ProcessGroup, plan: Dict[str, str]) -> None:
    """Raise :class:`SettingsMismatchError` on every rank of ``group`` if its ranks hold different plans.

    ``plan`` maps each setting the ranks must share (``"layer 3 fc1"``, ``"--taco-min-bytes"``) to its value; the
    error names the first that differs and each rank's value. One object all-gather per call."""
    ranks = dist.get_process_group_ranks(group)
    everyone: List[Optional[Dict[str, str]]] = [None] * len(ranks)
    dist.all_gather_object(everyone, plan, group=group)
    for key in dict.fromkeys(key for rank_plan in everyone for key in rank_plan):  # every key, in plan order
        values = [rank_plan.get(key, "absent") for rank_plan in everyone]
        if len(set(values)) > 1:
            detail = "; ".join(f"rank {rank}: {value}" for rank, value in zip(ranks, values))
            raise SettingsMismatchError(
                f"TACO settings differ across tensor-parallel ranks {ranks} at {key} ({detail}); start every rank "
                "with the same --taco-* flags"
            )
