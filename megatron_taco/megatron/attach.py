"""Attach per-layer TACO settings to a built megatron-core model.

Walks ``model.decoder.layers`` of every model chunk (through DDP and Float16Module wrappers) and
gives each of ``linear_qkv``, ``linear_proj``, ``linear_fc1`` and ``linear_fc2`` the compression its
global layer number resolves to in the :class:`TacoConfig`, whatever built the model: megatron-core's
local linears get TACO's forward implementation (``taco_linears``), Transformer Engine's linears get
their collectives intercepted (``te_linears``). Parts TACO does not cover (MoE experts, MLA attention,
TE's fused-ops MLP, other linear types) keep running stock, and :class:`Attached` names them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron_taco.codec import TacoCodec
from megatron_taco.comm.handshake import describe_codec, ensure_same_plan
from megatron_taco.config.taco import LINEARS, LinearSettings, TacoConfig
from megatron_taco.megatron.taco_linears import LinearCompression, compress_local_linear
from megatron_taco.megatron.te_linears import TeCompression, compress_te_linear, is_te_linear

__all__ = ["Attached", "TacoSwitch", "format_ranges", "unwrap", "attach_taco"]

# linear name in the flags -> (submodule, attribute) inside a TransformerLayer
_LINEAR_PATHS = {
    "qkv": ("self_attention", "linear_qkv"),
    "proj": ("self_attention", "linear_proj"),
    "fc1": ("mlp", "linear_fc1"),
    "fc2": ("mlp", "linear_fc2"),
}


@dataclasses.dataclass
class Attached:
    """What :func:`attach_taco` did: the layers whose linear compresses, their modes, and the parts left stock."""

    layers: Dict[str, List[int]]
    stock: List[str]
    modes: Dict[str, List[int]] = dataclasses.field(default_factory=dict)  # mode (describe_modes) -> compressing layers
    default_mode: str = ""  # the flags' own mode (--taco-mode / --taco-bwd-mode), which the start-up line names

    def describe(self) -> str:
        """One start-up line, e.g. ``qkv 1-8, proj 1-8, fc1 1-8, fc2 1-8; stock: layers 2,4 mlp (MoE experts)``;
        where a layer compresses in another mode than the flags' (an override), every mode's layers:
        ``...; modes: fp8-ash 1,8 | int4-ash (backward fp8-ash) 2-7``."""
        text = ", ".join(f"{name} {format_ranges(numbers) or '-'}" for name, numbers in self.layers.items())
        if list(self.modes) not in ([], [self.default_mode]):
            text += "; modes: " + " | ".join(f"{mode} {format_ranges(numbers)}" for mode, numbers in self.modes.items())
        return text + (f"; runs stock: {'; '.join(self.stock)}" if self.stock else "")


def format_ranges(numbers: List[int]) -> str:
    """[1, 2, 3, 7] -> '1-3,7'."""
    parts, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(f"{start}-{n}" if n != start else f"{n}")
            start = None
    return ",".join(parts)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def _uncovered(layer: torch.nn.Module) -> Dict[str, str]:
    """{part: why} for the parts of a layer whose linears TACO does not reach."""
    parts = {}
    attention, mlp = getattr(layer, "self_attention", None), getattr(layer, "mlp", None)
    if attention is not None and not hasattr(attention, "linear_qkv"):
        kind = "MLA" if "MLA" in type(attention).__name__ else type(attention).__name__
        parts["attention"] = f"attention ({kind})"
    if mlp is not None and hasattr(mlp, "experts"):
        parts["mlp"] = "mlp (MoE experts)"
    elif mlp is not None and type(mlp).__name__.startswith("TEFusedMLP"):  # and TEFusedMLPWithGroupedLinear
        parts["mlp"] = "mlp (TE fused-ops MLP)"
    return parts


_CODEC_SERIAL = itertools.count()  # codecs made by this process, for their stochastic-rounding seeds
SEEDS_PER_RANK = 4096  # rank r's codecs have seeds r * SEEDS_PER_RANK + serial: each rank draws its own noise


def attach_taco(model_chunks: Iterable[torch.nn.Module], config: TacoConfig) -> Attached:
    """Configure every transformer layer's linears; return what was compressed and what runs stock.

    The tensor-parallel ranks then compare their plans (every linear's codecs, --taco-min-bytes,
    --taco-chunk-bytes) and raise :class:`~megatron_taco.comm.SettingsMismatchError` on every rank if they differ:
    a rank taking the stock path where another compresses would hang on NCCL."""
    compressed: Dict[str, List[int]] = {name: [] for name in LINEARS}
    modes: Dict[str, List[int]] = {}
    stock: Dict[str, List[int]] = {}
    codecs: Dict[tuple, TacoCodec] = {}
    plan = {
        "--taco-min-bytes": "auto" if config.min_bytes is None else str(config.min_bytes),
        "--taco-chunk-bytes": str(config.chunk_bytes),
    }
    tp_group = None  # the linears' tensor-parallel group, where the plans are compared
    installs: List[Callable[[], None]] = []  # run once the plans agree (a refusal on one rank would hang the others)

    def linear_compression(settings: LinearSettings, layer_number: int, name: str) -> Optional[LinearCompression]:
        def codec(direction: str) -> Optional[TacoCodec]:
            if not settings.compresses(name, direction):
                return None
            fmt, transform = settings.element_format_for(direction), settings.transform_for(direction)
            rounding = settings.rounding_for(direction)
            key = (settings.group_size, fmt, transform, settings.scales, rounding)
            if key not in codecs:
                codecs[key] = TacoCodec(
                    group_size=settings.group_size,
                    fmt=fmt,
                    transform=transform,
                    scales=settings.scales,
                    backend=config.backend,
                    rounding=rounding,
                    # stochastic rounding's noise: each rank and each codec its own (codecs are made in the same
                    # order on every start, so a run started again draws the same)
                    seed=(dist.get_rank() if dist.is_initialized() else 0) * SEEDS_PER_RANK + next(_CODEC_SERIAL),
                )
            return codecs[key]

        fwd, bwd = codec("fwd"), codec("bwd")
        if fwd is None and bwd is None:
            return None
        return LinearCompression(f"layer {layer_number} {name}", fwd, bwd, config.min_bytes, config.chunk_bytes)

    for chunk in model_chunks:
        gpt = unwrap(chunk)
        if getattr(gpt, "mtp", None) is not None:  # --mtp-num-layers: its layers' TP traffic goes stock
            count = gpt.config.mtp_num_layers  # its layers (one module with --mtp-use-repeated-layer)
            stock_blocks = f"the multi-token prediction block ({count} layer{'s' * (count != 1)}, --mtp-num-layers)"
            stock.setdefault(stock_blocks, [])
        resolved = config.for_model(gpt.config.num_layers)
        for layer in gpt.decoder.layers:
            number = layer.layer_number
            settings = resolved.for_layer(number)
            uncovered = _uncovered(layer)
            for part in uncovered.values():
                stock.setdefault(part, []).append(number)
            te_modules: Dict[int, list] = {}  # id(TE module) -> [module, column cfg, row cfg]
            for name, (parent, attr) in _LINEAR_PATHS.items():
                if parent in uncovered:
                    continue
                owner = getattr(layer, parent)
                linear = getattr(owner, attr, None)
                if linear is None and parent == "mlp" and is_te_linear(owner):  # TE LayerNormMLP: fc1 and fc2 in one
                    linear = owner
                cfg = linear_compression(settings, number, name)
                plan[f"layer {number} {name}"] = (
                    f"forward {describe_codec(cfg.fwd_codec)}, backward {describe_codec(cfg.bwd_codec)}"
                    if cfg is not None
                    else "stock"
                )
                tp_group = tp_group if tp_group is not None else getattr(linear, "tp_group", None)
                if isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
                    installs.append(functools.partial(compress_local_linear, linear, cfg))
                elif linear is not None and is_te_linear(linear):
                    entry = te_modules.setdefault(id(linear), [linear, None, None])
                    entry[1 if name in ("qkv", "fc1") else 2] = cfg
                else:
                    stock.setdefault(f"{attr} ({type(linear).__name__})", []).append(number)
                    continue
                if cfg is not None:
                    compressed[name].append(number)
            for module, column, row in te_modules.values():
                compression = TeCompression(column, row) if column or row else None
                installs.append(functools.partial(compress_te_linear, module, compression))
            if any(number in numbers for numbers in compressed.values()):  # a layer some linear of compresses
                modes.setdefault(settings.describe_modes(), []).append(number)
    if tp_group is not None and dist.is_initialized() and dist.get_world_size(tp_group) > 1:
        ensure_same_plan(tp_group, plan)
    for install in installs:
        install()
    stock_parts = [
        f"layers {format_ranges(sorted(numbers))} {part}" if numbers else part for part, numbers in stock.items()
    ]
    modes = {mode: sorted(numbers) for mode, numbers in modes.items()}
    return Attached(compressed, stock_parts, modes, config.default.describe_modes())


class TacoSwitch:
    """--taco-switch on built model chunks: attaches the switched settings once ``completed`` (the iterations done
    before the next step) reaches the switch's iteration, also when a run resumes past it. Every rank calls it with
    the same count, so the TP ranks of a linear switch between the same two steps."""

    def __init__(self, model_chunks: Iterable[torch.nn.Module], config: TacoConfig):
        self.chunks = list(model_chunks)
        self.config = config
        self.done = config.switch is None

    def __call__(self, completed: int) -> Optional[Attached]:
        """What the switch attached, the first time ``completed`` reaches its iteration; else None."""
        if self.done or completed < self.config.switch[0]:
            return None
        self.done = True
        return attach_taco(self.chunks, self.config.switch[1])
