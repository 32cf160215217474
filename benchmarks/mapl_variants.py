"""Named MAPL settings of the quality studies (GPU: ``mapl_quality.py``, CPU: ``mapl_cpu_study.py``).

One table for both, so a name means the same setting in every results file. Rows measured before position
anchors and the embedding start of the anchors became the defaults keep both off unless the name says so.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

from megatron_taco.config.mapl import MaplConfig
from megatron_taco.mapl.boundary import BoundaryCodec
from megatron_taco.training.loop import TrainConfig, Trainer


@dataclasses.dataclass(frozen=True)
class AnchorsWithoutCompression(MaplConfig):
    """Study baseline, not a compression: the uncompressed model given MAPL's anchor tables.

    Full width (r = d, so U U^T = I) and nothing subtracted before the wire: the receiving stage gets
    h + a(t, p, context), where MAPL gives U U^T h + (I - U U^T) a. The token and position tables start at zero
    (h already holds the embedding), the basis from the embedding, the context tables at zero as in MAPL. Rows
    with context anchors against this one measure what the compression costs when both models have the same
    n-gram features.
    """


class _AddedAnchorsCodec(BoundaryCodec):
    def project(self, hidden, tokens, positions=None, previous=None):
        return (hidden.float() @ self.projection).to(hidden.dtype)


class _AddedAnchorsTrainer(Trainer):
    boundary_codec = _AddedAnchorsCodec

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        if cfg.dtype != "fp32":  # half precision keeps separate fp32 main weights that zeroing here would miss
            raise ValueError("the anchors-without-compression baseline runs in fp32 only")
        with torch.no_grad():
            for boundary in self.mapl_boundaries:
                boundary.anchor_embedding.zero_()
                if boundary.positions:
                    boundary.anchor_position.zero_()


def make_trainer(cfg: TrainConfig) -> Trainer:
    """The trainer for a study row: the product's, or the baseline's for :class:`AnchorsWithoutCompression`."""
    return (_AddedAnchorsTrainer if isinstance(cfg.mapl, AnchorsWithoutCompression) else Trainer)(cfg)


def _earlier(**settings) -> MaplConfig:
    """A row as first measured: no position anchors, anchors starting from noise."""
    return MaplConfig(**{"position_anchors": False, "anchor_init": "random", **settings})


VARIANTS: Dict[str, Optional[MaplConfig]] = {
    "uncompressed": None,
    "MAPL 2x": _earlier(ratio=2, anchor_rank=16),
    "MAPL 4x": _earlier(ratio=4, anchor_rank=16),
    "MAPL 8x": _earlier(ratio=8, anchor_rank=16),
    "MAPL 16x": _earlier(ratio=16, anchor_rank=16),
    "fixed projection 8x (SSN-style)": MaplConfig(ratio=8, fixed_projection=True, anchor_rank=0),
    "MAPL 8x + VQ (2 x 255 codes)": _earlier(ratio=8, vq_levels=2, vq_codes=255, anchor_rank=16),
    "MAPL 8x, manifold lr 0.001": _earlier(ratio=8, lr=0.001, anchor_rank=16),
    "MAPL 8x, manifold lr 0.1": _earlier(ratio=8, lr=0.1, anchor_rank=16),
    "MAPL 8x, anchor rank 64": _earlier(ratio=8, anchor_rank=64),
    "MAPL 16x, anchor rank 64": _earlier(ratio=16, anchor_rank=64),
    "MAPL 8x, anchor rank 128 (= hidden)": _earlier(ratio=8, anchor_rank=128),  # the CPU model's hidden size
    "MAPL 8x, anchor rank 64, manifold lr 0.1": _earlier(ratio=8, anchor_rank=64, lr=0.1),
    "MAPL 8x, anchor rank 64, position anchors": _earlier(ratio=8, anchor_rank=64, position_anchors=True),
    "MAPL 8x, anchor rank 64, manifold lr 0.1, position anchors": _earlier(
        ratio=8, anchor_rank=64, lr=0.1, position_anchors=True
    ),
    "MAPL 8x, anchor rank 128, position anchors": _earlier(ratio=8, anchor_rank=128, position_anchors=True),
    "MAPL 16x, anchor rank 64, position anchors": _earlier(ratio=16, anchor_rank=64, position_anchors=True),
    "MAPL 8x, anchor rank 64, position anchors, anchors from the embedding": MaplConfig(
        ratio=8, anchor_rank=64, position_anchors=True, anchor_init="embedding"
    ),
    "MAPL 8x, anchor rank 128, position anchors, anchors from the embedding": MaplConfig(
        ratio=8, anchor_rank=128, position_anchors=True, anchor_init="embedding"
    ),
    "MAPL 16x, anchor rank 64, position anchors, anchors from the embedding": MaplConfig(
        ratio=16, anchor_rank=64, position_anchors=True, anchor_init="embedding"
    ),
    # the GPU model's byte vocabulary has 256 tokens: at k = 256 the anchors start as the whole token table
    "MAPL 8x, anchor rank 256 (= vocab), position anchors, anchors from the embedding": MaplConfig(
        ratio=8, anchor_rank=256, position_anchors=True, anchor_init="embedding"
    ),
    "MAPL 16x, anchor rank 256 (= vocab), position anchors, anchors from the embedding": MaplConfig(
        ratio=16, anchor_rank=256, position_anchors=True, anchor_init="embedding"
    ),
    "MAPL 8x, anchor rank 64, position anchors, anchors from the embedding, 3 context tokens": MaplConfig(
        ratio=8, anchor_rank=64, position_anchors=True, anchor_init="embedding", context_anchors=3
    ),
    "MAPL 16x, anchor rank 64, position anchors, anchors from the embedding, 3 context tokens": MaplConfig(
        ratio=16, anchor_rank=64, position_anchors=True, anchor_init="embedding", context_anchors=3
    ),
    "uncompressed + MAPL's anchors (rank 128, positions, 3 context tokens), no compression": AnchorsWithoutCompression(
        ratio=1, anchor_rank=128, position_anchors=True, anchor_init="embedding", context_anchors=3
    ),
    "MAPL 8x, anchor rank 128, position anchors, anchors from the embedding, 1 context token": MaplConfig(
        ratio=8, anchor_rank=128, position_anchors=True, anchor_init="embedding", context_anchors=1
    ),
    "MAPL 8x, anchor rank 128, position anchors, anchors from the embedding, 3 context tokens": MaplConfig(
        ratio=8, anchor_rank=128, position_anchors=True, anchor_init="embedding", context_anchors=3
    ),
    "MAPL 8x, anchor rank 256 (= vocab), position anchors, anchors from the embedding, 1 context token": MaplConfig(
        ratio=8, anchor_rank=256, position_anchors=True, anchor_init="embedding", context_anchors=1
    ),
    "MAPL 8x, anchor rank 256 (= vocab), position anchors, anchors from the embedding, 3 context tokens": MaplConfig(
        ratio=8, anchor_rank=256, position_anchors=True, anchor_init="embedding", context_anchors=3
    ),
    "MAPL 16x, anchor rank 256 (= vocab), position anchors, anchors from the embedding, 3 context tokens": MaplConfig(
        ratio=16, anchor_rank=256, position_anchors=True, anchor_init="embedding", context_anchors=3
    ),
}
