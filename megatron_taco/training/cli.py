"""Command line of the self-contained trainer (``examples/pretrain_gpt.py``).

Flags use Megatron-LM's names. A ``--config`` YAML supplies defaults (its
``model`` section is a :class:`ModelShape`, its ``training`` section holds
flag values with ``_`` for ``-``); flags given on the command line win.

A bad flag, value, combination, config file or checkpoint stops the run at
start-up with one line on rank 0 (a :class:`StartupError`, exit code 2); so
does Ctrl-C (exit code 130), after the run summary. No rank prints a traceback
or a usage block.

Every ``--taco-log-interval`` steps rank 0 prints TACO's traffic (its own linears)
and MAPL's (every boundary, all ranks); at the end, or at Ctrl-C, a run summary:
steps, mean tokens/s after the first step, final losses, and bytes sent against
uncompressed per mechanism (see :func:`summary_lines`).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import time
from typing import Any, Dict, List, NoReturn, Optional, Tuple

import torch
import torch.distributed as dist
import yaml

from megatron_taco.config.mapl import add_mapl_args, mapl_config_from_args
from megatron_taco.mapl import telemetry as mapl_telemetry
from megatron_taco.mapl.telemetry import MAPL_TELEMETRY
from megatron_taco.mapl.vq import index_bytes, packed_width
from megatron_taco.mapl.wire import describe_compression, wire_codec
from megatron_taco.config.errors import ConfigError, TrainConfigError
from megatron_taco.codec.taco import describe_backend
from megatron_taco.config.taco import (
    TacoConfig,
    TacoConfigError,
    add_taco_args,
    check_backend_runs_here,
    check_switch_before_end,
    taco_config_from_args,
)
from megatron_taco.megatron.telemetry import TELEMETRY, TrafficRecord
from megatron_taco.training.checkpoint import check_saved_layout, latest_step, load_checkpoint, save_checkpoint
from megatron_taco.training.data import byte_text_batches, stdlib_text_files, synthetic_batches
from megatron_taco.training.loop import DTYPES, LR_DECAY_STYLES, Trainer, TrainConfig, init_distributed
from megatron_taco.training.model import ModelShape

__all__ = [
    "add_lr_schedule_args",
    "lr_schedule_settings",
    "lr_schedule_flags",
    "StartupError",
    "parse_args",
    "startup_config",
    "main",
]


def add_lr_schedule_args(parser, length_flag: str) -> None:
    """--min-lr, --lr-warmup-iters, --lr-decay-style, --lr-decay-iters (Megatron-LM's names; the decay
    length defaults to the run's length, ``length_flag``)."""
    parser.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay")
    parser.add_argument("--lr-warmup-iters", type=int, default=0, help="steps of linear warm-up from 0 to --lr")
    parser.add_argument(
        "--lr-decay-style",
        choices=LR_DECAY_STYLES,
        default="constant",
        help="decay after the warm-up (MAPL's manifold learning rate follows the same factor)",
    )
    parser.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help=f"steps from the start to the end of the decay (default: {length_flag})",
    )


def lr_schedule_settings(args: argparse.Namespace, length: int) -> Dict[str, Any]:
    """The schedule flags as TrainConfig fields (the decay ends at ``length`` unless --lr-decay-iters says)."""
    return dict(
        min_lr=args.min_lr,
        lr_warmup_iters=args.lr_warmup_iters,
        lr_decay_style=args.lr_decay_style,
        lr_decay_iters=args.lr_decay_iters or length,
    )


def lr_schedule_flags(args: argparse.Namespace) -> str:
    """The schedule flags as given, for a report's command line ('' for the default constant lr)."""
    if not args.lr_warmup_iters and args.lr_decay_style == "constant":
        return ""
    return (
        f"--lr-warmup-iters {args.lr_warmup_iters} --lr-decay-style {args.lr_decay_style} --min-lr {args.min_lr:g} "
        + (f"--lr-decay-iters {args.lr_decay_iters} " if args.lr_decay_iters else "")
    )


