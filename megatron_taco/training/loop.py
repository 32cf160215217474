"""A small Megatron-Core training loop: parallel state, GPTModel, DDP, Adam, 1F1B schedule.

Used by ``examples/pretrain_gpt.py`` and the tests. It expects
``torch.distributed`` to be initialised already (torchrun, or the test harness)
and runs on CUDA with NCCL when a GPU is present, otherwise on CPU with gloo
through :mod:`megatron_taco.megatron.cpu_runtime`.
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_taco.megatron.cpu_runtime import cpu_config_overrides, enable_cpu_runtime
from megatron_taco.config.errors import TrainConfigError
from megatron_taco.config.mapl import MaplConfig
from megatron_taco.config.taco import TacoConfig
from megatron_taco.mapl.boundary import BoundaryCodec
from megatron_taco.mapl.stage import attach_mapl, schedule_inputs, start_mapl
from megatron_taco.megatron.attach import TacoSwitch, attach_taco
from megatron_taco.megatron.specs import LOCAL_SPEC_CONFIG
from megatron_taco.megatron.telemetry import TELEMETRY
from megatron_taco.training.model import ModelShape, build_gpt_model, make_transformer_config

__all__ = ["DTYPES", "LR_DECAY_STYLES", "TrainConfig", "init_distributed", "Trainer", "train"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclasses.dataclass
class TrainConfig:
    """What to train and how to lay it out over the ranks."""

    shape: ModelShape
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: Optional[int] = None  # model chunks per pipeline stage (interleaved 1F1B)
    sequence_parallel: bool = False
    micro_batch_size: int = 2
    num_microbatches: int = 2
    lr: float = 1e-3
    # learning-rate schedule, Megatron-LM's: linear warm-up from 0, then constant, linear or cosine decay to min_lr
    # over lr_decay_iters steps; MAPL's manifold learning rate follows the same factor (mapl.lr * lr_now / lr)
    lr_warmup_iters: int = 0
    lr_decay_style: str = "constant"
    lr_decay_iters: Optional[int] = None
    min_lr: float = 0.0
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    dtype: str = "fp32"
    dropout: float = 0.0
    seed: int = 1234
    initial_loss_scale: float = 2.0**32  # fp16 only: dynamic loss scaling starts here (megatron-core's default)
    taco: Optional[TacoConfig] = None  # None: stock megatron-core linears
    mapl: Optional[MaplConfig] = None  # None: uncompressed pipeline boundaries

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise TrainConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self._check_lr_schedule()
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise TrainConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        for name in ("tensor_parallel", "pipeline_parallel", "micro_batch_size", "num_microbatches"):
            if getattr(self, name) < 1:
                raise TrainConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.virtual_pipeline is not None:
            if self.pipeline_parallel < 2 or self.virtual_pipeline < 2:
                raise TrainConfigError(
                    "--virtual-pipeline-model-parallel-size: a virtual pipeline needs "
                    "--pipeline-model-parallel-size > 1 and at least 2 chunks per stage"
                )
            if self.shape.num_layers % (self.pipeline_parallel * self.virtual_pipeline):
                raise TrainConfigError(
                    f"--virtual-pipeline-model-parallel-size: {self.shape.num_layers} layers do not split "
                    f"into {self.pipeline_parallel} stages x {self.virtual_pipeline} virtual chunks"
                )
            if self.num_microbatches % self.pipeline_parallel:
                raise TrainConfigError(
                    f"the interleaved schedule needs micro-batches ({self.num_microbatches}) divisible by "
                    f"--pipeline-model-parallel-size {self.pipeline_parallel}"
                )
        if self.taco is not None:
            self.taco.for_model(self.shape.num_layers)  # the layer ranges checked at start-up, not at model build
        if self.mapl is not None:
            self.mapl_widths  # validates the MAPL settings against the layout
            self.mapl_position_anchors  # and against the model's position embedding

    def _check_lr_schedule(self) -> None:
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise TrainConfigError(
                f"--lr-decay-style: invalid value {self.lr_decay_style!r}; choose from {', '.join(LR_DECAY_STYLES)}"
            )
        if self.lr <= 0:
            raise TrainConfigError(f"--lr: invalid value {self.lr:g}; must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise TrainConfigError(f"--min-lr: invalid value {self.min_lr:g}; must be in [0, --lr {self.lr:g}]")
        if self.lr_warmup_iters < 0:
            raise TrainConfigError(f"--lr-warmup-iters: invalid value {self.lr_warmup_iters}; must be >= 0")
        if self.lr_decay_style != "constant":
            if self.lr_decay_iters is None:
                raise TrainConfigError(f"--lr-decay-style {self.lr_decay_style} needs --lr-decay-iters")
            if self.lr_decay_iters <= self.lr_warmup_iters:
                raise TrainConfigError(
                    f"--lr-decay-iters {self.lr_decay_iters} must be larger than --lr-warmup-iters "
                    f"{self.lr_warmup_iters} (the decay runs from the end of the warm-up)"
                )

    @property
    def lr_schedule_summary(self) -> str:
        """The learning-rate schedule in words, for logs and reports."""
        warmup = f", {self.lr_warmup_iters} warm-up steps from 0" if self.lr_warmup_iters else ""
        scheduled = self.lr_warmup_iters or self.lr_decay_style != "constant"
        decay = (
            ", then constant"
            if self.lr_decay_style == "constant"
            else f", {self.lr_decay_style} decay to {self.min_lr:g} at step {self.lr_decay_iters}"
        )
        follows = " (MAPL's manifold lr follows the same factor)" if scheduled and self.mapl is not None else ""
        return f"lr {self.lr:g}{warmup}{decay}{follows}"

    @property
    def mapl_position_anchors(self) -> bool:
        """Whether MAPL's anchors include positions (auto: where the model has learned absolute positions)."""
        return self.mapl.anchors_positions(self.shape.position_embedding)

    @property
    def mapl_widths(self) -> List[int]:
        """MAPL's wire width r of every pipeline boundary, in pipeline order."""
        return self.mapl.wire_ranks(self.shape.hidden_size, self.pipeline_parallel, self.virtual_pipeline)


