"""Start MAPL's anchors from the model's own input embedding.

The residual stream at a pipeline boundary is the input embedding plus what the layers before it added. The
anchors a(t, p) = (E[t] + P[p]) B are the part the receiver adds back without wire traffic, so they start as
the best rank-k approximation of that embedding, not as noise:

    M = [W_token; W_position]            (the rows the embedding adds: vocabulary, then positions)
    V_k = top-k eigenvectors of M^T M    (top-k right singular vectors of M)
    B = V_k^T,  E = W_token V_k,  P = W_position V_k

so (E[t] + P[p]) B = (W_token[t] + W_position[p]) V_k V_k^T, exact when k >= rank(M). At the start of
training the boundary then only has to carry what the layers added (the sender subtracts a(t, p) first). With
random anchors that part of the embedding had to be relearned through the r-wide wire; on CPU this start
lowered the 8x validation gap from +5.6% to +3.4% at anchor rank 64 and from +6.3% to +2.0% at rank 128 = d
(3 seeds each, benchmarks/results/archive/mapl/mapl_cpu_study_seeds.md).

Only the first pipeline stage holds the embedding: global rank 0 (first stage, first TP and DP rank) gathers
the vocabulary-parallel table over its TP group, computes the factors and broadcasts them to every rank, so
every replica of every boundary starts from the same values.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_taco.mapl.boundary import BoundaryCodec

__all__ = ["start_anchors_from_embedding"]


def _embedding_tables(first_chunk: torch.nn.Module, with_positions: bool) -> torch.Tensor:
    """[V (+ S), d] fp32: the whole token table (gathered over TP), then the position table if asked for."""
    embedding = first_chunk.embedding
    tokens = embedding.word_embeddings.weight.detach().float()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(tp_group) > 1:
        shards = [torch.empty_like(tokens) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(shards, tokens.contiguous(), group=tp_group)
        tokens = torch.cat(shards)
    if not with_positions:
        return tokens
    return torch.cat([tokens, embedding.position_embeddings.weight.detach().float()])


def _factors(tables: torch.Tensor, vocab: int, rank: int) -> List[torch.Tensor]:
    """[E, P, B] with E P stacked as ``tables`` V_k and B = V_k^T (zero rows where k > the tables' rank)."""
    tables = tables.double()
    eigenvectors = torch.linalg.eigh(tables.T @ tables)[1].flip(-1)[:, :rank]  # descending eigenvalues
    basis = torch.zeros(rank, tables.shape[1], dtype=torch.float64, device=tables.device)
    basis[: eigenvectors.shape[1]] = eigenvectors.T
    coefficients = tables @ basis.T
    return [coefficients[:vocab].float(), coefficients[vocab:].float(), basis.float()]


@torch.no_grad()
def start_anchors_from_embedding(first_chunks: List[torch.nn.Module], boundaries: List[BoundaryCodec]) -> None:
    """Set every boundary's anchors from the embedding (see the module docstring); a collective over all ranks.

    ``first_chunks``: this rank's GPTModel chunks (the first one holds the embedding on the first stage);
    ``boundaries``: this rank's boundaries, all anchored alike (same vocabulary, anchor rank, positions and
    hidden size); with PP >= 2 every rank has at least one.
    """
    like = boundaries[0]
    vocab, rank = like.anchor_embedding.shape
    shapes = [(vocab, rank), (like.positions, rank), (rank, like.hidden_size)]
    if parallel_state.is_pipeline_first_stage(ignore_virtual=True):  # global rank 0 is on this stage
        tables = _embedding_tables(first_chunks[0], with_positions=like.positions > 0)
        if tables.shape[0] != vocab + like.positions:
            raise RuntimeError(
                f"MAPL anchors: the embedding has {tables.shape[0]} rows, the anchors expect "
                f"{vocab} tokens + {like.positions} positions"
            )
    factors = (
        _factors(tables, vocab, rank)
        if dist.get_rank() == 0
        else [torch.empty(shape, dtype=torch.float32, device=like.anchor_basis.device) for shape in shapes]
    )
    for factor in factors:
        if factor.numel():
            dist.broadcast(factor, src=0)
    token_factor, position_factor, basis = factors
    for boundary in boundaries:
        boundary.anchor_embedding.copy_(token_factor)
        boundary.anchor_basis.copy_(basis)
        if boundary.positions:
            boundary.anchor_position.copy_(position_factor)
