"""TACO on Transformer Engine's linears: their TP traffic goes through ``megatron_taco.comm``.

TE 2.x modules (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``) do their tensor-parallel
communication inside their autograd Functions, through ``gather_along_first_dim``,
``reduce_scatter_along_first_dim`` and ``allreduce`` of ``transformer_engine.pytorch.distributed``,
which each module file imports by name. :func:`install_te_hooks` (once per process) replaces those
names in the module files, and wraps the Functions' forward and backward so that a call knows which
module runs it: the module's forward puts its :class:`TeCompression` in a thread-local; the
Function's forward keeps it in the autograd ``ctx``; the Function's backward puts it back (autograd
runs backward on its own thread, so the thread-local is per thread).

Which linear and direction a message belongs to follows from where TE sends it:

===================================  ==========================================================
call                                 message
===================================  ==========================================================
gather in linear/layernorm_* files   input of the column linear (forward; in backward the same
                                     activations again for the weight gradient: forward codec)
gather in base.py                    output grad of the row linear (``grad_output_preprocess``)
reduce-scatter / all-reduce          forward: output of the row linear; backward: input grad of
                                     the column linear
===================================  ==========================================================

TE's quantized all-gathers (``--fp8-format`` / ``--fp4-format`` training: a quantizer is given, or the input
is already a quantized tensor) stay TE's, counted apart in the telemetry, unless TACO's codec for the message
sends fewer bytes than TE's one byte per value (TACO's 4-bit modes under FP8): then TACO gathers the values
(dequantized where TE had cast them already) and TE's quantizer casts what arrives, so the GEMM gets the
quantized tensor it expects. Left to TE: calls with preallocated outputs or coalescing. Userbuffers
(``--tp-comm-overlap``) bypass these functions; the flag check refuses that combination.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import threading
from typing import Any, Callable, Optional

import torch

from megatron_taco import comm
from megatron_taco.megatron.taco_linears import LinearCompression
from megatron_taco.megatron.telemetry import TELEMETRY

__all__ = ["TeCompression", "is_te_linear", "compress_te_linear", "quantized_gathers_note"]

# TE module file -> its autograd Function class (None: the file only sends output grads of row linears)
_TE_FILES = {
    "transformer_engine.pytorch.module.linear": "_Linear",
    "transformer_engine.pytorch.module.layernorm_linear": "_LayerNormLinear",
    "transformer_engine.pytorch.module.layernorm_mlp": "_LayerNormMLP",
    "transformer_engine.pytorch.module.base": None,
}
_COLLECTIVES = {  # TE's name -> megatron_taco.comm's
    "gather_along_first_dim": comm.all_gather,
    "reduce_scatter_along_first_dim": comm.reduce_scatter,
    "allreduce": comm.all_reduce,
}
_ACTIVE = threading.local()  # .settings: the TeCompression of the module running now; .backward: bool


@dataclasses.dataclass
class TeCompression:
    """The linears of one TE module: a column one, a row one, or both (``LayerNormMLP``: fc1 and fc2)."""

    column: Optional[LinearCompression] = None
    row: Optional[LinearCompression] = None


def is_te_linear(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a TE Linear / LayerNormLinear / LayerNormMLP (without importing TE when absent)."""
    if not type(module).__module__.startswith(("transformer_engine", "megatron.core.extensions")):
        return False
    import transformer_engine.pytorch as te

    return isinstance(module, (te.Linear, te.LayerNormLinear, te.LayerNormMLP))


def _owner(te_file: str, collective: Callable) -> tuple:
    """(LinearCompression or None, direction) of the message this call sends, by the routing table above."""
    settings: TeCompression = _ACTIVE.settings
    if collective is comm.all_gather:
        if te_file.endswith(".base"):
            return settings.row, "bwd"
        return settings.column, "fwd"
    if getattr(_ACTIVE, "backward", False):
        return settings.column, "bwd"
    return settings.row, "fwd"


# TE quantizers whose all-gathers carry one byte per value (and their scales)
_ONE_BYTE_QUANTIZERS = ("Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8BlockQuantizer", "MXFP8Quantizer")


def _takes_over(cfg: LinearCompression, direction: str, quantizer: Any, inp: Any, group: Any) -> bool:
    """Whether TACO sends a quantized all-gather of TE's itself: TE's format has one byte per value, TACO's codec
    sends fewer (its 4-bit modes under ``--fp8-format``) and the message reaches ``--taco-min-bytes`` (below it, or
    with compression off on NVLink, TACO would send the values uncompressed: twice TE's bytes). Then TACO gathers
    the values and ``quantizer`` casts what arrives, as TE does for the formats it gathers in high precision."""
    codec = cfg.codec(direction)
    if codec is None or type(quantizer).__name__ not in _ONE_BYTE_QUANTIZERS:
        return False
    numel = math.prod(inp.size())
    dtype = inp.dtype if type(inp) is torch.Tensor else inp._dtype  # a TE quantized tensor's nominal dtype
    min_bytes = cfg.options(group, inp.device).min_bytes
    return codec.compressed_nbytes(numel) < numel and numel > 0 and numel * dtype.itemsize >= min_bytes


