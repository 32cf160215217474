"""Command line of the self-contained trainer (``examples/pretrain_gpt.py``).

Flags use Megatron-LM's names. A ``--config`` YAML supplies defaults (its
``model`` section is a :class:`ModelShape`, its ``training`` section holds
flag values with ``_`` for ``-``); flags given on the command line win.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import yaml

from megatron_taco.config.mapl import add_mapl_args, mapl_config_from_args
from megatron_taco.mapl.vq import index_bytes
from megatron_taco.config.taco import TacoConfigError, add_taco_args, taco_config_from_args
from megatron_taco.megatron.telemetry import TELEMETRY
from megatron_taco.training.checkpoint import load_checkpoint, save_checkpoint
from megatron_taco.training.data import byte_text_batches, stdlib_text_files, synthetic_batches
from megatron_taco.training.loop import LR_DECAY_STYLES, Trainer, TrainConfig, init_distributed
from megatron_taco.training.model import ModelShape


def add_lr_schedule_args(parser, length_flag: str) -> None:
    """--min-lr, --lr-warmup-iters, --lr-decay-style, --lr-decay-iters (Megatron-LM's names; the decay
    length defaults to the run's length, ``length_flag``)."""
    parser.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay")
    parser.add_argument("--lr-warmup-iters", type=int, default=0, help="steps of linear warm-up from 0 to --lr")
    parser.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="constant",
                        help="decay after the warm-up (MAPL's manifold learning rate follows the same factor)")
    parser.add_argument("--lr-decay-iters", type=int, default=None,
                        help=f"steps from the start to the end of the decay (default: {length_flag})")


def lr_schedule_settings(args: argparse.Namespace, length: int) -> Dict[str, Any]:
    """The schedule flags as TrainConfig fields (the decay ends at ``length`` unless --lr-decay-iters says)."""
    return dict(min_lr=args.min_lr, lr_warmup_iters=args.lr_warmup_iters, lr_decay_style=args.lr_decay_style,
                lr_decay_iters=args.lr_decay_iters or length)


def lr_schedule_flags(args: argparse.Namespace) -> str:
    """The schedule flags as given, for a report's command line ('' for the default constant lr)."""
    if not args.lr_warmup_iters and args.lr_decay_style == "constant":
        return ""
    return (f"--lr-warmup-iters {args.lr_warmup_iters} --lr-decay-style {args.lr_decay_style} --min-lr {args.min_lr:g} "
            + (f"--lr-decay-iters {args.lr_decay_iters} " if args.lr_decay_iters else ""))


