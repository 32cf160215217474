"""Run an unmodified Megatron-LM training script with TACO: ``python -m megatron_taco.launch SCRIPT [flags]``.

    python -m megatron_taco.launch /path/to/Megatron-LM/pretrain_gpt.py \\
        <Megatron-LM flags> --sequence-parallel --taco-mode fp8-ash [--taco-* ...]

The launcher puts the script's Megatron-LM checkout first on ``sys.path`` (before anything imports
``megatron``), then :func:`install_hooks` (also what ``patches/`` add to ``pretrain_gpt.py``):

1. adds the ``--taco-*`` and ``--mapl-*`` flags to Megatron-LM's argument parser
   (``megatron.training.arguments.parse_args`` chains them into its ``extra_args_provider``) and validates
   them when the arguments are parsed;
2. lets megatron-core's torch norm (``WrappedTorchNorm``, used when apex is missing) build an SP-capable
   norm under ``--sequence-parallel`` instead of refusing;
3. attaches the per-layer TACO settings to every GPTModel right after it is built, whatever spec
   function, builder or call pattern produced it: megatron-core's local linears and Transformer Engine's
   linears (``--transformer-impl local`` or ``transformer_engine``) send their TP traffic through TACO;
4. with ``--mapl-*``: attaches MAPL's boundary codecs to every GPTModel built and hooks Megatron-LM's batch,
   optimizer, gradient and schedule steps (:mod:`megatron_taco.mapl.megatron_lm` says where and why);
5. prints TACO's and MAPL's telemetry with Megatron-LM's training log.
Supported: Megatron-LM core_r0.16.x through core_r0.19.x (see README).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import runpy
import sys
import typing
from typing import Callable, Iterator, List, Optional

from megatron_taco.config.errors import ConfigError
from megatron_taco.config.mapl import add_mapl_args
from megatron_taco.codec.taco import describe_backend
from megatron_taco.config.taco import (
    TacoConfigError,
    add_taco_args,
    check_backend_runs_here,
    check_switch_before_end,
    taco_config_from_args,
)
from megatron_taco.mapl import megatron_lm as mapl_hooks
from megatron_taco.megatron.telemetry import TELEMETRY

__all__ = ["check_megatron_args", "install_hooks", "log_telemetry", "use_checkout_of", "main"]

_STATE: dict = {"taco": None, "installed": False}

if not hasattr(typing, "override"):  # Megatron-LM 0.19's training package uses typing.override (Python 3.12+)
    typing.override = lambda method: method


def _rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _fail(message: str, announce: Optional[bool] = None) -> "typing.NoReturn":
    """Stop this rank with exit code 2; rank 0 prints the one line (not one per rank, no traceback), or the ranks
    ``announce`` picks, for an error raised by some ranks only (e.g. one pipeline stage's tensor-parallel group)."""
    if _rank0() if announce is None else announce:
        print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


@contextlib.contextmanager
def _one_line_parse_errors() -> Iterator[None]:
    """While Megatron-LM's parser runs: a bad flag is one line on rank 0 (argparse prints its usage block on
    every rank), and ``--help`` prints on rank 0 only."""
    error, print_help = argparse.ArgumentParser.error, argparse.ArgumentParser.print_help

    def one_line(parser: argparse.ArgumentParser, message: str) -> None:
        _fail(f"{message} (see {parser.prog} --help)")

    def help_on_rank0(parser: argparse.ArgumentParser, file=None) -> None:
        if _rank0():
            print_help(parser, file)

    argparse.ArgumentParser.error, argparse.ArgumentParser.print_help = one_line, help_on_rank0
    try:
        yield
    finally:
        argparse.ArgumentParser.error, argparse.ArgumentParser.print_help = error, print_help


def _with_taco_args(extra_args_provider: Optional[Callable]) -> Callable:
    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_mapl_args(add_taco_args(parser))

    return provider


def _taco_flag(args: argparse.Namespace) -> str:
    """The flag that turns TACO on, for messages: ``--taco-mode X``, else the override or switch that does."""
    if args.taco_mode != "none":
        return f"--taco-mode {args.taco_mode}"
    return "--taco-override" if getattr(args, "taco_override", None) else "--taco-switch"


def _conflicts(args: argparse.Namespace) -> List[tuple]:
    """(Megatron-LM flag, whether it is given, why TACO cannot run with it)."""
    graphs = (
        getattr(args, "cuda_graph_impl", "none") not in (None, "none")
        or getattr(args, "enable_cuda_graph", False)
        or getattr(args, "external_cuda_graph", False)
    )
    return [
        (
            "--tp-comm-overlap",
            getattr(args, "tp_comm_overlap", False),
            "Transformer Engine's userbuffers send TP traffic around the collectives TACO compresses",
        ),
        (
            "--symmetric-ar-type",  # without SP: with it, TE reduce-scatters the outputs through TACO
            getattr(args, "symmetric_ar_type", None) is not None and not getattr(args, "sequence_parallel", False),
            "Transformer Engine's symmetric-memory all-reduce sends the proj / fc2 outputs around TACO's collectives",
        ),
        (
            "CUDA graphs (--cuda-graph-impl / --enable-cuda-graph / --external-cuda-graph)",
            graphs,
            "graph replays skip TACO's host-side steps (settings handshake, telemetry, --taco-switch)",
        ),
        (
            "--fp8-recipe / --fp4-recipe custom",
            (getattr(args, "fp8", None) and getattr(args, "fp8_recipe", None) == "custom")
            or (getattr(args, "fp4", None) and getattr(args, "fp4_recipe", None) == "custom"),
            "Transformer Engine all-gathers a custom recipe's inputs in high precision, past TACO",
        ),
    ]


def check_megatron_args(args: argparse.Namespace):
    """The TACO config of Megatron-LM's parsed ``args``; raises TacoConfigError for what TACO cannot do."""
    cfg = taco_config_from_args(args)
    if not cfg.enabled:
        return cfg
    if args.num_layers is not None:  # None with --use-checkpoint-args: the ranges are resolved at model build
        cfg = cfg.for_model(args.num_layers)
    check_switch_before_end(cfg, getattr(args, "train_iters", None))
    check_backend_runs_here(cfg.backend)
    for flag, given, why in _conflicts(args):
        if given:
            raise TacoConfigError(f"{_taco_flag(args)} with {flag}: {why}; drop one")
    from_checkpoint = getattr(args, "use_checkpoint_args", False) and getattr(
        args, "use_mp_args_from_checkpoint_args", False
    )  # the TP size comes later, from the checkpoint: the model build checks it
    if args.tensor_model_parallel_size == 1 and not from_checkpoint:
        raise TacoConfigError(needs_tensor_parallelism(_taco_flag(args)))
    return cfg


def needs_tensor_parallelism(flag: str) -> str:
    """The refusal of TACO at TP=1 (``flag``: what turned TACO on)."""
    return f"{flag} needs --tensor-model-parallel-size > 1: at TP=1 there is no tensor-parallel traffic to compress"


def _patch_parse_args() -> None:
    """Chain the --taco-* and --mapl-* flags into Megatron-LM's parser and validate them after parsing."""
    try:
        from megatron.training import arguments as mlm_arguments
    except ImportError:  # megatron-core without Megatron-LM's training package
        return
    original_parse = mlm_arguments.parse_args

    @functools.wraps(original_parse)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        with _one_line_parse_errors():
            args = original_parse(_with_taco_args(extra_args_provider), ignore_unknown_args)
        if getattr(args, "yaml_cfg", None) is not None:  # Megatron-LM returned the YAML file's settings instead
            if any(arg.startswith(("--taco-", "--mapl-")) for arg in sys.argv):
                _fail(
                    "--taco-* / --mapl-* flags with --yaml-cfg: Megatron-LM then reads every setting from the YAML "
                    "file and drops the command line's; drop --yaml-cfg"
                )
            return args
        try:
            _STATE["taco"] = check_megatron_args(args)
            TELEMETRY.error_sample_interval = _STATE["taco"].error_sample_interval  # --taco-error-sample-interval
            mapl_hooks.configure(args)
        except ConfigError as exc:  # --taco-* or --mapl-*
            _fail(str(exc))
        return args

    mlm_arguments.parse_args = parse_args
    for module_name in ("megatron.training.initialize", "megatron.training.training"):
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, "parse_args", None) is original_parse:
            module.parse_args = parse_args