def _intercept(te_file: str, name: str, original: Callable) -> Callable:
    collective = _COLLECTIVES[name]
    signature = inspect.signature(original)

    @functools.wraps(original)
    def call(*args, **kwargs):
        if getattr(_ACTIVE, "settings", None) is None:  # no TACO module running: TE's own path, nothing to bind
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs).arguments
        inp = next(iter(bound.values()))
        preallocated = any(bound.get(k) is not None for k in ("output", "output_tensor")) or bound.get(
            "external_coalescing"
        )
        cfg, direction = (None, None) if preallocated else _owner(te_file, collective)
        if cfg is None:
            return original(*args, **kwargs)
        group = list(bound.values())[1] if len(bound) > 1 else None
        quantizer = bound.get("quantizer")
        if quantizer is not None or type(inp) is not torch.Tensor:  # TE's FP8 / FP4 all-gather
            if _takes_over(cfg, direction, quantizer, inp, group):
                high = inp if type(inp) is torch.Tensor else inp.dequantize()  # TE's activation dtype
                return quantizer(cfg.run(collective, high.contiguous(), group, direction)), None
            if cfg.codec(direction) is not None:
                TELEMETRY.record_sent_by_te((cfg.name, collective.__name__, direction))
            return original(*args, **kwargs)
        if not comm.compresses(inp, cfg.codec(direction), cfg.options(group, inp.device)):
            # TACO would send it as it is: TE's own collective, with TE's overlap of it (async handles)
            TELEMETRY.record_uncompressed((cfg.name, collective.__name__, direction), inp.numel() * inp.element_size())
            return original(*args, **kwargs)
        return cfg.run(collective, inp.contiguous(), group, direction), None

    call.taco_original = original
    return call


def _with_settings(function_cls: type) -> None:
    """Wrap an autograd Function's forward/backward so TE's collectives inside know their module."""
    forward, backward = function_cls.forward, function_cls.backward

    @functools.wraps(forward)
    def forward_with_settings(ctx, *args, **kwargs):
        if ctx is not None:
            ctx.taco_settings = getattr(_ACTIVE, "settings", None)
        return forward(ctx, *args, **kwargs)

    @functools.wraps(backward)
    def backward_with_settings(ctx, *grads):
        saved = getattr(_ACTIVE, "settings", None), getattr(_ACTIVE, "backward", False)
        _ACTIVE.settings, _ACTIVE.backward = getattr(ctx, "taco_settings", None), True
        try:
            return backward(ctx, *grads)
        finally:
            _ACTIVE.settings, _ACTIVE.backward = saved

    function_cls.forward = staticmethod(forward_with_settings)
    function_cls.backward = staticmethod(backward_with_settings)


_INSTALLED = {"done": False}


def install_te_hooks() -> None:
    """Route TE's TP collectives through TACO where a module has settings attached (idempotent)."""
    if _INSTALLED["done"]:
        return
    for file_name, function_name in _TE_FILES.items():
        module = importlib.import_module(file_name)
        for name in _COLLECTIVES:
            original = getattr(module, name, None)
            if original is not None:
                setattr(module, name, _intercept(file_name, name, getattr(original, "taco_original", original)))
        if function_name is not None:
            _with_settings(getattr(module, function_name))
    _INSTALLED["done"] = True


def compress_te_linear(module: torch.nn.Module, settings: Optional[TeCompression]) -> None:
    """Attach (or, with None, detach) TACO settings to a built TE linear module."""
    install_te_hooks()
    if not hasattr(module, "stock_forward"):
        module.stock_forward = module.forward

        def forward(*args: Any, **kwargs: Any):
            saved = getattr(_ACTIVE, "settings", None), getattr(_ACTIVE, "backward", False)
            _ACTIVE.settings, _ACTIVE.backward = module.taco, False
            try:
                return module.stock_forward(*args, **kwargs)
            finally:
                _ACTIVE.settings, _ACTIVE.backward = saved

        module.forward = forward
    module.taco = settings


def quantized_gathers_note(config: Any) -> str:
    """The start-up line's note for TE FP8 / FP4 training under sequence parallelism (``config``: the model's
    TransformerConfig): who sends the all-gathers TE would send quantized."""
    if not getattr(config, "sequence_parallel", False):
        return ""
    if getattr(config, "fp8", None):
        return (
            "; under --fp8-format TACO's 4-bit modes take Transformer Engine's FP8 all-gathers of compressed messages "
            "(TACO gathers, TE's quantizer casts what arrives), its 8-bit modes leave them to TE (counted apart in the "
            "telemetry)"
        )
    if getattr(config, "fp4", None):
        return (
            "; under --fp4-format Transformer Engine sends the all-gathers of its FP4 layers itself (counted apart in "
            "the telemetry): TACO compresses the reduce-scatters"
        )
    return ""
