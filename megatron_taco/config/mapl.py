"""MAPL flags -> a validated config object (learned Stiefel projections at pipeline boundaries)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron_taco.config.taco import TacoConfigError


class MaplConfigError(TacoConfigError):
    """An invalid --mapl-* flag value or combination (the message names the flag)."""


@dataclasses.dataclass(frozen=True)
class MaplConfig:
    """rank: wire width r of every boundary (hidden d -> r); ratio d / r is the compression."""

    rank: Optional[int] = None
    ratio: Optional[float] = None
    anchor_rank: int = 16
    lr: float = 0.01
    momentum: float = 0.9
    fixed_projection: bool = False

    def wire_rank(self, hidden_size: int) -> int:
        """r for a model of hidden size d, checked against it."""
        if self.rank is not None:
            r = self.rank
            if not 0 < r <= hidden_size:
                raise MaplConfigError(f"--mapl-rank: invalid value {r}; needs 0 < rank <= hidden size {hidden_size}")
            return r
        r = hidden_size / self.ratio
        if r != int(r) or r < 1:
            raise MaplConfigError(
                f"--mapl-ratio: invalid value {self.ratio:g}; hidden size {hidden_size} / ratio must be a whole number >= 1"
            )
        return int(r)

    def check_layout(self, pipeline_parallel: int) -> None:
        if pipeline_parallel < 2:
            raise MaplConfigError("--mapl-ratio/--mapl-rank need --pipeline-model-parallel-size > 1 (MAPL compresses "
                                  "pipeline boundaries)")


def add_mapl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("MAPL: learned projections of pipeline activations")
    group.add_argument("--mapl-ratio", type=float, default=None, help="compression d / r at every boundary, e.g. 8")
    group.add_argument("--mapl-rank", type=int, default=None, help="wire width r at every boundary (instead of a ratio)")
    group.add_argument("--mapl-anchor-rank", type=int, default=16, help="rank k of the token anchors E[t] B (0: none)")
    group.add_argument("--mapl-lr", type=float, default=0.01, help="learning rate of the manifold optimizer")
    group.add_argument("--mapl-momentum", type=float, default=0.9, help="momentum of the manifold optimizer")
    group.add_argument("--mapl-fixed-projection", action="store_true",
                       help="keep U at its random orthogonal start and use no anchors (the SSN-style baseline)")
    return parser


def mapl_config_from_args(args: argparse.Namespace) -> Optional[MaplConfig]:
    """None when MAPL is off; raises MaplConfigError naming the flag for invalid values."""
    if args.mapl_ratio is None and args.mapl_rank is None:
        return None
    if args.mapl_ratio is not None and args.mapl_rank is not None:
        raise MaplConfigError("--mapl-ratio and --mapl-rank: give one of them, not both")
    if args.mapl_ratio is not None and args.mapl_ratio < 1:
        raise MaplConfigError(f"--mapl-ratio: invalid value {args.mapl_ratio:g}; must be >= 1")
    if args.mapl_rank is not None and args.mapl_rank < 1:
        raise MaplConfigError(f"--mapl-rank: invalid value {args.mapl_rank}; must be >= 1")
    if args.mapl_anchor_rank < 0:
        raise MaplConfigError(f"--mapl-anchor-rank: invalid value {args.mapl_anchor_rank}; must be >= 0")
    if args.mapl_lr <= 0:
        raise MaplConfigError(f"--mapl-lr: invalid value {args.mapl_lr:g}; must be > 0")
    if not 0 <= args.mapl_momentum < 1:
        raise MaplConfigError(f"--mapl-momentum: invalid value {args.mapl_momentum:g}; must be in [0, 1)")
    return MaplConfig(
        rank=args.mapl_rank, ratio=args.mapl_ratio,
        anchor_rank=0 if args.mapl_fixed_projection else args.mapl_anchor_rank,
        lr=args.mapl_lr, momentum=args.mapl_momentum, fixed_projection=args.mapl_fixed_projection,
    )