def add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("training")
    group.add_argument("--config", help="YAML file with a model section and training defaults")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                       help="model chunks per pipeline stage (interleaved 1F1B schedule)")
    group.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=False)
    group.add_argument("--micro-batch-size", type=int, default=2)
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="default: micro-batch-size x data-parallel size")
    group.add_argument("--train-iters", type=int, default=10)
    group.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    add_lr_schedule_args(group, "--train-iters")
    group.add_argument("--weight-decay", type=float, default=0.0)
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--log-interval", type=int, default=1)
    group.add_argument("--data", default="synthetic",
                       help="synthetic (a learnable token stream), stdlib (the Python standard library's sources, "
                            "byte-level) or a directory of text files (byte-level)")
    group.add_argument("--eval-interval", type=int, default=0, help="steps between validation runs (0: only at the end "
                       "when --eval-iters > 0)")
    group.add_argument("--eval-iters", type=int, default=0, help="validation steps per evaluation")
    group.add_argument("--save", default=None, help="directory for checkpoints")
    group.add_argument("--save-interval", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    group.add_argument("--load", default=None, help="resume from the newest checkpoint in this directory")
    group.add_argument("--tensorboard-dir", default=None, help="write loss and TACO telemetry scalars here (rank 0)")
    return parser


def _apply_config_defaults(parser: argparse.ArgumentParser, argv: List[str]) -> Dict[str, Any]:
    """Read ``--config`` (if any), set its flag values as parser defaults; return its model section.

    Sections: ``training`` (trainer flags), ``taco`` and ``mapl`` (the --taco-* / --mapl-* flags
    without their prefix). Keys use ``_`` for ``-``; a null value keeps the flag's default.
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return {}
    with open(known.config) as f:
        doc = yaml.safe_load(f) or {}
    unknown_sections = sorted(set(doc) - {"model", "training", "taco", "mapl"})
    if unknown_sections:
        parser.error(f"{known.config}: unknown sections {unknown_sections}; use model, training, taco, mapl")
    defaults = {}
    for section, prefix in (("training", ""), ("taco", "taco_"), ("mapl", "mapl_")):
        for key, value in (doc.get(section) or {}).items():
            if value is not None:
                defaults[prefix + key] = value
    dests = {action.dest for action in parser._actions}
    unknown = sorted(k for k in defaults if k not in dests)
    if unknown:
        parser.error(f"{known.config}: unknown keys {unknown}")
    parser.set_defaults(**defaults)
    return doc.get("model", {}) or {}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    parser = add_mapl_args(add_taco_args(add_training_args(argparse.ArgumentParser(description=__doc__))))
    model = _apply_config_defaults(parser, argv)
    args = parser.parse_args(argv)
    try:
        args.taco = taco_config_from_args(args)
        args.mapl = mapl_config_from_args(args)
    except TacoConfigError as exc:  # MaplConfigError is one too
        parser.error(str(exc))
    if not model:
        parser.error("--config with a model section is required")
    try:
        args.shape = ModelShape.from_dict(model)
    except (TypeError, ValueError) as exc:
        parser.error(f"{args.config}: model section: {exc}")
    return args


def make_data(source: str, cfg: TrainConfig, seed: int, data_parallel_rank: int):
    """(train iterator, validation iterator or None) for --data."""
    shape = cfg.shape
    if source == "synthetic":
        train = synthetic_batches(shape.vocab_size, shape.seq_length, cfg.micro_batch_size, seed, data_parallel_rank)
        valid = synthetic_batches(shape.vocab_size, shape.seq_length, cfg.micro_batch_size, seed + 1, data_parallel_rank)
        return train, valid
    if shape.vocab_size < 256:
        raise ValueError(f"--data {source} is byte-level text: the model's vocab_size must be >= 256, got {shape.vocab_size}")
    if source == "stdlib":
        train_files, valid_files = stdlib_text_files()
    else:
        root = pathlib.Path(source)
        if not root.exists():
            raise ValueError(f"--data {source}: no such file or directory")
        files = sorted(p for p in (root.rglob("*") if root.is_dir() else [root]) if p.is_file())
        if len(files) < 2:
            raise ValueError(f"--data {source}: need at least 2 text files (one is held out for validation)")
        train_files, valid_files = files[1:], files[:1]
    train = byte_text_batches(train_files, shape.seq_length, cfg.micro_batch_size, seed, data_parallel_rank)
    valid = byte_text_batches(valid_files, shape.seq_length, cfg.micro_batch_size, seed + 1, data_parallel_rank)
    return train, valid


def _num_microbatches(args: argparse.Namespace, data_parallel: int) -> int:
    per_step = args.micro_batch_size * data_parallel
    global_batch = args.global_batch_size or per_step
    if global_batch % per_step:
        raise ValueError(
            f"--global-batch-size {global_batch} is not divisible by --micro-batch-size x "
            f"data-parallel size = {args.micro_batch_size} x {data_parallel}"
        )
    return global_batch // per_step


def _tensorboard_writer(directory: Optional[str]):
    """A SummaryWriter on rank 0 when --tensorboard-dir is given (None otherwise)."""
    if not directory or dist.get_rank() != 0:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise SystemExit("error: --tensorboard-dir needs the tensorboard package (pip install tensorboard)") from None
    return SummaryWriter(log_dir=directory)


def _ranges(numbers: List[int]) -> str:
    """[1, 2, 3, 7] -> '1-3,7'."""
    parts, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(f"{start}-{n}" if n != start else f"{n}")
            start = None
    return ",".join(parts) or "none"


def _log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def _train_config(args: argparse.Namespace, data_parallel: int) -> TrainConfig:
    return TrainConfig(
        shape=args.shape,
        tensor_parallel=args.tensor_model_parallel_size,
        pipeline_parallel=args.pipeline_model_parallel_size,
        virtual_pipeline=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        micro_batch_size=args.micro_batch_size,
        num_microbatches=_num_microbatches(args, max(data_parallel, 1)),
        lr=args.lr,
        **lr_schedule_settings(args, args.train_iters),
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        dtype=args.dtype,
        seed=args.seed,
        taco=args.taco,
        mapl=args.mapl,
    )


def main(argv: Optional[List[str]] = None) -> List[float]:
    args = parse_args(argv)
    init_distributed()
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    data_parallel = dist.get_world_size() // model_parallel
    try:
        cfg = _train_config(args, data_parallel)
    except ValueError as exc:  # invalid combinations: the message names the flags
        raise SystemExit(f"error: {exc}") from None
    trainer = Trainer(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _log(
        f"megatron_taco trainer: world {dist.get_world_size()} TP {cfg.tensor_parallel} "
        f"PP {cfg.pipeline_parallel} DP {data_parallel} SP {cfg.sequence_parallel} on {device}, "
        f"{cfg.num_microbatches} micro-batches of {cfg.micro_batch_size} x {cfg.shape.seq_length} tokens; "
        f"{cfg.lr_schedule_summary}"
    )
    if args.taco.enabled:
        layers = {name: _ranges(numbers) for name, numbers in trainer.taco_layers.items()}
        _log(f"TACO {args.taco.default.mode} on this rank's layers {layers}; "
             f"min-bytes {'auto' if args.taco.min_bytes is None else args.taco.min_bytes}")
    if args.mapl is not None:
        widths = cfg.mapl_widths
        _log(f"MAPL: {len(widths)} boundaries, hidden {cfg.shape.hidden_size} -> {widths} "
             f"({', '.join(f'{cfg.shape.hidden_size / r:g}x' for r in widths)}), anchor rank {args.mapl.anchor_rank}"
             + (", position anchors" if cfg.mapl_position_anchors else "")
             + (f", context anchors for {args.mapl.context_anchors} previous tokens" if args.mapl.context_anchors else "")
             + (", fixed projection" if args.mapl.fixed_projection else "")
             + (f", residual VQ {args.mapl.vq_levels} x {args.mapl.vq_codes} codes "
                f"({args.mapl.vq_levels * index_bytes(args.mapl.vq_codes)} bytes/token forward)"
                if args.mapl.vq_levels else ""))
    # one identical stream per model chunk (the interleaved schedule reads each chunk's own)
    streams = [make_data(args.data, cfg, args.seed, trainer.data_parallel_rank) for _ in trainer.models]
    data = [train for train, _ in streams] if len(streams) > 1 else streams[0][0]
    valid = [v for _, v in streams] if len(streams) > 1 else streams[0][1]
    start = 0
    if args.load:
        start = load_checkpoint(trainer, args.load)
        for stream in data if isinstance(data, list) else [data]:
            for _ in range(start * cfg.num_microbatches):  # the data stream is deterministic: skip what was consumed
                next(stream)
        _log(f"resumed from {args.load} at step {start}")
    writer = _tensorboard_writer(args.tensorboard_dir)
    tokens_per_step = cfg.micro_batch_size * cfg.num_microbatches * data_parallel * cfg.shape.seq_length
    losses = []
    try:
        for step in range(start + 1, args.train_iters + 1):
            began = time.perf_counter()
            stats = trainer.train_step(data)
            elapsed = time.perf_counter() - began
            losses.append(stats["loss"])
            if writer is not None:
                writer.add_scalar("lm loss", stats["loss"], step)
            if step % args.log_interval == 0 or step == args.train_iters:
                _log(
                    f"step {step}/{args.train_iters} | loss {stats['loss']:.4f} | lr {stats['lr']:.3g} | "
                    f"grad norm {stats['grad_norm']:.3f} | {tokens_per_step / elapsed:.0f} tokens/s"
                    + (" | skipped" if stats["skipped"] else "")
                    + (f" | {stats['codebook_rows']} code words synced" if args.mapl and args.mapl.vq_levels else "")
                )
            if valid is not None and args.eval_iters and (
                (args.eval_interval and step % args.eval_interval == 0) or step == args.train_iters
            ):
                _log(f"validation at step {step} | loss {trainer.evaluate(valid, args.eval_iters):.4f}")
            if args.save and ((args.save_interval and step % args.save_interval == 0) or step == args.train_iters):
                _log(f"saved checkpoint {save_checkpoint(trainer, args.save)}")
            if args.taco.enabled and args.taco.log_interval and step % args.taco.log_interval == 0:
                for line in TELEMETRY.format_lines():
                    _log(line)
                if writer is not None:
                    TELEMETRY.write_tensorboard(writer, step)
                TELEMETRY.reset()
    finally:
        trainer.close()
    return losses
