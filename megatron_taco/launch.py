"""Run an unmodified Megatron-LM training script with TACO: ``python -m megatron_taco.launch SCRIPT [flags]``.

    python -m megatron_taco.launch /path/to/Megatron-LM/pretrain_gpt.py \\
        <Megatron-LM flags> --transformer-impl local --taco-mode fp8-ash [--taco-* ...]

Before the script runs, :func:`install_hooks`:

1. adds the ``--taco-*`` flags to Megatron-LM's argument parser (``megatron.training.arguments.parse_args``
   chains them into its ``extra_args_provider``) and validates them when the arguments are parsed;
2. makes ``get_gpt_layer_local_spec`` return megatron_taco's layer spec (the same layer with TACO's
   linears and the SP-capable norm), and, when apex is missing, the block's final norm the SP-capable one;
3. attaches the per-layer TACO settings to every GPTModel right after it is built.

Requires ``--transformer-impl local`` (TACO's linears replace megatron-core's local ones; with Transformer
Engine the layers are TE modules and start-up fails with a message saying so). MAPL needs changes in the
training loop and is available in ``examples/pretrain_gpt.py`` only: ``--mapl-*`` flags fail at start-up here.
Supported: Megatron-LM core_r0.16.x through core_r0.19.x (see README).
"""

from __future__ import annotations

import argparse
import functools
import os
import runpy
import sys
import typing
from typing import Callable, List, Optional

from megatron_taco.config.taco import TacoConfigError, add_taco_args, taco_config_from_args

_STATE: dict = {"taco": None, "installed": False}

if not hasattr(typing, "override"):  # Megatron-LM 0.19's training package uses typing.override (Python 3.12+)
    typing.override = lambda method: method


def _with_taco_args(extra_args_provider: Optional[Callable]) -> Callable:
    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_taco_args(parser)

    return provider


def _reject_mapl(argv: List[str]) -> None:
    given = [a.split("=")[0] for a in argv if a.startswith("--mapl-")]
    if given:
        raise SystemExit(
            f"error: {', '.join(given)}: MAPL is not available through the Megatron-LM launcher (it changes the "
            "pipeline schedule's buffers); use examples/pretrain_gpt.py"
        )


def install_hooks() -> None:
    """Patch Megatron-LM / megatron-core entry points (idempotent)."""
    if _STATE["installed"]:
        return
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer import torch_norm, transformer_block

    from megatron_taco.megatron.attach import attach_taco
    from megatron_taco.megatron.norms import SequenceParallelNorm
    from megatron_taco.megatron.specs import taco_layer_spec

    # 1. flags: wrap parse_args where Megatron-LM defines and imports it
    try:
        from megatron.training import arguments as mlm_arguments
    except ImportError:
        mlm_arguments = None
    if mlm_arguments is not None:
        original_parse = mlm_arguments.parse_args

        @functools.wraps(original_parse)
        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            args = original_parse(_with_taco_args(extra_args_provider), ignore_unknown_args)
            try:
                _STATE["taco"] = taco_config_from_args(args)
            except TacoConfigError as exc:
                raise SystemExit(f"error: {exc}") from None
            if _STATE["taco"].enabled and getattr(args, "transformer_impl", "local") != "local":
                raise SystemExit(
                    f"error: --taco-mode {args.taco_mode} needs --transformer-impl local (got "
                    f"{args.transformer_impl}): TACO replaces megatron-core's local linears; Transformer Engine's "
                    "own TP communication is not intercepted"
                )
            return args

        mlm_arguments.parse_args = parse_args
        for module_name in ("megatron.training.initialize", "megatron.training.training"):
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, "parse_args", None) is original_parse:
                module.parse_args = parse_args

    # 2. layer spec and final norm
    original_local_spec = gpt_layer_specs.get_gpt_layer_local_spec

    @functools.wraps(original_local_spec)
    def get_gpt_layer_local_spec(*args, **kwargs):
        unsupported = [k for k in ("num_experts", "multi_latent_attention", "qk_layernorm", "qk_l2_norm", "use_kitchen")
                       if kwargs.get(k)]
        if args or unsupported:  # MoE, MLA, qk norms: megatron-core's own spec (TACO does not cover them)
            return original_local_spec(*args, **kwargs)
        return taco_layer_spec()

    gpt_layer_specs.get_gpt_layer_local_spec = get_gpt_layer_local_spec
    if transformer_block.LayerNormImpl is torch_norm.WrappedTorchNorm:  # no apex: it refuses SP
        transformer_block.LayerNormImpl = SequenceParallelNorm

    # 3. attach TACO to every GPTModel built from now on
    original_init = GPTModel.__init__

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        cfg = _STATE["taco"]
        if cfg is not None and cfg.enabled:
            layers = attach_taco([self], cfg)
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"megatron_taco: TACO {cfg.default.mode} attached to layers {layers}", flush=True)

    GPTModel.__init__ = init

    # 4. telemetry with Megatron-LM's own log: every --taco-log-interval iterations, to stdout and TensorBoard
    if mlm_arguments is not None:
        from megatron.training import training as mlm_training

        original_log = mlm_training.training_log

        @functools.wraps(original_log)
        def training_log(*args, **kwargs):
            result = original_log(*args, **kwargs)
            log_telemetry(kwargs["iteration"] if "iteration" in kwargs else args[3])
            return result

        mlm_training.training_log = training_log
    _STATE["installed"] = True


def log_telemetry(iteration: int, writer=None) -> List[str]:
    """Print (rank 0) and write to TensorBoard the TACO traffic stats when ``iteration`` hits the interval.

    ``writer`` defaults to Megatron-LM's TensorBoard writer (None when it has none). Returns the lines.
    """
    from megatron_taco.megatron.telemetry import TELEMETRY

    cfg = _STATE["taco"]
    if cfg is None or not cfg.enabled or not cfg.log_interval or iteration % cfg.log_interval:
        return []
    if writer is None:
        try:
            from megatron.training import get_tensorboard_writer

            writer = get_tensorboard_writer()
        except (ImportError, AssertionError):
            writer = None
    lines = TELEMETRY.format_lines()
    if int(os.environ.get("RANK", "0")) == 0:
        for line in lines:
            print(line, flush=True)
    if writer is not None:
        TELEMETRY.write_tensorboard(writer, iteration)
    TELEMETRY.reset()
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m megatron_taco.launch SCRIPT.py [Megatron-LM and --taco-* flags]")
    script, script_args = argv[0], argv[1:]
    if not os.path.isfile(script):
        raise SystemExit(f"error: training script {script!r} not found")
    _reject_mapl(script_args)
    install_hooks()
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # the script imports its siblings
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
