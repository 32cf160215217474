"""Residual vector quantization of the projected pipeline activations z (MAPL's optional last stage).

    level 0:  i_0 = argmin_k |z - C_0[k]|^2,            e_1 = z - C_0[i_0]
    level l:  i_l = argmin_k |e_l - C_l[k]|^2,          e_{l+1} = e_l - C_l[i_l]
    decode:   z_q = sum_l C_l[i_l]

Only the L indices per token cross the wire (L bytes with K <= 255 codes, 2 L bytes
up to 65535). Index K is reserved: a token whose z is not finite is sent as K at
every level and decodes to NaN, so a NaN/Inf activation reaches the next stage (and
Megatron's NaN check) as it would without VQ, instead of being rounded to a code. The sender owns the codebook statistics (it is the only side that sees
z); the receiver holds a replica of the *active* codebooks, the ones both sides encode
and decode with. Codebook learning is EMA k-means, once per optimizer step:

    n_k <- decay n_k + (1 - decay) count_k          (tokens assigned to code k)
    s_k <- decay s_k + (1 - decay) sum of e over k  (and the same for |e|^2, for the spread)
    target_k = s_k / n_k

A code whose n_k falls below ``DEAD_CODE_FRACTION`` of the mean is restarted by
splitting a busy code (LBG splitting): the busy code's mean plus Gaussian noise of
``SPLIT_NOISE`` times that code's spread, so the next assignments cut the busy
cluster in two along a random direction (the noise comes from a generator seeded by
boundary, level and update count, so a resumed run repeats it). Statistics are summed over the data-parallel
replicas (and the TP ranks under sequence parallelism) before the update, so every
sender computes the same targets.

Streaming synchronisation: a target row goes to the active codebooks, on the sender
and on the receiver, only when it moved by more than ``sync_tolerance`` relative to
its norm (restarted codes always move), largest moves first, at most ``sync_rows``
rows per step (0: no limit). Only those rows cross the pair group, as (row id, fp32
row) pairs, so both sides decode with bit-identical codebooks at every step.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["index_bytes", "packed_width", "pack_indices", "unpack_indices", "ResidualVQ"]

DEAD_CODE_FRACTION = 0.01  # a code with fewer than 1% of the mean assignments is restarted
SPLIT_NOISE = 0.1  # a restarted code starts this many of its parent's standard deviations away
_ONE_HOT_ELEMENTS = 1 << 23  # per chunk of the statistics' one-hot matmul: 64 MiB as int64, 32 MiB as fp32


def index_bytes(codes: int) -> int:
    """Bytes per index on the wire: 1 up to 255 codes, else 2 (one value is the non-finite sentinel)."""
    return 1 if codes < 256 else 2


def packed_width(levels: int, codes: int, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` per token that hold ``levels`` indices (padded to whole elements)."""
    item = torch.empty((), dtype=dtype).element_size()
    return -(-levels * index_bytes(codes) // item)


def pack_indices(indices: torch.Tensor, codes: int, dtype: torch.dtype) -> torch.Tensor:
    """Indices [..., L] (int64, < codes) -> their bytes viewed as ``dtype`` [..., w] (bit pattern, not values)."""
    levels = indices.shape[-1]
    if index_bytes(codes) == 1:
        raw = indices.to(torch.uint8)
    else:  # 0..65535 stored in int16's bits
        raw = indices.to(torch.int32).to(torch.int16).contiguous().view(torch.uint8)
    width = packed_width(levels, codes, dtype)
    item = torch.empty((), dtype=dtype).element_size()
    padded = torch.zeros(*indices.shape[:-1], width * item, dtype=torch.uint8, device=indices.device)
    padded[..., : raw.shape[-1]] = raw
    return padded.view(dtype)


def unpack_indices(packed: torch.Tensor, levels: int, codes: int) -> torch.Tensor:
    """Inverse of :func:`pack_indices`: [..., w] of any dtype -> int64 [..., L]."""
    raw = packed.contiguous().view(torch.uint8)[..., : levels * index_bytes(codes)]
    if index_bytes(codes) == 1:
        return raw.to(torch.int64)
    return raw.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


class ResidualVQ(torch.nn.Module):
    """L residual codebooks of K codes of width r; see the module docstring for the algorithm."""

    def __init__(
        self, dim: int, levels: int, codes: int, decay: float, sync_rows: int, sync_tolerance: float, seed: int
    ) -> None:
        super().__init__()
        self.dim, self.levels, self.codes = dim, levels, codes
        self.decay, self.sync_rows, self.sync_tolerance = decay, sync_rows, sync_tolerance
        self.seed = seed
        # active codebooks: zero at the start on both sides (no sync needed); the first update
        # restarts every unused code from the data statistics
        self.register_buffer("codebooks", torch.zeros(levels, codes, dim))
        self.register_buffer("ema_count", torch.zeros(levels, codes))
        self.register_buffer("ema_sum", torch.zeros(levels, codes, dim))
        self.register_buffer("ema_square", torch.zeros(levels, codes))
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))
        # this step's statistics (sender only), reset by every update
        self.register_buffer("step_count", torch.zeros(levels, codes), persistent=False)
        self.register_buffer("step_sum", torch.zeros(levels, codes, dim), persistent=False)
        self.register_buffer("step_square", torch.zeros(levels, codes), persistent=False)
        self.rows_synced = 0  # code words sent over the pair group, since start-up
        self.sync_bytes = 0  # bytes the last sync() sent from this rank (the sender's row count, ids and rows)

    @torch.no_grad()
    def encode(self, z: torch.Tensor, record: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """z [..., r] -> (indices int64 [..., L], z_q fp32 [..., r]); ``record`` adds to this step's statistics."""
        flat = z.reshape(-1, self.dim).float()
        finite = torch.isfinite(flat).all(1)
        weight = finite.float()  # non-finite tokens add nothing to the statistics (no host sync)
        residual = torch.where(finite.unsqueeze(1), flat, 0.0)
        chosen = []
        for level in range(self.levels):
            book = self.codebooks[level]
            # |e - c|^2 = |e|^2 - 2 e.c + |c|^2; |e|^2 is the same for every code
            distance = book.square().sum(1) - 2 * residual @ book.transpose(0, 1)
            index = distance.argmin(1)
            if record:
                # per-code sums of [1, e, |e|^2] as a one-hot matmul: a fixed summation order, so GPU runs
                # are bit-reproducible (index_add_ sums with atomics on CUDA, in a different order each run)
                values = torch.cat(
                    [
                        weight.unsqueeze(1),
                        residual * weight.unsqueeze(1),
                        (residual.square().sum(1) * weight).unsqueeze(1),
                    ],
                    dim=1,
                )
                sums = self._per_code_sums(index, values)
                self.step_count[level] += sums[:, 0]
                self.step_sum[level] += sums[:, 1:-1]
                self.step_square[level] += sums[:, -1]
            residual = residual - book[index]
            chosen.append(torch.where(finite, index, self.codes))
        indices = torch.stack(chosen, dim=-1).reshape(*z.shape[:-1], self.levels)
        return indices, self.decode(indices)  # exactly what the receiver will rebuild

    def _per_code_sums(self, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """[K, C] sums of ``values`` [N, C] per code ``index`` [N], as one-hot matmuls over token chunks that
        bound the one-hot matrix (a large K times many tokens would not fit in memory otherwise)."""
        chunk = max(1, _ONE_HOT_ELEMENTS // self.codes)
        sums = values.new_zeros(self.codes, values.shape[1])
        for start in range(0, index.numel(), chunk):
            one_hot = torch.nn.functional.one_hot(index[start : start + chunk], self.codes).to(values.dtype)
            sums += one_hot.transpose(0, 1) @ values[start : start + chunk]
        return sums

    @torch.no_grad()
    def decode(self, indices: torch.Tensor) -> torch.Tensor:
        """indices [..., L] -> z_q fp32 [..., r] (the same sum, in the same order, as :meth:`encode`)."""
        flat = indices.reshape(-1, self.levels)
        sentinel = flat[:, :1] == self.codes
        flat = flat.clamp(max=self.codes - 1)
        total = self.codebooks[0][flat[:, 0]]
        for level in range(1, self.levels):
            total = total + self.codebooks[level][flat[:, level]]
        total = torch.where(sentinel, float("nan"), total)
        return total.reshape(*indices.shape[:-1], self.dim)

    @torch.no_grad()
    def update_targets(self, reduce_groups: Tuple[Optional[dist.ProcessGroup], ...]) -> torch.Tensor:
        """Sender: fold this step's statistics (summed over ``reduce_groups``) into the EMA; return target codebooks."""
        stats = torch.cat([self.step_count.flatten(), self.step_sum.flatten(), self.step_square.flatten()])
        for group in reduce_groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(stats, group=group)
        count, total, square = stats.split([self.step_count.numel(), self.step_sum.numel(), self.step_square.numel()])
        keep = self.decay
        self.ema_count.mul_(keep).add_(count.view_as(self.ema_count), alpha=1 - keep)
        self.ema_sum.mul_(keep).add_(total.view_as(self.ema_sum), alpha=1 - keep)
        self.ema_square.mul_(keep).add_(square.view_as(self.ema_square), alpha=1 - keep)
        self.clear_step_statistics()
        self.updates += 1
        live_mean = self.ema_sum / self.ema_count.clamp_min(1e-12).unsqueeze(-1)
        target = torch.where((self.ema_count > 0).unsqueeze(-1), live_mean, self.codebooks)
        gen = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + int(self.updates))
        for level in range(self.levels):
            self._restart_dead_codes(level, target[level], gen)
        return target

    @torch.no_grad()
    def clear_step_statistics(self) -> None:
        """Forget this step's statistics: folded into the EMA, or dropped with a step the optimizer skipped."""
        for buffer in (self.step_count, self.step_sum, self.step_square):
            buffer.zero_()

    def _restart_dead_codes(self, level: int, target: torch.Tensor, gen: torch.Generator) -> None:
        count = self.ema_count[level]
        mean_count = float(count.sum()) / self.codes
        if mean_count == 0:
            return
        dead = torch.nonzero(count < DEAD_CODE_FRACTION * mean_count).flatten()
        if dead.numel() == 0:
            return
        busy = torch.argsort(count, descending=True, stable=True)[: self.codes - dead.numel()]
        parents = busy[torch.arange(dead.numel(), device=busy.device) % busy.numel()]
        parent_mean = target[parents]
        second_moment = self.ema_square[level][parents] / count[parents] / self.dim
        spread = (second_moment - parent_mean.square().mean(1)).clamp_min(0).sqrt()
        noise = torch.randn(dead.numel(), self.dim, generator=gen).to(target.device)
        target[dead] = parent_mean + SPLIT_NOISE * noise * spread.unsqueeze(1)
        self.ema_count[level][dead] = mean_count
        self.ema_sum[level][dead] = target[dead] * mean_count
        self.ema_square[level][dead] = second_moment * self.dim * mean_count

    @torch.no_grad()
    def changed_rows(self, target: torch.Tensor) -> torch.Tensor:
        """Sender: ids (into the flattened [L*K, r] codebooks) of the rows to sync this step, largest move first."""
        active = self.codebooks.reshape(-1, self.dim)
        move = (target.reshape(-1, self.dim) - active).norm(dim=1)
        moved = move > self.sync_tolerance * active.norm(dim=1)
        ids = torch.nonzero(moved).flatten()
        ids = ids[torch.argsort(move[ids], descending=True, stable=True)]
        return ids[: self.sync_rows] if self.sync_rows > 0 else ids

    @torch.no_grad()
    def sync(self, group: dist.ProcessGroup, sender: int, target: Optional[torch.Tensor]) -> int:
        """Both sides of the boundary: copy the sender's chosen target rows into the active codebooks.

        ``sender`` is the sender's global rank; ``target`` is given on the sender only. Returns the rows sent.
        """
        device = self.codebooks.device
        active = self.codebooks.view(-1, self.dim)
        ids = self.changed_rows(target) if target is not None else None
        count = torch.tensor([0 if ids is None else ids.numel()], dtype=torch.int64, device=device)
        dist.broadcast(count, src=sender, group=group)
        rows = int(count)
        self.sync_bytes = count.numel() * count.element_size() if target is not None else 0
        if rows == 0:
            return 0
        if ids is None:
            ids = torch.empty(rows, dtype=torch.int64, device=device)
            values = torch.empty(rows, self.dim, dtype=torch.float32, device=device)
        else:
            values = target.reshape(-1, self.dim)[ids].contiguous()
        dist.broadcast(ids, src=sender, group=group)
        dist.broadcast(values, src=sender, group=group)
        if target is not None:
            self.sync_bytes += ids.numel() * ids.element_size() + values.numel() * values.element_size()
        active[ids] = values
        self.rows_synced += rows
        return rows