def _patch_torch_norm() -> None:
    """megatron-core's ``WrappedTorchNorm`` refuses SP; build the SP-capable norm in its place under SP.

    Patched on the class, so every spec and import that names it (or ``LNImpl``) gets it."""
    from megatron.core.transformer import torch_norm

    from megatron_taco.megatron.norms import SequenceParallelNorm

    wrapped = torch_norm.WrappedTorchNorm
    original_new = wrapped.__new__

    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if config.sequence_parallel and config.normalization in ("LayerNorm", "RMSNorm"):
            return SequenceParallelNorm(config, hidden_size, eps)
        return original_new(cls, config, hidden_size, eps, *args, **kwargs)

    wrapped.__new__ = new


def _patch_model_build() -> None:
    """Attach the TACO settings and MAPL's boundary codecs to every GPTModel right after it is built."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_taco.comm import SettingsMismatchError
    from megatron_taco.megatron.attach import attach_taco
    from megatron_taco.megatron.te_linears import quantized_gathers_note

    original_init = GPTModel.__init__

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        import torch
        from megatron.core import parallel_state

        cfg = _STATE["taco"]
        first_of_stage = (
            parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0
        )
        stage = f"pipeline stage {parallel_state.get_pipeline_model_parallel_rank()}"
        try:
            if cfg is not None and cfg.enabled:
                if parallel_state.get_tensor_model_parallel_world_size() == 1:  # TP from the checkpoint's args
                    raise ValueError(needs_tensor_parallelism("TACO"))
                attached = attach_taco([self], cfg)
                impl = getattr(self.config, "transformer_impl", "local")
                if first_of_stage:
                    print(
                        f"megatron_taco: TACO {cfg.default.describe_modes()} ({impl} "
                        f"linears, {stage}): {attached.describe()}{cfg.describe_switch()}; codec "
                        f"{describe_backend(cfg.backend, torch.cuda.is_available())}"
                        + (quantized_gathers_note(self.config) if impl == "transformer_engine" else ""),
                        flush=True,
                    )
                if cfg.switch is not None:
                    _switch_before_forward(self, cfg, stage, first_of_stage)
            boundaries = mapl_hooks.attach(self)
        except ValueError as exc:  # a ConfigError, or a model TACO or MAPL cannot attach to
            _fail(str(exc))
        except SettingsMismatchError as exc:  # this TP group's ranks started with different --taco-* flags
            _fail(str(exc), announce=parallel_state.get_tensor_model_parallel_rank() == 0)
        if boundaries and first_of_stage:
            chunk = getattr(self, "vp_stage", None) or 0
            print(f"megatron_taco: MAPL ({stage}, chunk {chunk}): {boundaries}", flush=True)

    GPTModel.__init__ = init


def _switch_before_forward(model, cfg, stage: str, log: bool) -> None:
    """--taco-switch: before each forward, Megatron-LM's ``args.curr_iteration`` (the iterations done) decides."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    from megatron_taco.comm import SettingsMismatchError
    from megatron_taco.megatron.attach import TacoSwitch

    switch = TacoSwitch([model], cfg)

    def before_forward(module, inputs):
        try:
            attached = switch(getattr(get_args(), "curr_iteration", 0))
        except ValueError as exc:  # as at model build: one line, not a traceback per rank
            _fail(f"--taco-switch: {exc}")
        except SettingsMismatchError as exc:  # this TP group's ranks switch to different settings
            _fail(f"--taco-switch: {exc}", announce=parallel_state.get_tensor_model_parallel_rank() == 0)
        if attached is None:
            return
        handle.remove()  # switched once: no check left on later forwards
        if log:
            print(f"megatron_taco: TACO after iteration {cfg.switch[0]} ({stage}): {attached.describe()}", flush=True)

    handle = model.register_forward_pre_hook(before_forward)


