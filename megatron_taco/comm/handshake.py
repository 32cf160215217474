"""One-time agreement check of the compression settings across a process group.

Ranks that compress with different settings would exchange buffers of
different sizes (a hang, or garbage). Before the first compressed collective
on a group, every rank all-gathers a 16-byte fingerprint of its settings and
every rank raises the same error, naming each rank's settings, when they
differ. The result is cached per (group ranks, settings), so it costs one
small collective per group and setting for the whole run.
"""

from __future__ import annotations

import functools
import struct
from typing import Optional, Set, Tuple

import torch
import torch.distributed as dist

from megatron_taco.codec import WireCodec
from megatron_taco.codec.format import describe_settings_bytes

__all__ = ["SettingsMismatchError", "ensure_same_settings"]

_AGREED: Set[Tuple[object, bytes]] = set()  # (process group, fingerprint) pairs already checked


class SettingsMismatchError(RuntimeError):
    """Ranks of one process group were started with different compression settings."""


@functools.lru_cache(maxsize=None)
def _fingerprint(settings: Optional[bytes], min_bytes: int) -> bytes:
    """16 bytes: b"TACO", the codec's settings bytes (zeros: uncompressed), min_bytes."""
    return b"TACO" + (settings or b"\0\0\0\0") + struct.pack("<q", min_bytes)


def _describe(fingerprint: bytes) -> str:
    settings, (min_bytes,) = fingerprint[4:8], struct.unpack("<q", fingerprint[8:16])
    what = "uncompressed" if settings == b"\0\0\0\0" else describe_settings_bytes(settings)
    return f"{what}, min_bytes={min_bytes}"


def ensure_same_settings(
    group: Optional[dist.ProcessGroup], codec: Optional[WireCodec], min_bytes: int, device: torch.device
) -> None:
    """Raise :class:`SettingsMismatchError` on every rank if the group's ranks disagree."""
    group = group if group is not None else dist.group.WORLD
    mine = _fingerprint(codec.settings_bytes() if codec is not None else None, min_bytes)
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
