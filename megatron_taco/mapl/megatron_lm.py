"""MAPL inside Megatron-LM's own training loop (``megatron.training``): what the launcher and the patch install.

MAPL's front door (:mod:`megatron_taco.mapl.stage`) is the same as in the trainer; this module finds the
places in Megatron-LM where each of its steps belongs:

- the model: every GPTModel built gets its boundary codecs (:func:`attach`, from the launcher's model-build hook);
- the batch: the anchors need the token ids (and positions) on every stage; Megatron-LM gives them to the first
  stage only. ``get_batch_on_this_tp_rank`` is asked to hand every TP rank the whole batch (its
  ``mtp_on_this_rank`` path), and ``is_first_or_last_pipeline_stage`` answers yes on middle stages (PP > 2,
  interleaved chunks), so they read the batch and build the dataset too;
- the optimizer: when Megatron-LM builds it (``get_megatron_optimizer``) every chunk exists: :func:`start_mapl`
  runs first (anchors from the embedding, pair groups, settings check); U's gradient joins the norm that
  ``--clip-grad`` clips, and every ``optimizer.step()`` is followed by U's manifold step (clipped alike, skipped
  with the step) and the VQ codebook step (``MaplSync.follow_steps``);
- gradients: ``finalize_model_grads`` is followed by MAPL's sums over TP, DP and the boundary pair;
- the schedule: the function ``get_forward_backward_func`` returns is called with :func:`schedule_inputs`
  (r-wide P2P buffers; with VQ the index wire; d wide during ``--mapl-warmup-steps``, counted in Megatron-LM's
  iterations: :func:`iterations_done`), U's gradients and the VQ statistics zeroed before a training run of
  it (as ``train_step`` zeroes the others: its rerun state machine may run a step twice);
- the log: MAPL's traffic lines every ``--log-interval`` iterations (stdout and TensorBoard).

Checkpoints: the codecs are submodules of the GPTModel (``mapl_send_<g>`` / ``mapl_recv_<g>``), so U, its
optimizer's momentum, the anchors and the codebooks are saved and loaded with the model in every ``--ckpt-format``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys
from typing import Any, Callable, List, Optional

from megatron_taco.config.mapl import MaplConfig, MaplConfigError, mapl_config_from_args, width_flags, width_mismatch

__all__ = ["configure", "attach", "check_checkpoint_args", "install", "log_lines"]

_STATE: dict = {"cfg": None, "stages": [], "sync": None}


def configure(args: argparse.Namespace) -> Optional[MaplConfig]:
    """MAPL's config from Megatron-LM's parsed ``args`` (None: off); raises MaplConfigError naming the flag."""
    given = any(getattr(args, flag, None) is not None for flag in ("mapl_ratio", "mapl_rank", "mapl_ranks"))
    chunks = _model_chunks(args) if given else None  # MAPL off reads nothing more
    overlapped_p2p = bool(chunks) and getattr(args, "overlap_p2p_comm", False)
    element_size = 2 if getattr(args, "bf16", False) or getattr(args, "fp16", False) else 4  # the params' dtype
    cfg = mapl_config_from_args(args, args.hidden_size, element_size, decode_on_arrival=not overlapped_p2p)
    _STATE["cfg"] = cfg
    if cfg is None:
        return None
    args.mapl_wire = cfg.wire  # the wire auto chose, as Megatron-LM's checkpoints will record it
    if args.hidden_size is not None:  # None with --use-checkpoint-args: the model build checks the widths
        cfg.wire_ranks(args.hidden_size, args.pipeline_model_parallel_size, chunks)
    cfg.anchors_positions(args.position_embedding_type)
    if cfg.wire != "bf16" and overlapped_p2p:
        raise MaplConfigError(  # the interleaved schedule's overlap hands on P2P buffers before they arrive
            f"--mapl-wire {cfg.wire} with virtual pipeline stages decodes P2P messages on arrival; "
            "add --no-overlap-p2p-communication"
        )
    if getattr(args, "context_parallel_size", 1) > 1:
        raise MaplConfigError(
            f"--mapl-* with --context-parallel-size {args.context_parallel_size}: MAPL's anchors "
            "need every token of the sequence on the stage; run without context parallelism"
        )
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    world = getattr(args, "world_size", None) or int(os.environ.get("WORLD_SIZE", "1"))
    data_parallel = world // (model_parallel * getattr(args, "context_parallel_size", 1))
    sharded = [flag for flag in ("use_megatron_fsdp", "use_torch_fsdp2") if getattr(args, flag, False)]
    if sharded and data_parallel > 1:
        raise MaplConfigError(
            f"--mapl-* with --{sharded[0].replace('_', '-')} at data-parallel size {data_parallel}: FSDP shards the "
            "anchor parameters themselves, which MAPL's boundary pair sums whole; use --use-distributed-optimizer "
            "or run at data-parallel size 1"
        )
    instances = getattr(args, "num_distributed_optimizer_instances", 1)
    if getattr(args, "use_distributed_optimizer", False) and instances > 1:
        raise MaplConfigError(
            f"--mapl-* with --num-distributed-optimizer-instances {instances}: MAPL gathers the anchors' gradient "
            "shards over the whole data-parallel group; use one instance"
        )
    if getattr(args, "use_tp_pp_dp_mapping", False):
        raise MaplConfigError(
            "--mapl-* with --use-tp-pp-dp-mapping: MAPL pairs each stage with its neighbours in Megatron-LM's default "
            "rank order; drop --use-tp-pp-dp-mapping"
        )
    if getattr(args, "mtp_num_layers", None):
        raise MaplConfigError(
            "--mapl-* with --mtp-num-layers: multi-token prediction layers read the last "
            "stage's hidden states in ways MAPL does not cover; drop one"
        )
    return cfg


_WIDTH_FLAGS = ("mapl_ratio", "mapl_rank", "mapl_ranks", "mapl_wire")  # what sets the boundaries' tensor shapes


def _width_settings(args: Any) -> str:
    """The flags of ``args`` that set MAPL's tensor shapes, as given (the wire as recorded: bf16 before it existed)."""
    return width_flags(*(getattr(args, name, None) for name in _WIDTH_FLAGS))