def _patch_training_log() -> None:
    """Telemetry with Megatron-LM's own log: every --taco-log-interval iterations, to stdout and TensorBoard."""
    try:
        from megatron.training import training as mlm_training
    except ImportError:
        return
    original_log = mlm_training.training_log

    @functools.wraps(original_log)
    def training_log(*args, **kwargs):
        result = original_log(*args, **kwargs)
        iteration = kwargs["iteration"] if "iteration" in kwargs else args[3]
        log_telemetry(iteration)
        writer = _tensorboard_writer()
        for line in mapl_hooks.log_lines(iteration, writer):
            if _rank0():
                print(line, flush=True)
        return result

    mlm_training.training_log = training_log


def _patch_checkpoint_load() -> None:
    """Megatron-LM reads a checkpoint's saved args before its tensors: a checkpoint whose MAPL boundaries have other
    widths than this run's stops there with one line naming the flags, not with a shape mismatch."""
    try:
        from megatron.training import checkpointing
    except ImportError:  # megatron-core without Megatron-LM's training package
        return
    load_base = checkpointing._load_base_checkpoint

    @functools.wraps(load_base)
    def _load_base_checkpoint(load_dir, args, *rest, **kwargs):
        result = load_base(load_dir, args, *rest, **kwargs)
        state_dict = result[0] if isinstance(result, tuple) else None
        if isinstance(state_dict, dict) and state_dict.get("args") is not None:
            try:  # this run's args as passed: before global args exist with --use-checkpoint-args
                mapl_hooks.check_checkpoint_args(state_dict["args"], args, load_dir)
            except ConfigError as exc:
                _fail(str(exc))
        return result

    checkpointing._load_base_checkpoint = _load_base_checkpoint