def add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("training")
    group.add_argument("--config", help="YAML file with a model section and training defaults")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument(
        "--virtual-pipeline-model-parallel-size",
        type=int,
        default=None,
        help="model chunks per pipeline stage (interleaved 1F1B schedule)",
    )
    group.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=False)
    group.add_argument("--micro-batch-size", type=int, default=2)
    group.add_argument(
        "--global-batch-size", type=int, default=None, help="default: micro-batch-size x data-parallel size"
    )
    group.add_argument("--train-iters", type=int, default=10)
    group.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    add_lr_schedule_args(group, "--train-iters")
    group.add_argument("--weight-decay", type=float, default=0.0)
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--log-interval", type=int, default=1)
    group.add_argument(
        "--data",
        default="synthetic",
        help="synthetic (a learnable token stream), stdlib (the Python standard library's sources, "
        "byte-level) or a directory of text files (byte-level)",
    )
    group.add_argument(
        "--eval-interval",
        type=int,
        default=0,
        help="steps between validation runs (0: only at the end when --eval-iters > 0)",
    )
    group.add_argument("--eval-iters", type=int, default=0, help="validation steps per evaluation")
    group.add_argument("--save", default=None, help="directory for checkpoints")
    group.add_argument("--save-interval", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    group.add_argument("--load", default=None, help="resume from the newest checkpoint in this directory")
    group.add_argument(
        "--tensorboard-dir", default=None, help="write loss, TACO and MAPL telemetry scalars here (rank 0)"
    )
    return parser


class StartupError(ValueError):
    """A bad flag, value, combination, config file or checkpoint, found before training (the message names it)."""


def _rank() -> int:
    """This process's rank, also before torch.distributed is initialised (torchrun's RANK; 0 without it)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    """The number of ranks, also before torch.distributed is initialised (torchrun's WORLD_SIZE; 1 without it)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


class _Parser(argparse.ArgumentParser):
    """argparse that raises StartupError instead of printing a usage block, and prints --help on rank 0 only."""

    def error(self, message: str) -> NoReturn:
        raise StartupError(f"{message} (see --help)")

    def print_help(self, file=None) -> None:
        if _rank() == 0:
            super().print_help(file)


# The smallest value of each count flag (--global-batch-size may also be left unset: None).
_FLAG_MINIMUMS = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "micro_batch_size": 1,
    "global_batch_size": 1,
    "train_iters": 1,
    "log_interval": 1,
    "eval_interval": 0,
    "eval_iters": 0,
    "save_interval": 0,
}
_SECTION_PREFIXES = {"training": "", "taco": "taco_", "mapl": "mapl_"}


def _check_counts(args: argparse.Namespace) -> None:
    for dest, minimum in _FLAG_MINIMUMS.items():
        value = getattr(args, dest)
        if value is not None and value < minimum:
            raise StartupError(f"--{dest.replace('_', '-')}: invalid value {value}; expected an integer >= {minimum}")


def _yaml_problem(exc: Exception) -> str:
    """A YAML parser's complaint in one line: what and where."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        return f"{exc.problem} at line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}"
    return " ".join(str(exc).split())


def _read_config(path: str) -> Dict[str, Any]:
    """The --config YAML document: a mapping of sections to mappings."""
    try:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    except OSError as exc:
        raise StartupError(f"--config {path}: {exc.strerror} ({os.path.abspath(path)})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise StartupError(f"--config {path}: not valid YAML: {_yaml_problem(exc)}") from None
    sections = ["model", *_SECTION_PREFIXES]
    if not isinstance(doc, dict):
        raise StartupError(f"--config {path}: expected a mapping of the sections {sections}, got {type(doc).__name__}")
    unknown_sections = sorted(set(doc) - set(sections))
    if unknown_sections:
        raise StartupError(f"--config {path}: unknown sections {unknown_sections}; known: {sections}")
    for section, values in doc.items():
        if values is not None and not isinstance(values, dict):
            raise StartupError(
                f"--config {path}: section {section} must be a mapping of keys to values, got {values!r}"
            )
    return doc


def _section_keys(parser: argparse.ArgumentParser, prefix: str) -> List[str]:
    """The keys a config section takes: its flags' names without ``prefix``, with ``_`` for ``-``."""
    dests = {action.dest for action in parser._actions} - {"help", "config"}
    if prefix:
        return sorted(dest[len(prefix) :] for dest in dests if dest.startswith(prefix))
    return sorted(dest for dest in dests if not dest.startswith(("taco_", "mapl_")))


def _apply_config_defaults(parser: argparse.ArgumentParser, argv: List[str]) -> Dict[str, Any]:
    """Read ``--config`` (if any), set its flag values as parser defaults; return its model section.

    Sections: ``training`` (trainer flags), ``taco`` and ``mapl`` (the --taco-* / --mapl-* flags
    without their prefix). Keys use ``_`` for ``-``; a null value keeps the flag's default.
    """
    pre = _Parser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return {}
    doc = _read_config(known.config)
    defaults = {}
    for section, prefix in _SECTION_PREFIXES.items():
        values = doc.get(section) or {}
        allowed = _section_keys(parser, prefix)
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise StartupError(
                f"--config {known.config}: unknown keys {unknown} in section {section}; known: {allowed}"
            )
        defaults.update({prefix + key: value for key, value in values.items() if value is not None})
    parser.set_defaults(**defaults)
    return doc.get("model") or {}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The trainer's flags over the --config defaults, checked one by one (StartupError names the flag)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = add_mapl_args(add_taco_args(add_training_args(_Parser(description=__doc__))))
    model = _apply_config_defaults(parser, argv)
    args = parser.parse_args(argv)
    _check_counts(args)
    try:
        args.taco = taco_config_from_args(args)
        check_switch_before_end(args.taco, args.train_iters)
        args.mapl = mapl_config_from_args(args, model.get("hidden_size"), DTYPES[args.dtype].itemsize)
    except ConfigError as exc:  # the --taco-* and --mapl-* families
        raise StartupError(str(exc)) from None
    args.taco_unused = None  # at TP=1 (e.g. a config's TACO mode in a PP-only run) TACO is off, and the log says so
    if args.taco.enabled and args.tensor_model_parallel_size == 1:
        args.taco_unused = (
            f"TACO off: --tensor-model-parallel-size 1 has no tensor-parallel traffic, so --taco-mode "
            f"{args.taco.default.describe_modes()} (and its overrides) compress nothing here"
        )
        args.taco = TacoConfig()
    if not model:
        raise StartupError("--config with a model section is required")
    try:
        args.shape = ModelShape.from_dict(model)
    except (TypeError, ValueError) as exc:
        raise StartupError(f"--config {args.config}: model section: {exc}") from None
    return args


def text_files(source: str, shape: ModelShape) -> Tuple[List[pathlib.Path], List[pathlib.Path]]:
    """(training files, validation files) of a byte-level text --data source; ValueError naming --data when the
    model or the source cannot be used (checked at start-up, and again when the data is read)."""
    if shape.vocab_size < 256:
        raise ValueError(
            f"--data {source} is byte-level text: the model's vocab_size must be >= 256, got {shape.vocab_size}"
        )
    if source == "stdlib":
        return stdlib_text_files()
    root = pathlib.Path(source)
    if not root.exists():
        raise ValueError(f"--data {source}: no such file or directory")
    files = sorted(p for p in (root.rglob("*") if root.is_dir() else [root]) if p.is_file())
    if len(files) < 2:
        raise ValueError(f"--data {source}: need at least 2 text files (one is held out for validation)")
    return files[1:], files[:1]


def make_data(source: str, cfg: TrainConfig, seed: int, data_parallel_rank: int):
    """(train iterator, validation iterator or None) for --data."""
    shape = cfg.shape
    if source == "synthetic":
        train = synthetic_batches(shape.vocab_size, shape.seq_length, cfg.micro_batch_size, seed, data_parallel_rank)
        valid = synthetic_batches(
            shape.vocab_size, shape.seq_length, cfg.micro_batch_size, seed + 1, data_parallel_rank
        )
        return train, valid
    train_files, valid_files = text_files(source, shape)
    train = byte_text_batches(train_files, shape.seq_length, cfg.micro_batch_size, seed, data_parallel_rank)
    valid = byte_text_batches(valid_files, shape.seq_length, cfg.micro_batch_size, seed + 1, data_parallel_rank)
    return train, valid


def _num_microbatches(args: argparse.Namespace, data_parallel: int) -> int:
    per_step = args.micro_batch_size * data_parallel
    global_batch = args.global_batch_size or per_step
    if global_batch % per_step:
        raise TrainConfigError(
            f"--global-batch-size {global_batch}: must be a multiple of --micro-batch-size x data-parallel size "
            f"= {args.micro_batch_size} x {data_parallel} = {per_step}"
        )
    return global_batch // per_step


def _check_tensorboard() -> None:
    """--tensorboard-dir needs the tensorboard package: checked on every rank before any of them starts (a rank
    that stopped alone at its writer would leave the others failing in their first collective)."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        raise StartupError("--tensorboard-dir needs the tensorboard package (pip install tensorboard)") from None


def _tensorboard_writer(directory: Optional[str]):
    """A SummaryWriter on rank 0 when --tensorboard-dir is given (None otherwise; startup_config checked it)."""
    if not directory or dist.get_rank() != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=directory)


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


def _check_resume(load: str, train_iters: int, cfg: TrainConfig, world_size: int) -> None:
    step = latest_step(load)
    if step is None:
        raise StartupError(f"--load {load}: no checkpoint (missing {os.path.join(load, 'latest')})")
    if step >= train_iters:
        raise StartupError(
            f"--load {load}: its checkpoint is at step {step}, so --train-iters {train_iters} leaves "
            f"nothing to train; use --train-iters > {step}"
        )
    try:
        check_saved_layout(load, step, cfg, world_size)
    except ValueError as exc:
        raise StartupError(str(exc)) from None


def startup_config(args: argparse.Namespace, world_size: int) -> TrainConfig:
    """The run's TrainConfig on ``world_size`` ranks, after every check that needs no model (StartupError
    names the flag). The trainer runs it before it initialises torch.distributed or builds anything."""
    data_parallel = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    try:
        cfg = _train_config(args, data_parallel)
    except ValueError as exc:  # a ConfigError (invalid combinations: the message names the flags), or a codec's
        raise StartupError(str(exc)) from None
    try:
        check_backend_runs_here(args.taco.backend)
    except TacoConfigError as exc:
        raise StartupError(str(exc)) from None
    if args.data != "synthetic":
        try:
            text_files(args.data, cfg.shape)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
    if args.load:
        _check_resume(args.load, args.train_iters, cfg, world_size)
    if args.tensorboard_dir:
        _check_tensorboard()
    return cfg


_interrupt_requested = False


def _request_interrupt(signum, frame) -> None:
    """SIGINT: stop at the next step boundary. Raising here could break a rank out of a collective half-way
    through (its peers then fail inside theirs), and under torchrun each Ctrl-C arrives twice."""
    global _interrupt_requested
    _interrupt_requested = True


def _interrupt_agreed(device: torch.device) -> bool:
    """Whether any rank got Ctrl-C; all ranks ask at the same step boundary, so they all stop there."""
    flag = torch.tensor([float(_interrupt_requested)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _exit_with_line(message: str, code: int) -> NoReturn:
    if _rank() == 0:
        print(message, file=sys.stderr, flush=True)
    raise SystemExit(code)


class RunRecord:
    """What the end-of-run summary reports, gathered step by step (every rank keeps the same)."""

    def __init__(self, start: int, train_iters: int, tokens_per_step: int) -> None:
        self.start, self.train_iters, self.tokens_per_step = start, train_iters, tokens_per_step
        self.elapsed: List[float] = []  # seconds of each step run, in order
        self.loss: Optional[float] = None
        self.validation: Optional[tuple] = None  # (step, loss) of the last evaluation
        self.began = time.perf_counter()

    def add_step(self, elapsed: float, loss: float) -> None:
        self.elapsed.append(elapsed)
        self.loss = loss

    @property
    def last_step(self) -> int:
        return self.start + len(self.elapsed)

    def steps_line(self, stopped: Optional[str]) -> str:
        """Steps run, where from, and the mean throughput of the steps after the first (it includes start-up)."""
        count, first, last = len(self.elapsed), self.start + 1, self.last_step
        head = f"run summary{f', stopped by Ctrl-C {stopped}' if stopped else ''}: "
        if not count:
            return head + f"no steps run{f' (resumed at step {self.start})' if self.start else ''}"
        span = f"{first}-{last}" if count > 1 else f"{first}"
        resumed = f", resumed from step {self.start}" if self.start else ""
        line = (
            f"{head}{count} step{'s' if count > 1 else ''} ({span} of {self.train_iters}{resumed}) in "
            f"{time.perf_counter() - self.began:.1f} s; "
        )
        first_rate = self.tokens_per_step / self.elapsed[0]
        if count == 1:
            return line + f"{first_rate:.0f} tokens/s (one step, start-up included)"
        mean = self.tokens_per_step * (count - 1) / sum(self.elapsed[1:])
        after = f"steps {first + 1}-{last}" if count > 2 else f"step {last}"
        return line + (
            f"{mean:.0f} tokens/s mean over {after} (step {first}, with start-up: {first_rate:.0f} tokens/s)"
        )

    def loss_line(self) -> Optional[str]:
        if self.loss is None:
            return None
        line = f"run summary: final loss {self.loss:.4f} (step {self.last_step})"
        if self.validation is not None:
            line += f"; final validation loss {self.validation[1]:.4f} (step {self.validation[0]})"
        return line


def _taco_summary(total: TrafficRecord, validated: bool) -> str:
    err = f"{total.mean_error:.4f}" if total.mean_error is not None else "-"
    scope = "whole run with validation" if validated else "whole run"
    return (
        f"run summary: TACO tensor-parallel traffic, all ranks, {scope}: "
        f"{mapl_telemetry.compared(total.payload_bytes, total.wire_bytes, summary=True)}; "
        f"{total.compressed_calls} of {total.calls} messages compressed, sampled rel.err {err}"
    )


def _mapl_summary(traffic: List[mapl_telemetry.BoundaryTraffic], steps: int, pipeline_parallel: int) -> List[str]:
    lines = [
        f"run summary: MAPL {mapl_telemetry.boundary_name(g, pipeline_parallel)} per training step, all ranks: "
        f"{mapl_telemetry.describe_boundary(t, steps, summary=True)}"
        for g, t in enumerate(traffic)
    ]
    lines.append(
        f"run summary: MAPL total, {steps} training step{'s' if steps != 1 else ''}, all boundaries and "
        f"ranks: {mapl_telemetry.describe_total(traffic, summary=True)}"
    )
    return lines


def summary_lines(
    run: RunRecord, args: argparse.Namespace, cfg: TrainConfig, device: torch.device, stopped: Optional[str] = None
) -> List[str]:
    """The end-of-run summary: steps and tokens/s, final losses, bytes sent vs uncompressed per mechanism.

    Adds the traffic up over all ranks (collectives): every rank calls it at the same step boundary."""
    lines = [run.steps_line(stopped)]
    loss = run.loss_line()
    if loss:
        lines.append(loss)
    if args.taco.enabled and run.elapsed:
        lines.append(_taco_summary(TELEMETRY.run_total().summed_over_ranks(device), run.validation is not None))
    if args.mapl is not None and run.elapsed:
        traffic = MAPL_TELEMETRY.summed(len(cfg.mapl_widths), device, run=True)
        lines += _mapl_summary(traffic, len(run.elapsed), cfg.pipeline_parallel)
    return lines


def main(argv: Optional[List[str]] = None) -> List[float]:
    """Train as the flags say; return the loss of every step run.

    A StartupError ends every rank with exit code 2, Ctrl-C (at the next step boundary) with 130; rank 0
    prints one line (after the run summary, for Ctrl-C).
    """
    signal.signal(signal.SIGINT, _request_interrupt)
    try:
        return _train(parse_args(argv))
    except StartupError as exc:
        _exit_with_line(f"error: {exc}", 2)
    except KeyboardInterrupt as exc:
        _exit_with_line(f"interrupted (Ctrl-C) {exc}", 130)


def _vq_wire(args: argparse.Namespace, trainer: Trainer) -> str:
    """The forward bytes per token of the index wire: L indices, padded to whole elements of the pipeline dtype."""
    indices = args.mapl.vq_levels * index_bytes(args.mapl.vq_codes)
    dtype = trainer.config.pipeline_dtype
    sent = packed_width(args.mapl.vq_levels, args.mapl.vq_codes, dtype) * torch.empty((), dtype=dtype).element_size()
    return (
        f"{indices} bytes/token forward"
        if sent == indices
        else f"{indices} index bytes/token forward, sent as {sent} bytes in {str(dtype).replace('torch.', '')}"
    )


def _train(args: argparse.Namespace) -> List[float]:
    cfg = startup_config(args, _world_size())
    init_distributed()
    data_parallel = dist.get_world_size() // (cfg.tensor_parallel * cfg.pipeline_parallel)
    try:
        trainer = Trainer(cfg)
    except ValueError as exc:  # a layout the world cannot hold, a dtype the device cannot train: the flag is named
        raise StartupError(str(exc)) from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _log(
        f"megatron_taco trainer: world {dist.get_world_size()} TP {cfg.tensor_parallel} "
        f"PP {cfg.pipeline_parallel} DP {data_parallel} SP {cfg.sequence_parallel} on {device}, "
        f"{cfg.num_microbatches} micro-batches of {cfg.micro_batch_size} x {cfg.shape.seq_length} tokens; "
        f"{cfg.lr_schedule_summary}"
    )
    if args.taco_unused:
        _log(args.taco_unused)
    if args.taco.enabled:
        _log(
            f"TACO {args.taco.default.describe_modes()} on this rank's layers: {trainer.taco_attached.describe()}"
            f"{args.taco.describe_switch()}; "
            f"min-bytes {'auto' if args.taco.min_bytes is None else args.taco.min_bytes}; codec "
            f"{describe_backend(args.taco.backend, device == 'cuda')}"
        )
    if args.mapl is not None:
        widths = cfg.mapl_widths
        element = trainer.config.pipeline_dtype.itemsize
        ratios = [describe_compression(cfg.shape.hidden_size, r, wire_codec(args.mapl, r), element) for r in widths]
        _log(
            f"MAPL: {len(widths)} boundar{'y' if len(widths) == 1 else 'ies'}, hidden {cfg.shape.hidden_size} -> "
            f"{widths} "
            f"({', '.join(ratios)}), "
            f"anchor rank {args.mapl.anchor_rank}"
            + (", position anchors" if cfg.mapl_position_anchors else "")
            + (
                f", context anchors for {args.mapl.context_anchors} previous tokens"
                if args.mapl.context_anchors
                else ""
            )
            + (", fixed projection" if args.mapl.fixed_projection else "")
            + (
                f", residual VQ {args.mapl.vq_levels} x {args.mapl.vq_codes} codes ({_vq_wire(args, trainer)})"
                if args.mapl.vq_levels
                else ""
            )
            + (f"; {args.mapl.wire_choice}" if args.mapl.wire_choice else "")
            + args.mapl.describe_warmup(args.train_iters, trainer.cfg.shape.hidden_size)
        )
    try:  # a --data source or a --load checkpoint this run cannot use: the message names the flag
        # one identical stream per model chunk (the interleaved schedule reads each chunk's own)
        streams = [make_data(args.data, cfg, args.seed, trainer.data_parallel_rank) for _ in trainer.models]
        start = load_checkpoint(trainer, args.load) if args.load else 0
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    data = [train for train, _ in streams] if len(streams) > 1 else streams[0][0]
    valid = [v for _, v in streams] if len(streams) > 1 else streams[0][1]
    if args.load:
        for stream in data if isinstance(data, list) else [data]:
            for _ in range(start * cfg.num_microbatches):  # the data stream is deterministic: skip what was consumed
                next(stream)
        _log(f"resumed from {args.load} at step {start}")
    writer = _tensorboard_writer(args.tensorboard_dir)
    tokens_per_step = cfg.micro_batch_size * cfg.num_microbatches * data_parallel * cfg.shape.seq_length
    interval = args.taco.log_interval  # --taco-log-interval: TACO's and MAPL's telemetry lines
    TELEMETRY.start_run()
    MAPL_TELEMETRY.start_run()
    run = RunRecord(start, args.train_iters, tokens_per_step)
    losses = []
    stopped = None
    try:
        for step in range(start + 1, args.train_iters + 1):
            if _interrupt_agreed(trainer.device):
                stopped = f"after step {step - 1} of {args.train_iters}"
                break
            began = time.perf_counter()
            stats = trainer.train_step(data)
            elapsed = time.perf_counter() - began
            if stats["taco_switched"] is not None:
                _log(
                    f"TACO after iteration {args.taco.switch[0]} on this rank's layers: {stats['taco_switched'].describe()}"
                )
            losses.append(stats["loss"])
            run.add_step(elapsed, stats["loss"])
            if writer is not None:
                writer.add_scalar("lm loss", stats["loss"], step)
            if step % args.log_interval == 0 or step == args.train_iters:
                _log(
                    f"step {step}/{args.train_iters} | loss {stats['loss']:.4f} | lr {stats['lr']:.3g} | "
                    f"grad norm {stats['grad_norm']:.3f} | {tokens_per_step / elapsed:.0f} tokens/s"
                    + (" | skipped" if stats["skipped"] else "")
                    + (f" | {stats['codebook_rows']} code words synced" if args.mapl and args.mapl.vq_levels else "")
                )
            if (
                valid is not None
                and args.eval_iters
                and ((args.eval_interval and step % args.eval_interval == 0) or step == args.train_iters)
            ):
                run.validation = (step, trainer.evaluate(valid, args.eval_iters))
                _log(f"validation at step {step} | loss {run.validation[1]:.4f}")
            if args.save and ((args.save_interval and step % args.save_interval == 0) or step == args.train_iters):
                _log(f"saved checkpoint {save_checkpoint(trainer, args.save)}")
            if interval and step % interval == 0:
                _log_telemetry(args, cfg, trainer, writer, step, steps=step - max(start, step - interval))
        for line in summary_lines(run, args, cfg, trainer.device, stopped):
            _log(line)
    finally:
        trainer.close()
        if writer is not None:  # flushes the last scalars (the writer's thread would drop them at exit)
            writer.close()
    if stopped:
        raise KeyboardInterrupt(stopped)
    return losses


def _log_telemetry(args: argparse.Namespace, cfg: TrainConfig, trainer: Trainer, writer, step: int, steps: int) -> None:
    """TACO's lines (the linears of every pipeline stage at this rank's TP / DP position) and MAPL's (every
    boundary, all ranks); both are collectives. They cover the last ``steps`` steps and go to the log and
    TensorBoard; then a new interval starts."""
    if args.taco.enabled:
        records = TELEMETRY.pipeline_records()  # every stage's layers
        for line in TELEMETRY.format_lines(records):
            _log(line)
        if writer is not None:
            TELEMETRY.write_tensorboard(writer, step, records)
        TELEMETRY.reset()
    if args.mapl is not None:
        traffic = MAPL_TELEMETRY.summed(len(cfg.mapl_widths), trainer.device)
        for line in mapl_telemetry.format_lines(traffic, steps, cfg.pipeline_parallel):
            _log(line)
        if writer is not None:
            mapl_telemetry.write_tensorboard(writer, step, traffic, steps)
        MAPL_TELEMETRY.reset()