def check_checkpoint_args(checkpoint_args: Any, args: argparse.Namespace, load_dir: str) -> None:
    """Before Megatron-LM loads a checkpoint's tensors: MaplConfigError naming the flags when its MAPL boundaries
    were saved with other widths than this run's ``args`` (the load would stop on a shape mismatch). A checkpoint
    saved without MAPL is left to Megatron-LM (it names the missing tensors)."""
    cfg = _STATE["cfg"]
    if cfg is None or all(getattr(checkpoint_args, name, None) is None for name in _WIDTH_FLAGS[:3]):
        return
    # configure() records the wire auto chose, so both name a wire
    mismatch = width_mismatch(load_dir, _width_settings(checkpoint_args), _width_settings(args), cfg.wire_choice)
    if mismatch:
        raise MaplConfigError(mismatch)


def _model_chunks(args: argparse.Namespace) -> Optional[int]:
    """Chunks per pipeline stage as Megatron-LM's ``validate_args`` will set them (it runs after this check), from
    ``--pipeline-model-parallel-layout``, ``--num-virtual-stages-per-pipeline-rank`` or
    ``--num-layers-per-virtual-pipeline-stage`` (the embedding and the loss counted as layers where
    ``--account-for-*-in-pipeline-split`` says so); None for one chunk."""
    stages = args.pipeline_model_parallel_size
    per_chunk = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if getattr(args, "virtual_pipeline_model_parallel_size", None):
        chunks = args.virtual_pipeline_model_parallel_size
    elif getattr(args, "pipeline_model_parallel_layout", None):
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        chunks = PipelineParallelLayerLayout.get_num_stages_from_str(args.pipeline_model_parallel_layout) // stages
    elif getattr(args, "num_virtual_stages_per_pipeline_rank", None):
        chunks = args.num_virtual_stages_per_pipeline_rank
    elif per_chunk and args.num_layers is not None:  # without --num-layers (checkpoint args) the model build counts
        layers = args.num_layers + sum(
            bool(getattr(args, f"account_for_{part}_in_pipeline_split", False)) for part in ("embedding", "loss")
        )
        chunks = layers // stages // per_chunk
    else:
        return None
    return chunks if chunks > 1 else None


def attach(model: Any) -> Optional[str]:
    """Attach MAPL's codecs to one freshly built GPTModel chunk; return its boundaries in words for the
    start-up line (None when MAPL is off)."""
    cfg = _STATE["cfg"]
    if cfg is None:
        return None
    from megatron.training import get_args

    from megatron_taco.mapl.stage import attach_mapl
    from megatron_taco.mapl.wire import describe_compression

    stage = attach_mapl(model, cfg, seed=get_args().seed)
    dtype = model.config.pipeline_dtype or model.config.params_dtype
    _STATE["stages"].append(stage)
    parts = []
    for side, codec in (("receives", stage.recv), ("sends", stage.send)):
        if codec is not None:
            vq = f", VQ {codec.vq.levels} x {codec.vq.codes} codes" if codec.vq is not None else ""
            parts.append(
                f"{side} boundary {codec.boundary} at width {codec.rank} of {codec.hidden_size} "
                f"({describe_compression(codec.hidden_size, codec.rank, codec.wire, dtype.itemsize)}{vq})"
            )
    return "; ".join(parts + ([cfg.wire_choice] if cfg.wire_choice else [])) + cfg.describe_warmup(
        get_args().train_iters, model.config.hidden_size
    )


def _replace_everywhere(original: Callable, replacement: Callable) -> None:
    """Put ``replacement`` in place of ``original`` in every loaded megatron module that holds it by name
    (Megatron-LM imports these helpers by name into several modules, and the training script imports them
    after the hooks are in place)."""
    for name, module in list(sys.modules.items()):
        if name == "megatron" or name.startswith("megatron."):
            for attribute, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attribute, replacement)


