"""Named MAPL settings of the quality studies (GPU: ``mapl_quality.py``, CPU: ``mapl_cpu_study.py``).

One table for both, so a name means the same setting in every results file. Rows measured before position
anchors and the embedding start of the anchors became the defaults keep both off unless the name says so.
"""

from __future__ import annotations

from typing import Dict, Optional

from megatron_taco.config.mapl import MaplConfig


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
    "MAPL 8x, anchor rank 64, manifold lr 0.1, position anchors": _earlier(ratio=8, anchor_rank=64, lr=0.1,
                                                                           position_anchors=True),
    "MAPL 8x, anchor rank 128, position anchors": _earlier(ratio=8, anchor_rank=128, position_anchors=True),
    "MAPL 16x, anchor rank 64, position anchors": _earlier(ratio=16, anchor_rank=64, position_anchors=True),
    "MAPL 8x, anchor rank 64, position anchors, anchors from the embedding": MaplConfig(
        ratio=8, anchor_rank=64, position_anchors=True, anchor_init="embedding"),
    "MAPL 8x, anchor rank 128, position anchors, anchors from the embedding": MaplConfig(
        ratio=8, anchor_rank=128, position_anchors=True, anchor_init="embedding"),
    "MAPL 16x, anchor rank 64, position anchors, anchors from the embedding": MaplConfig(
        ratio=16, anchor_rank=64, position_anchors=True, anchor_init="embedding"),
}
