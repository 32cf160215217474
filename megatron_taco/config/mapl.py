"""MAPL flags -> a validated config object (learned Stiefel projections at pipeline boundaries)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, List, Optional, Tuple

from megatron_taco.codec.narrow_int import narrow_int_rank
from megatron_taco.codec.topk import topk_count, topk_token_bytes
from megatron_taco.config.errors import MaplConfigError

__all__ = [
    "ANCHOR_INITS",
    "WIRES",
    "MaplConfig",
    "add_mapl_args",
    "auto_wire",
    "mapl_config_from_args",
    "width_flags",
    "width_mismatch",
]


ANCHOR_INITS = ("embedding", "random")
# what z travels as: "bf16" = the pipeline dtype; "fp8" = TACO's FP8 codec, at twice the rank for a ratio;
# "int5" = 5-bit integers (``codec.narrow_int``), the largest rank, a multiple of 16, within the ratio's bytes;
# "topk" = U square, each token's k largest values of z in FP8 and which they are (``codec.topk``)
WIRES = {"bf16": 1, "fp8": 2, "int5": None, "topk": None}  # wire: rank multiplier at a --mapl-ratio (None: own rule)
WIRE_GROUP = 16  # the FP8 and INT5 wires' rank must be a multiple of their codecs' smallest group
INT5_BITS = 5


@dataclasses.dataclass(frozen=True)
class MaplConfig:
    """rank: wire width r of every boundary (hidden d -> r); ratio d / r is the compression;
    ranks: one r per boundary, in pipeline order (boundary g joins pipeline positions g and g + 1);
    vq_levels > 0: residual VQ of z with that many codebooks of vq_codes codes (indices on the wire);
    wire: "bf16" (z in the pipeline dtype), "fp8" (z and dL/dz as FP8 codec messages; a ratio then means
    bytes per token, so r = 2d / ratio), "int5" (z and dL/dz as 5-bit integers; r the largest multiple of 16 whose
    bytes per token fit 2d / ratio: 1.5x the FP8 wire's rank) or "topk" (r = d; each token sends its k largest
    values of z in FP8 and their positions, k the most that keep the ratio in bytes: :meth:`topk_values`)."""

    rank: Optional[int] = None
    ratio: Optional[float] = None
    ranks: Optional[Tuple[int, ...]] = None
    # 64 beat 16 at 8x on GPU (+2.3% vs +3.6%, 1 seed) and CPU (benchmarks/results/archive/mapl/mapl_quality.md)
    anchor_rank: int = 64
    # also anchor the positions: None = wherever the model has learned absolute positions (3 of 3 seeds better
    # at 8x on CPU, benchmarks/results/archive/mapl/mapl_cpu_study_seeds.md); True = required; False = off
    position_anchors: Optional[bool] = None
    # where the anchors start: "embedding" = the best rank-k approximation of the model's input embedding
    # (8x gap +3.4% against +5.6% from "random" on CPU, 3 seeds, every seed better; 16x +3.9% against +8.0%:
    # benchmarks/results/archive/mapl/mapl_cpu_study_seeds.md)
    anchor_init: str = "embedding"
    # anchors for the previous n tokens too, (E[t_i] + sum_j C_j[t_{i-j}] + P[p]) B (0: off)
    context_anchors: int = 0
    lr: float = 0.01
    momentum: float = 0.9
    fixed_projection: bool = False
    vq_levels: int = 0
    vq_codes: int = 255
    vq_decay: float = 0.9
    vq_sync_rows: int = 0
    vq_sync_tolerance: float = 1e-3
    wire: str = "bf16"
    # a warm-up into the bottleneck: for the first N iterations the receiver gets h_rec + alpha (h - h_rec), alpha
    # from 1 down to 0 (d wide: on the FP8 / INT5 wire at rank d, else in the pipeline dtype), then MAPL's wire (0:
    # MAPL from the first iteration)
    warmup_steps: int = 0
    # how --mapl-wire auto chose ``wire``, for the start-up line (None: the wire was given); not part of the setting
    wire_choice: Optional[str] = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.wire not in WIRES:
            raise MaplConfigError(f"--mapl-wire: invalid value {self.wire!r}; choose from {', '.join(WIRES)}")
        if self.wire != "bf16" and self.vq_levels:
            raise MaplConfigError(f"--mapl-wire {self.wire} and --mapl-vq-levels: VQ sends indices; use one of them")
        if self.wire != "bf16" and self.ranks is not None:
            raise MaplConfigError(f"--mapl-wire {self.wire} needs one wire width for every boundary, not --mapl-ranks")
        if self.wire == "topk" and (self.ratio is None or self.rank is not None):
            raise MaplConfigError(
                "--mapl-wire topk with --mapl-rank: the top-k wire keeps every coordinate of z a candidate (U is "
                "d x d); give --mapl-ratio, which sets how many values each token sends"
            )
        if self.anchor_init not in ANCHOR_INITS:
            raise MaplConfigError(
                f"--mapl-anchor-init: invalid value {self.anchor_init!r}; choose from {', '.join(ANCHOR_INITS)}"
            )
        if self.warmup_steps < 0:
            raise MaplConfigError(f"--mapl-warmup-steps: invalid value {self.warmup_steps}; must be >= 0 (0: off)")
        if self.context_anchors < 0:
            raise MaplConfigError(f"--mapl-context-anchors: invalid value {self.context_anchors}; must be >= 0")
        if self.context_anchors and (self.anchor_rank == 0 or self.fixed_projection):
            raise MaplConfigError(
                "--mapl-context-anchors needs token anchors (--mapl-anchor-rank > 0, no "
                "--mapl-fixed-projection): the context tables share their basis"
            )

    def describe_warmup(self, train_iters: Optional[int], hidden_size: int) -> str:
        """``--mapl-warmup-steps`` for the start-up lines ("" when off); says so when a run of ``train_iters``
        iterations ends inside it (a run that a later one resumes with more may do that on purpose)."""
        if not self.warmup_steps:
            return ""
        inside = (
            f"; --train-iters {train_iters} ends inside the warm-up: this run never compresses"
            if train_iters and train_iters <= self.warmup_steps
            else ""
        )
        return (
            f"; warm-up: the first {self.warmup_steps} iterations send h_rec + alpha (h - h_rec) d wide "
            f"{self.warm_up_wire_name(hidden_size)}, alpha 1 -> 0 (--mapl-warmup-steps {self.warmup_steps}){inside}"
        )

    @property
    def codec_wire(self) -> bool:
        """Whether the boundary's messages go through a per-group codec (``--mapl-wire fp8`` / ``int5``), whose groups
        of 16 values the widths it carries must fill."""
        return self.wire in ("fp8", "int5")

    def warm_up_on_wire(self, hidden_size: int) -> bool:
        """Whether there is a warm-up and its d-wide messages go on the boundary's FP8 / INT5 wire (its codec at rank
        d, which needs d in groups of 16); else (bf16, top-k, whose k would drop most of h, VQ's index wire) they go
        in the pipeline dtype."""
        return bool(self.warmup_steps) and self.codec_wire and hidden_size % WIRE_GROUP == 0

    def warm_up_wire_name(self, hidden_size: int) -> str:
        """How the warm-up's d-wide messages travel, for the start-up line."""
        if self.warm_up_on_wire(hidden_size):
            return f"on the {self.wire.upper()} wire"
        if self.codec_wire and hidden_size % WIRE_GROUP:
            return f"in the pipeline dtype (hidden size {hidden_size}: not in groups of {WIRE_GROUP}, the {self.wire.upper()} codec's)"
        return "in the pipeline dtype"

    @property
    def uniform(self) -> bool:
        """Whether every boundary has the same width (else P2P shapes are exchanged at run time)."""
        return self.ranks is None or len(set(self.ranks)) == 1

    def anchors_positions(self, position_embedding: str) -> bool:
        """Whether the anchors include positions for a model with this position embedding type (auto: where
        it is ``learned_absolute``); raises for --mapl-position-anchors on without learned positions."""
        learned = position_embedding == "learned_absolute"
        if self.position_anchors and not learned:
            raise MaplConfigError(
                f"--mapl-position-anchors on: the model's position embedding is "
                f"{position_embedding!r}; position anchors stand in for a learned absolute position table in "
                "the residual stream (use auto or off)"
            )
        return self.position_anchors is not False and learned and self.anchor_rank > 0

    def wire_rank(self, hidden_size: int, boundary: int = 0) -> int:
        """r of ``boundary`` for a model of hidden size d, checked against it (and, with the FP8 wire, against the
        codec's groups of 16 to 128 values; with the INT5 wire, of 16 or 32)."""
        r = self._width(hidden_size, boundary)
        if self.codec_wire and r % WIRE_GROUP:
            given = "--mapl-rank" if self.rank is not None else "--mapl-ratio"
            raise MaplConfigError(
                f"--mapl-wire {self.wire} with {given}: the wire rank {r} (hidden size {hidden_size}) must be a "
                f"multiple of {WIRE_GROUP}"
            )
        return r

    def _width(self, hidden_size: int, boundary: int) -> int:
        if self.ranks is not None:
            r = self.ranks[boundary]
            if not 0 < r <= hidden_size:
                raise MaplConfigError(
                    f"--mapl-ranks: invalid value {r} for boundary {boundary}; needs "
                    f"0 < rank <= hidden size {hidden_size}"
                )
            return r
        if self.rank is not None:
            r = self.rank
            if not 0 < r <= hidden_size:
                raise MaplConfigError(f"--mapl-rank: invalid value {r}; needs 0 < rank <= hidden size {hidden_size}")
            return r
        if self.wire == "topk":
            self.topk_values(hidden_size)  # checked: at least one value fits the ratio
            return hidden_size
        if self.wire == "int5":
            r = min(narrow_int_rank(2 * hidden_size / self.ratio, INT5_BITS), hidden_size - hidden_size % WIRE_GROUP)
            if r < WIRE_GROUP:
                raise MaplConfigError(
                    f"--mapl-ratio {self.ratio:g} with --mapl-wire int5: {2 * hidden_size / self.ratio:g} bytes per "
                    f"token (hidden size {hidden_size} in bf16 / ratio) hold not even {WIRE_GROUP} values"
                    + (f", and the hidden size is below {WIRE_GROUP}" if hidden_size < WIRE_GROUP else "")
                )
            return r
        r = hidden_size * WIRES[self.wire] / self.ratio
        if r != int(r) or r < 1 or r > hidden_size:
            raise MaplConfigError(
                f"--mapl-ratio: invalid value {self.ratio:g}; hidden size {hidden_size}"
                + (f" x {WIRES[self.wire]} (--mapl-wire {self.wire})" if self.wire != "bf16" else "")
                + " / ratio must be a whole number in [1, hidden size]"
            )
        return int(r)

    def topk_values(self, hidden_size: int) -> int:
        """With ``wire="topk"``: k, the values each token sends, the most whose bytes (k FP8 codes, their
        positions, a scale byte) stay within d bf16 values / ratio."""
        k = topk_count(hidden_size, self.ratio)
        if k == 0:
            raise MaplConfigError(
                f"--mapl-ratio {self.ratio:g} with --mapl-wire topk: {2 * hidden_size / self.ratio:g} bytes per token "
                f"(hidden size {hidden_size} in bf16 / ratio) hold not even one value ({topk_token_bytes(hidden_size, 1)} "
                "bytes with its position and scale); lower the ratio"
            )
        return k

    def wire_ranks(self, hidden_size: int, pipeline_parallel: int, virtual_pipeline: Optional[int] = None) -> List[int]:
        """r of every boundary in pipeline order, checked against the layout and the hidden size."""
        return [self.wire_rank(hidden_size, b) for b in range(self.check_layout(pipeline_parallel, virtual_pipeline))]

    def check_layout(self, pipeline_parallel: int, virtual_pipeline: Optional[int] = None) -> int:
        """Validate against the pipeline layout; return the number of boundaries."""
        if pipeline_parallel < 2:
            raise MaplConfigError(
                "--mapl-ratio/--mapl-rank need --pipeline-model-parallel-size > 1 (MAPL compresses pipeline boundaries)"
            )
        boundaries = pipeline_parallel * (virtual_pipeline or 1) - 1
        if self.ranks is not None and len(self.ranks) != boundaries:
            raise MaplConfigError(f"--mapl-ranks: {len(self.ranks)} values given for {boundaries} pipeline boundaries")
        if self.vq_levels and not self.uniform:
            raise MaplConfigError(
                f"--mapl-vq-levels {self.vq_levels} needs one wire width for every boundary; "
                f"--mapl-ranks gives {','.join(map(str, self.ranks))}"
            )
        return boundaries


def width_flags(ratio: Optional[float], rank: Optional[int], ranks: Any, wire: Optional[str]) -> str:
    """The flags that set MAPL's tensor shapes (U's width at each boundary) as a command line gives them, for a
    resume check's message; a wire of None is bf16, the only wire of checkpoints saved before --mapl-wire."""
    values = {"--mapl-ratio": ratio, "--mapl-rank": rank, "--mapl-ranks": ranks, "--mapl-wire": wire or "bf16"}
    shown = {
        flag: f"{value:g}"
        if isinstance(value, float)
        else ",".join(map(str, value))
        if isinstance(value, tuple)
        else value
        for flag, value in values.items()
        if value is not None
    }
    return " ".join(f"{flag} {value}" for flag, value in shown.items())


def width_mismatch(
    load_dir: str, saved: Optional[str], now: Optional[str], wire_choice: Optional[str]
) -> Optional[str]:
    """The resume check's one line when a checkpoint's MAPL flags (:func:`width_flags`; None: MAPL off) differ from
    this run's (None when they agree); ``wire_choice`` says why auto chose this run's wire."""
    if saved == now:
        return None
    return (
        f"--load {load_dir}: its MAPL boundaries were saved with {saved or 'MAPL off'}, this run has "
        f"{now or 'MAPL off'}"
        + (f" ({wire_choice})" if wire_choice else "")
        + "; resume with the flags it was saved with"
    )


def add_mapl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("MAPL: learned projections of pipeline activations")
    group.add_argument("--mapl-ratio", type=float, default=None, help="compression d / r at every boundary, e.g. 8")
    group.add_argument(
        "--mapl-rank", type=int, default=None, help="wire width r at every boundary (instead of a ratio)"
    )
    group.add_argument(
        "--mapl-ranks", default=None, help="one wire width per boundary, in pipeline order, e.g. '64,32,64' (PP=4)"
    )
    group.add_argument(
        "--mapl-wire",
        choices=("auto", *WIRES),
        default="auto",
        help="what z travels as: auto (default) = with --mapl-ratio and a 2-byte pipeline dtype, the wire of most "
        "rank within the ratio's bytes (hidden 512: int5 at 4x-16x, fp8 at 2x and 32x), else bf16 "
        "(the start-up line says which and why); bf16 = the pipeline dtype; fp8 = TACO's FP8 codec forward and backward "
        "(Hadamard, a scale byte per group of up to 128 values; r a multiple of 16) at twice the rank, so "
        "--mapl-ratio keeps its bytes for a 2-byte pipeline dtype; int5 = 5-bit integers forward and backward "
        "(Hadamard, a scale byte per group of 32) at the largest rank, a multiple of 16, within --mapl-ratio's "
        "bytes (2d / ratio per token, as for d values in bf16, whatever the pipeline dtype; 1.5x the FP8 wire's "
        "rank); topk = U square, and each token sends only its "
        "k largest values of z in FP8 with their positions (both ways), k the most that keep --mapl-ratio in bytes",
    )
    group.add_argument("--mapl-anchor-rank", type=int, default=64, help="rank k of the token anchors E[t] B (0: none)")
    group.add_argument(
        "--mapl-position-anchors",
        choices=("auto", "on", "off"),
        default="auto",
        help="also anchor the positions, a(t, p) = (E[t] + P[p]) B, so that learned absolute position "
        "embeddings need no wire width; auto: on for such models, off for RoPE models",
    )
    group.add_argument(
        "--mapl-anchor-init",
        choices=ANCHOR_INITS,
        default="embedding",
        help="start of the anchors: embedding = the best rank-k approximation of the model's input "
        "embedding (token and, with position anchors, position tables); random = small noise",
    )
    group.add_argument(
        "--mapl-context-anchors",
        type=int,
        default=0,
        help="also anchor the previous N tokens, a = (E[t_i] + sum_j C_j[t_(i-j)] (+ P[p])) B, with "
        "the C_j learned from zero (0: off)",
    )
    group.add_argument(
        "--mapl-warmup-steps",
        type=int,
        default=0,
        help="a warm-up into the bottleneck: for the first N iterations each boundary sends h_rec + alpha (h - h_rec) "
        "d wide (h_rec: what MAPL's wire would deliver; alpha falls linearly from 1 to 0), on the FP8 / INT5 wire "
        "(its codec at rank d), else in the pipeline dtype, then z on MAPL's wire (0: off); validation during the "
        "warm-up sees the same blend",
    )
    group.add_argument("--mapl-lr", type=float, default=0.01, help="learning rate of the manifold optimizer")
    group.add_argument("--mapl-momentum", type=float, default=0.9, help="momentum of the manifold optimizer")
    group.add_argument(
        "--mapl-fixed-projection",
        action="store_true",
        help="keep U at its random orthogonal start and use no anchors (the SSN-style baseline)",
    )
    group.add_argument(
        "--mapl-vq-levels",
        type=int,
        default=0,
        help="residual VQ after the projection: number of codebooks L (0: off; indices go on the wire)",
    )
    group.add_argument(
        "--mapl-vq-codes",
        type=int,
        default=255,
        help="codes K per VQ codebook (2..65535; up to 255 an index is 1 byte on the wire)",
    )
    group.add_argument(
        "--mapl-vq-decay", type=float, default=0.9, help="EMA decay of the codebook statistics, per step"
    )
    group.add_argument(
        "--mapl-vq-sync-rows",
        type=int,
        default=0,
        help="most code words streamed to the receiver per step (0: every changed one)",
    )
    group.add_argument(
        "--mapl-vq-sync-tolerance",
        type=float,
        default=1e-3,
        help="a code word is re-sent once it moved by more than this fraction of its norm",
    )
    return parser


def auto_wire(
    ratio: Optional[float],
    vq_levels: int,
    hidden_size: Optional[int],
    element_size: Optional[int],
    decode_on_arrival: bool,
) -> Tuple[str, str]:
    """``--mapl-wire auto``: (wire, why). Of the wires that keep ``--mapl-ratio``'s bytes per token, the one of most
    rank (ties: the finer one), as the loss follows the rank (benchmarks/results/mapl_loopback.md, GPU, 1500 steps,
    5 seeds, against equal parameters): INT5 at 1.5x the FP8 wire's rank (8x +1.95%, 16x +3.11%), FP8 at twice the
    bf16 wire's (8x +2.47%, 16x +4.01%, 32x +6.04%; bf16 at 1000 steps: 8x +4.51%). bf16 where no codec wire
    applies, and why."""
    if ratio is None:
        return "bf16", "--mapl-rank / --mapl-ranks set the width of z in the pipeline dtype"
    if vq_levels:
        return "bf16", "--mapl-vq-levels sends code indices"
    if hidden_size is None or element_size is None:
        return "bf16", "the hidden size or pipeline dtype is not known before the model is built"
    if element_size != 2:
        return "bf16", f"the codec wires keep --mapl-ratio's bytes for a 2-byte pipeline dtype, not {element_size}-byte"
    if not decode_on_arrival:
        return (
            "bf16",
            "virtual pipeline stages overlap their P2P (--no-overlap-p2p-communication lets fp8 / int5 apply)",
        )
    ranks = {}  # wire: the rank it keeps within the ratio's bytes, where it applies
    for wire in ("bf16", "fp8"):
        r = WIRES[wire] * hidden_size / ratio
        if r == int(r) and 1 <= r <= hidden_size and (wire == "bf16" or r % WIRE_GROUP == 0):
            ranks[wire] = int(r)
    int5_rank = min(narrow_int_rank(2 * hidden_size / ratio, INT5_BITS), hidden_size - hidden_size % WIRE_GROUP)
    if int5_rank >= WIRE_GROUP:
        ranks["int5"] = int5_rank
    if not ranks:
        return "bf16", f"no wire keeps a whole rank of hidden size {hidden_size} at --mapl-ratio {ratio:g}"
    finer = ("int5", "fp8", "bf16")  # on equal rank, the wire of more bits per value
    best = max(ranks, key=lambda wire: (ranks[wire], finer.index(wire)))
    others = ", ".join(f"{wire.upper()} {rank}" for wire, rank in ranks.items() if wire != best)
    return best, f"the most rank within the ratio's bytes per token: {ranks[best]}" + (others and f" ({others})")


def mapl_config_from_args(
    args: argparse.Namespace,
    hidden_size: Optional[int] = None,
    element_size: Optional[int] = None,
    decode_on_arrival: bool = True,
) -> Optional[MaplConfig]:
    """None when MAPL is off; raises MaplConfigError naming the flag for invalid values.

    ``--mapl-wire auto`` resolves here (:func:`auto_wire`) from the model's hidden size and the bytes of an element
    of its pipeline dtype (None: not known yet, so bf16) and whether the pipeline schedule lets a wire decode P2P
    messages on arrival (not under virtual pipeline stages' overlapped P2P)."""
    given = [
        flag
        for flag, value in (
            ("--mapl-ratio", args.mapl_ratio),
            ("--mapl-rank", args.mapl_rank),
            ("--mapl-ranks", args.mapl_ranks),
        )
        if value is not None
    ]
    if not given:
        defaults = MaplConfig()
        orphans = [
            f"--mapl-{name.replace('_', '-')}"
            for name in (
                "anchor_rank",
                "context_anchors",
                "lr",
                "momentum",
                "vq_levels",
                "vq_codes",
                "vq_decay",
                "vq_sync_rows",
                "vq_sync_tolerance",
                "warmup_steps",
            )
            if getattr(args, f"mapl_{name}") != getattr(defaults, name)
        ]
        orphans += ["--mapl-fixed-projection"] if args.mapl_fixed_projection else []
        orphans += ["--mapl-position-anchors"] if args.mapl_position_anchors != "auto" else []
        orphans += ["--mapl-anchor-init"] if args.mapl_anchor_init != defaults.anchor_init else []
        orphans += ["--mapl-wire"] if args.mapl_wire != "auto" else []
        if orphans:
            raise MaplConfigError(
                f"{', '.join(orphans)} given without --mapl-ratio, --mapl-rank or --mapl-ranks (MAPL is off)"
            )
        return None
    if len(given) > 1:
        raise MaplConfigError(f"{' and '.join(given)}: give one of them, not several")
    ranks = None
    if args.mapl_ranks is not None:
        try:
            ranks = tuple(int(v) for v in str(args.mapl_ranks).split(","))
        except ValueError:
            raise MaplConfigError(
                f"--mapl-ranks: invalid value {args.mapl_ranks!r}; use integers like '64,32,64'"
            ) from None
        if any(r < 1 for r in ranks):
            raise MaplConfigError(f"--mapl-ranks: invalid value {args.mapl_ranks!r}; every rank must be >= 1")
    if args.mapl_ratio is not None and args.mapl_ratio < 1:
        raise MaplConfigError(f"--mapl-ratio: invalid value {args.mapl_ratio:g}; must be >= 1")
    if args.mapl_rank is not None and args.mapl_rank < 1:
        raise MaplConfigError(f"--mapl-rank: invalid value {args.mapl_rank}; must be >= 1")
    if args.mapl_anchor_rank < 0:
        raise MaplConfigError(f"--mapl-anchor-rank: invalid value {args.mapl_anchor_rank}; must be >= 0")
    if args.mapl_position_anchors == "on" and (args.mapl_anchor_rank == 0 or args.mapl_fixed_projection):
        raise MaplConfigError(
            "--mapl-position-anchors on needs token anchors (--mapl-anchor-rank > 0, no "
            "--mapl-fixed-projection): the position table shares their basis"
        )
    if args.mapl_lr <= 0:
        raise MaplConfigError(f"--mapl-lr: invalid value {args.mapl_lr:g}; must be > 0")
    if not 0 <= args.mapl_momentum < 1:
        raise MaplConfigError(f"--mapl-momentum: invalid value {args.mapl_momentum:g}; must be in [0, 1)")
    if args.mapl_vq_levels < 0:
        raise MaplConfigError(f"--mapl-vq-levels: invalid value {args.mapl_vq_levels}; must be >= 0 (0: no VQ)")
    if not 2 <= args.mapl_vq_codes <= 65535:
        raise MaplConfigError(
            f"--mapl-vq-codes: invalid value {args.mapl_vq_codes}; must be in [2, 65535] "
            "(one index value is reserved for non-finite tokens)"
        )
    if not 0 < args.mapl_vq_decay < 1:
        raise MaplConfigError(f"--mapl-vq-decay: invalid value {args.mapl_vq_decay:g}; must be in (0, 1)")
    if args.mapl_vq_sync_rows < 0:
        raise MaplConfigError(
            f"--mapl-vq-sync-rows: invalid value {args.mapl_vq_sync_rows}; must be >= 0 (0: no limit)"
        )
    if args.mapl_vq_sync_tolerance < 0:
        raise MaplConfigError(f"--mapl-vq-sync-tolerance: invalid value {args.mapl_vq_sync_tolerance:g}; must be >= 0")
    wire, wire_choice = args.mapl_wire, None
    if wire == "auto":
        wire, why = auto_wire(args.mapl_ratio, args.mapl_vq_levels, hidden_size, element_size, decode_on_arrival)
        wire_choice = f"--mapl-wire auto: {wire}, {why}"
    return MaplConfig(
        rank=args.mapl_rank,
        ratio=args.mapl_ratio,
        ranks=ranks,
        anchor_rank=0 if args.mapl_fixed_projection else args.mapl_anchor_rank,
        position_anchors={"auto": None, "on": True, "off": False}[args.mapl_position_anchors],
        anchor_init=args.mapl_anchor_init,
        context_anchors=args.mapl_context_anchors,
        lr=args.mapl_lr,
        momentum=args.mapl_momentum,
        fixed_projection=args.mapl_fixed_projection,
        vq_levels=args.mapl_vq_levels,
        vq_codes=args.mapl_vq_codes,
        vq_decay=args.mapl_vq_decay,
        vq_sync_rows=args.mapl_vq_sync_rows,
        vq_sync_tolerance=args.mapl_vq_sync_tolerance,
        wire=wire,
        wire_choice=wire_choice,
        warmup_steps=args.mapl_warmup_steps,
    )