def init_distributed() -> None:
    """Initialise torch.distributed from torchrun's environment (NCCL on GPU, gloo on CPU)."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class Trainer:
    """Builds the model on this rank and runs optimizer steps with Megatron's schedules."""

    def __init__(self, cfg: TrainConfig, layer_spec: Optional[ModuleSpec] = None) -> None:
        self.cfg = cfg
        world = dist.get_world_size()
        model_parallel = cfg.tensor_parallel * cfg.pipeline_parallel
        if world % model_parallel:
            raise ValueError(
                f"world size {world} is not divisible by TP x PP = {cfg.tensor_parallel} x {cfg.pipeline_parallel}"
            )
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            if cfg.dtype != "fp32":
                raise ValueError(
                    f"--dtype {cfg.dtype} needs CUDA: megatron-core's mixed-precision optimizer accepts only "
                    "CUDA tensors; use --dtype fp32 on CPU"
                )
            enable_cpu_runtime()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_parallel,
            pipeline_model_parallel_size=cfg.pipeline_parallel,
            virtual_pipeline_model_parallel_size=cfg.virtual_pipeline,
        )
        model_parallel_cuda_manual_seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.device = _device()
        dtype = DTYPES[cfg.dtype]
        self.config = make_transformer_config(
            cfg.shape,
            tensor_parallel=cfg.tensor_parallel,
            pipeline_parallel=cfg.pipeline_parallel,
            sequence_parallel=cfg.sequence_parallel,
            params_dtype=dtype,
            dropout=cfg.dropout,
            extra={
                **LOCAL_SPEC_CONFIG,
                **({} if on_gpu else cpu_config_overrides()),
                "virtual_pipeline_model_parallel_size": cfg.virtual_pipeline,
            },
        )
        chunks = [
            build_gpt_model(cfg.shape, self.config, layer_spec, seed=cfg.seed, vp_stage=vp).to(self.device)
            for vp in (range(cfg.virtual_pipeline) if cfg.virtual_pipeline else [None])
        ]
        self._mapl_stages = (
            [attach_mapl(chunk, cfg.mapl, cfg.seed, self.boundary_codec) for chunk in chunks]
            if cfg.mapl is not None
            else []
        )
        self.mapl_boundaries = [b for stage in self._mapl_stages for b in stage.boundaries()]
        self.taco_attached = attach_taco(chunks, cfg.taco) if cfg.taco is not None else None
        self.taco_switch = TacoSwitch(chunks, cfg.taco) if cfg.taco is not None else None  # --taco-switch
        if cfg.taco is not None:
            TELEMETRY.error_sample_interval = cfg.taco.error_sample_interval
        if dtype != torch.float32:  # Megatron's mixed precision: half params, fp32 logits and main params
            chunks = [Float16Module(self.config, chunk) for chunk in chunks]  # MAPL state stays fp32 (BoundaryCodec)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=False,
            # NaN/Inf gradients stop training with an error, compressed or not; except with fp16's dynamic
            # loss scaling, where they are the scaler's overflow signal (the step is skipped), as in Megatron-LM
            check_for_nan_in_grad=dtype != torch.float16,
        )
        self.models = [DistributedDataParallel(self.config, ddp_config, chunk) for chunk in chunks]
        self.model = self.models[0]
        # MAPL's anchors start before the optimizer copies the parameters into its fp32 main parameters
        self.mapl_sync = start_mapl(self._mapl_stages, cfg.mapl) if cfg.mapl is not None else None
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=cfg.lr,
                min_lr=cfg.min_lr,
                weight_decay=cfg.weight_decay,
                clip_grad=cfg.clip_grad,
                bf16=dtype == torch.bfloat16,
                fp16=dtype == torch.float16,
                initial_loss_scale=cfg.initial_loss_scale,
                params_dtype=dtype,
                use_distributed_optimizer=False,
            ),
            self.models,
        )
        if self.mapl_sync is not None:
            self.mapl_sync.follow_steps(self.optimizer, cfg.lr)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=cfg.lr,
            min_lr=cfg.min_lr,
            lr_warmup_steps=cfg.lr_warmup_iters,
            # the constant style never reads the decay length; Megatron's scheduler wants it past the warm-up
            lr_decay_steps=cfg.lr_decay_iters if cfg.lr_decay_style != "constant" else cfg.lr_warmup_iters + 1,
            lr_decay_style=cfg.lr_decay_style,
            start_wd=cfg.weight_decay,
            end_wd=cfg.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
            # a resumed run takes the schedule given now and the checkpoint's step count
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True,
        )
        self.config.finalize_model_grads_func = finalize_model_grads
        no_sync = [m.no_sync for m in self.models]
        self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.step_count = 0

    boundary_codec = BoundaryCodec  # the codec class at every MAPL boundary (a study may put a variant here)

    @property
    def data_parallel_rank(self) -> int:
        return parallel_state.get_data_parallel_rank()

    def _iterators(self, data_iterator):
        """The interleaved schedule reads one iterator per model chunk: pass a list of identical streams."""
        if len(self.models) == 1:
            return data_iterator
        if not isinstance(data_iterator, (list, tuple)) or len(data_iterator) != len(self.models):
            raise ValueError(
                f"with {len(self.models)} model chunks per stage, pass a list of "
                f"{len(self.models)} identical data iterators"
            )
        return list(data_iterator)

    def _forward_step(self, data_iterator: Iterator[Dict[str, torch.Tensor]], model: torch.nn.Module):
        batch = {k: v.to(self.device, non_blocking=True) for k, v in next(data_iterator).items()}
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(_masked_mean_loss, batch["loss_mask"])

    def train_step(self, data_iterator: Iterator[Dict[str, torch.Tensor]]) -> Dict[str, float]:
        """One optimizer step over ``num_microbatches``; the loss is returned on every rank (and, the step a
        --taco-switch attached its settings, what it attached as "taco_switched")."""
        switched = self.taco_switch(self.step_count) if self.taco_switch is not None else None
        for model in self.models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self._run_schedule(data_iterator, forward_only=False)
        if self.mapl_sync is not None:
            self.mapl_sync.finalize_grads()
        lr = self.lr
        updated, grad_norm, _ = self.optimizer.step()  # with MAPL: then U's step and the codebooks' (follow_steps)
        if updated:
            self.scheduler.step(1)  # like Megatron-LM: the schedule advances on applied steps only
        self.step_count += 1
        return {
            "loss": self._share_loss(losses),
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "skipped": not updated,
            "codebook_rows": self.mapl_sync.codebook_rows if self.mapl_sync is not None else 0,
            "taco_switched": switched,
        }

    @property
    def lr(self) -> float:
        """The learning rate of the next step (the schedule's value)."""
        return self.scheduler.get_lr({})

    @torch.no_grad()
    def evaluate(self, data_iterator: Iterator[Dict[str, torch.Tensor]], iters: int) -> float:
        """Mean loss over ``iters`` forward-only steps (every rank gets the value)."""
        total = 0.0
        for _ in range(iters):
            total += self._share_loss(self._run_schedule(data_iterator, forward_only=True))
        return total / iters

    def _run_schedule(self, data_iterator, forward_only: bool):
        """One pass of megatron-core's pipeline schedule over ``num_microbatches``; the per-micro-batch losses."""
        cfg = self.cfg
        # megatron-core's own P2P and buffers unless MAPL needs r-wide ones (and, with VQ, the index wire); d wide
        # during MAPL's warm-up, whose alpha the steps taken set
        models, comm = (
            schedule_inputs(self.models, cfg.mapl, self.mapl_sync.warm_up(self.step_count))
            if cfg.mapl is not None
            else (self.models, {})
        )
        return get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=self._iterators(data_iterator),
            model=models,
            num_microbatches=cfg.num_microbatches,
            seq_length=cfg.shape.seq_length,
            micro_batch_size=cfg.micro_batch_size,
            forward_only=forward_only,
            **comm,
        )

    def _share_loss(self, losses) -> float:
        """The last stage's mean micro-batch loss, averaged over DP, on every rank."""
        loss = torch.zeros(1, dtype=torch.float64, device=self.device)
        if parallel_state.is_pipeline_last_stage():
            loss += sum(float(item["lm loss"]) for item in losses) / len(losses)
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        loss /= parallel_state.get_data_parallel_world_size()
        dist.broadcast(
            loss,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return float(loss)

    def close(self) -> None:
        parallel_state.destroy_model_parallel()


def _masked_mean_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"lm loss": loss.detach().clone()}


def train(
    cfg: TrainConfig,
    steps: int,
    data_iterator: Iterator[Dict[str, torch.Tensor]],
    layer_spec: Optional[ModuleSpec] = None,
    log: Optional[Callable[[str], None]] = None,
) -> List[float]:
    """Train ``steps`` optimizer steps; return the loss after each (on every rank)."""
    trainer = Trainer(cfg, layer_spec)
    try:
        losses = []
        for _ in range(steps):
            stats = trainer.train_step(data_iterator)
            losses.append(stats["loss"])
            if log is not None:
                log(f"step {trainer.step_count} loss {stats['loss']:.6f} grad_norm {stats['grad_norm']:.4f}")
        return losses
    finally:
        trainer.close()