def install_hooks() -> None:
    """Patch Megatron-LM / megatron-core entry points (idempotent)."""
    if _STATE["installed"]:
        return
    import megatron.core

    if _rank0():
        print(
            f"megatron_taco: megatron-core {megatron.core.__version__} from "
            f"{os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(megatron.core.__file__))))}",
            flush=True,
        )
    _patch_parse_args()
    _patch_torch_norm()
    _patch_model_build()
    _patch_training_log()
    _patch_checkpoint_load()
    mapl_hooks.install()
    _STATE["installed"] = True


def _tensorboard_writer():
    """Megatron-LM's TensorBoard writer (None when it has none)."""
    try:
        from megatron.training import get_tensorboard_writer

        return get_tensorboard_writer()
    except (ImportError, AssertionError):
        return None


def log_telemetry(iteration: int, writer=None) -> List[str]:
    """Print (rank 0) and write to TensorBoard the TACO traffic stats when ``iteration`` hits the interval.

    ``writer`` defaults to Megatron-LM's TensorBoard writer (None when it has none). Returns the lines.
    """
    cfg = _STATE["taco"]
    if cfg is None or not cfg.enabled or not cfg.log_interval or iteration % cfg.log_interval:
        return []
    writer = _tensorboard_writer() if writer is None else writer
    records = TELEMETRY.pipeline_records()  # rank 0 prints every stage's layers
    lines = TELEMETRY.format_lines(records)
    if _rank0():
        for line in lines:
            print(line, flush=True)
    if writer is not None:
        TELEMETRY.write_tensorboard(writer, iteration, records)
    TELEMETRY.reset()
    return lines


def use_checkout_of(script: str) -> None:
    """Put the script's folder first on ``sys.path`` (the script imports its siblings); when it is a Megatron-LM
    checkout (it holds ``megatron/``), that makes its ``megatron`` the one imported, not an installed one."""
    folder = os.path.dirname(os.path.abspath(script))
    loaded = sys.modules.get("megatron")
    checkout = os.path.join(folder, "megatron")
    if loaded is not None and os.path.isdir(checkout) and checkout not in [os.path.abspath(p) for p in loaded.__path__]:
        _fail(
            f"megatron was imported from {list(loaded.__path__)} before the launcher could put {folder} first on sys.path"
        )
    sys.path.insert(0, folder)


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        _fail("usage: python -m megatron_taco.launch SCRIPT.py [Megatron-LM, --taco-* and --mapl-* flags]")
    script, script_args = argv[0], argv[1:]
    if not os.path.isfile(script):
        _fail(f"training script {script!r} not found")
    use_checkout_of(script)
    install_hooks()
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