def _patch_batch() -> None:
    import megatron.core.utils as core_utils
    import megatron.training.utils as training_utils

    # its home: megatron.training.utils in 0.16, megatron.core.utils in 0.19
    get_batch = getattr(training_utils, "get_batch_on_this_tp_rank", None) or core_utils.get_batch_on_this_tp_rank
    signature = inspect.signature(get_batch)

    @functools.wraps(get_batch)
    def get_batch_on_this_tp_rank(*args, **kwargs):
        if _STATE["cfg"] is not None:  # every TP rank of every stage gets tokens and positions
            bound = signature.bind(*args, **kwargs)
            bound.arguments["mtp_on_this_rank"] = True
            args, kwargs = bound.args, bound.kwargs
        return get_batch(*args, **kwargs)

    first_or_last = training_utils.is_first_or_last_pipeline_stage

    @functools.wraps(first_or_last)
    def is_first_or_last_pipeline_stage(*args, **kwargs):
        return _STATE["cfg"] is not None or first_or_last(*args, **kwargs)

    _replace_everywhere(get_batch, get_batch_on_this_tp_rank)
    _replace_everywhere(first_or_last, is_first_or_last_pipeline_stage)


def _patch_training() -> None:
    from megatron.training import get_args
    from megatron.training import training as mlm_training

    from megatron_taco.mapl.stage import schedule_inputs, start_mapl

    build_optimizer = mlm_training.get_megatron_optimizer

    @functools.wraps(build_optimizer)
    def get_megatron_optimizer(*args, **kwargs):
        cfg = _STATE["cfg"]
        if cfg is not None and _STATE["sync"] is None:  # anchors start before the optimizer copies parameters
            _STATE["sync"] = start_mapl(_STATE["stages"], cfg)
        optimizer = build_optimizer(*args, **kwargs)
        if _STATE["sync"] is not None:
            _STATE["sync"].follow_steps(optimizer, get_args().lr)
        return optimizer

    finalize = mlm_training.finalize_model_grads

    @functools.wraps(finalize)
    def finalize_model_grads(*args, **kwargs):
        result = finalize(*args, **kwargs)
        if _STATE["sync"] is not None:  # num_tokens: --calculate-per-token-loss's count, summed over DP by now
            _STATE["sync"].finalize_grads(kwargs.get("num_tokens", args[1] if len(args) > 1 else None))
        return result

    get_schedule = mlm_training.get_forward_backward_func

    @functools.wraps(get_schedule)
    def get_forward_backward_func(*args, **kwargs):
        schedule = get_schedule(*args, **kwargs)
        cfg = _STATE["cfg"]
        if cfg is None:
            return schedule

        @functools.wraps(schedule)
        def forward_backward(*schedule_args, model, **schedule_kwargs):
            sync = _STATE["sync"]
            forward_only = schedule_kwargs.get("forward_only", False)
            if sync is not None and not forward_only:
                sync.start_forward_backward()
            # --mapl-warmup-steps: d wide until Megatron-LM's iteration count (a resumed run's too) passes it
            warming = sync is not None and sync.warm_up(iterations_done(get_args(), forward_only))
            chunks = model if isinstance(model, list) else [model]
            views, extra = schedule_inputs(chunks, cfg, warming)
            return schedule(
                *schedule_args, model=views if isinstance(model, list) else views[0], **{**schedule_kwargs, **extra}
            )

        return forward_backward

    _replace_everywhere(build_optimizer, get_megatron_optimizer)
    _replace_everywhere(finalize, finalize_model_grads)
    _replace_everywhere(get_schedule, get_forward_backward_func)


def iterations_done(args: argparse.Namespace, forward_only: bool) -> int:
    """Megatron-LM's iterations done when its schedule runs: a training step runs with ``args.curr_iteration``
    done; an evaluation runs after the step that set it (the validation every ``--eval-interval``, the final one),
    so one more; with ``--skip-train`` no training loop sets it and the loaded checkpoint's ``args.iteration``
    counts."""
    if getattr(args, "curr_iteration", None) is None:
        return getattr(args, "iteration", 0)
    return args.curr_iteration + int(forward_only)


def install() -> None:
    """Patch Megatron-LM's training package (once, from the launcher's ``install_hooks``)."""
    try:
        import megatron.training.training  # noqa: F401
    except ImportError:  # megatron-core without Megatron-LM's training package
        return
    _patch_batch()
    _patch_training()


def log_lines(iteration: int, writer=None) -> List[str]:
    """MAPL's traffic of the last ``--log-interval`` iterations (a collective: every rank calls it)."""
    cfg = _STATE["cfg"]
    from megatron.training import get_args

    args = get_args()
    if cfg is None or not args.log_interval or iteration % args.log_interval:
        return []
    import torch

    from megatron_taco.mapl import telemetry

    pp = args.pipeline_model_parallel_size
    boundaries = pp * (args.virtual_pipeline_model_parallel_size or 1) - 1
    traffic = telemetry.MAPL_TELEMETRY.summed(boundaries, torch.device("cuda", torch.cuda.current_device()))
    lines = telemetry.format_lines(traffic, args.log_interval, pp)
    if writer is not None:
        telemetry.write_tensorboard(writer, iteration, traffic, args.log_interval)
    telemetry.MAPL_TELEMETRY.reset()
    return lines
