"""Per-rank checkpoints of the trainer: model (MAPL projections and anchors included), optimizers, lr schedule, step.

Layout: ``DIR/iter_0000123/rank_00001.pt`` plus ``DIR/latest`` naming the newest
iteration, and ``DIR/iter_0000123/layout.json`` (world size, parallel layout and the MAPL flags that set its tensor
shapes, read at start-up before any model is built). Every rank saves and loads its own file (TP/PP shards differ); the
same parallel layout is needed to resume. The data stream is not stored: it is
deterministic, and resuming fast-forwards it past the consumed micro-batches.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.distributed as dist

from megatron_taco.config.mapl import width_flags, width_mismatch
from megatron_taco.training.loop import Trainer, TrainConfig

__all__ = ["save_checkpoint", "latest_step", "load_checkpoint", "check_saved_layout"]
LAYOUT_FILE = "layout.json"


def _iteration_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def save_checkpoint(trainer: Trainer, root: str) -> str:
    """Write this rank's state for ``trainer.step_count``; rank 0 updates ``latest`` after a barrier."""
    path = _iteration_dir(root, trainer.step_count)
    os.makedirs(path, exist_ok=True)
    state = {
        "step": trainer.step_count,
        "model": [model.state_dict() for model in trainer.models],
        "optimizer": trainer.optimizer.state_dict(),
        "lr_scheduler": trainer.scheduler.state_dict(),
        "manifold_optimizer": (
            trainer.mapl_sync.optimizer.state_dict()
            if trainer.mapl_sync is not None and trainer.mapl_sync.optimizer is not None
            else None
        ),
        "torch_rng": torch.get_rng_state(),
        "world_size": dist.get_world_size(),
        "layout": _layout(trainer.cfg),
        "mapl": _mapl_widths(trainer.cfg),
    }
    torch.save(state, os.path.join(path, f"rank_{dist.get_rank():05d}.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(path, LAYOUT_FILE), "w") as f:
            json.dump({"world_size": state["world_size"], "layout": state["layout"], "mapl": state["mapl"]}, f)
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(str(trainer.step_count))
    dist.barrier()
    return path


def latest_step(root: str) -> Optional[int]:
    marker = os.path.join(root, "latest")
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        return int(f.read().strip())


def _layout(cfg: TrainConfig) -> dict:
    """The parallel layout a checkpoint's per-rank shards belong to."""
    return {"TP": cfg.tensor_parallel, "PP": cfg.pipeline_parallel, "virtual PP": cfg.virtual_pipeline or 1}


def _mapl_widths(cfg: TrainConfig) -> Optional[str]:
    """The MAPL flags that set the boundaries' tensor shapes (None: MAPL off); checkpoints record them since the
    default wire became auto (2026-12-06), which doubled U's width at a given --mapl-ratio in bf16 training."""
    return None if cfg.mapl is None else width_flags(cfg.mapl.ratio, cfg.mapl.rank, cfg.mapl.ranks, cfg.mapl.wire)


def _mapl_mismatch(root: str, saved: Optional[str], cfg: TrainConfig) -> Optional[str]:
    """The one line for a checkpoint whose MAPL widths differ from this run's (None when they agree)."""
    return width_mismatch(root, saved, _mapl_widths(cfg), cfg.mapl.wire_choice if cfg.mapl is not None else None)


def _before_auto_hint(cfg: TrainConfig) -> str:
    """For a checkpoint that predates the MAPL record whose MAPL tensors do not fit: the likely cause when this
    run's default wire chose a codec wire (FP8 on 2026-12-06, INT5 from 2026-12-07: two or three times the rank the
    bf16 wire had at the same --mapl-ratio)."""
    if cfg.mapl is None or not cfg.mapl.codec_wire or not cfg.mapl.wire_choice:
        return ""
    return (
        f"; this run's MAPL boundaries have {_mapl_widths(cfg)} ({cfg.mapl.wire_choice}): a --mapl-ratio "
        "checkpoint saved before 2026-12-06 has the bf16 wire's widths, and --mapl-wire bf16 resumes it"
    )


def _describe(layout: dict) -> str:
    return ", ".join(f"{name}={value}" for name, value in layout.items())


def _layout_mismatch(root: str, saved: dict, now: dict) -> str:
    return f"--load {root}: saved with {_describe(saved)}, this run has {_describe(now)}; resume with the layout it was saved with"


def check_saved_layout(root: str, step: int, cfg: TrainConfig, world_size: int) -> None:
    """Before anything is built: ValueError when the checkpoint at ``step`` was saved by another world size or
    parallel layout (checkpoints without ``layout.json``, saved before it existed, are checked when loaded)."""
    try:
        with open(os.path.join(_iteration_dir(root, step), LAYOUT_FILE)) as f:
            saved = json.load(f)
    except FileNotFoundError:
        return
    if saved["world_size"] != world_size:
        raise ValueError(f"--load {root}: saved with world size {saved['world_size']}, now {world_size}")
    if saved["layout"] != _layout(cfg):
        raise ValueError(_layout_mismatch(root, saved["layout"], _layout(cfg)))
    mismatch = _mapl_mismatch(root, saved["mapl"], cfg) if "mapl" in saved else None  # (recorded since 2026-12-06)
    if mismatch:
        raise ValueError(mismatch)


def load_checkpoint(trainer: Trainer, root: str) -> int:
    """Restore this rank's state from the newest checkpoint under ``root``; return its step."""
    step = latest_step(root)
    if step is None:
        raise FileNotFoundError(f"--load {root}: no checkpoint (missing {os.path.join(root, 'latest')})")
    file = os.path.join(_iteration_dir(root, step), f"rank_{dist.get_rank():05d}.pt")
    if not os.path.exists(file):  # saved by fewer ranks
        saved = len([name for name in os.listdir(_iteration_dir(root, step)) if name.startswith("rank_")])
        raise ValueError(f"--load {root}: saved with world size {saved}, now {dist.get_world_size()}")
    state = torch.load(file, map_location=trainer.device, weights_only=False)
    if state["world_size"] != dist.get_world_size():
        raise ValueError(f"--load {root}: saved with world size {state['world_size']}, now {dist.get_world_size()}")
    if len(state["model"]) != len(trainer.models):
        raise ValueError(
            f"--load {root}: saved {len(state['model'])} model chunks per stage, now {len(trainer.models)}"
        )
    if "layout" in state and state["layout"] != _layout(trainer.cfg):
        raise ValueError(_layout_mismatch(root, state["layout"], _layout(trainer.cfg)))
    mismatch = _mapl_mismatch(root, state["mapl"], trainer.cfg) if "mapl" in state else None
    if mismatch:
        raise ValueError(mismatch)
    for model, saved in zip(trainer.models, state["model"]):
        try:
            model.load_state_dict(saved)
        except RuntimeError as exc:  # another model shape or other MAPL/TACO settings: name the first mismatch
            first = next((line.strip() for line in str(exc).splitlines()[1:] if line.strip()), str(exc))
            hint = _before_auto_hint(trainer.cfg) if "mapl" not in state and "mapl_" in first else ""
            raise ValueError(
                f"--load {root}: the checkpoint does not fit this model ({first}){hint}; resume with the "
                "model and settings it was saved with"
            ) from None
    trainer.optimizer.load_state_dict(state["optimizer"])
    if "lr_scheduler" in state:
        trainer.scheduler.load_state_dict(state["lr_scheduler"])
    else:  # saved before the trainer had a schedule: every earlier step ran at the constant --lr
        trainer.scheduler.step(state["step"])
    if state["manifold_optimizer"] is not None:
        trainer.mapl_sync.optimizer.load_state_dict(state["manifold_optimizer"])
    torch.set_rng_state(state["torch_rng"])
    trainer.step_count = state["step"]
    return step
