"""Attach per-layer TACO settings to a built megatron-core model.

Walks ``model.decoder.layers`` of every model chunk (through DDP and
Float16Module wrappers) and gives each of ``linear_qkv``, ``linear_proj``,
``linear_fc1`` and ``linear_fc2`` the compression its global layer number
resolves to in the :class:`TacoConfig`.
"""

from __future__ import annotations

from typing import Dict, Iterable, List

import torch

from megatron_taco.codec import TacoCodec
from megatron_taco.config.taco import LinearSettings, TacoConfig, TacoConfigError
from megatron_taco.megatron.taco_linears import LinearCompression, TacoColumnParallelLinear, TacoRowParallelLinear

# linear name in the flags -> (submodule, attribute) inside a TransformerLayer
_LINEAR_PATHS = {
    "qkv": ("self_attention", "linear_qkv"),
    "proj": ("self_attention", "linear_proj"),
    "fc1": ("mlp", "linear_fc1"),
    "fc2": ("mlp", "linear_fc2"),
}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def _codec(settings: LinearSettings, backend: str) -> TacoCodec:
    return TacoCodec(
        group_size=settings.group_size, fmt=settings.fmt, transform=settings.transform,
        scales=settings.scales, backend=backend,
    )


def attach_taco(model_chunks: Iterable[torch.nn.Module], config: TacoConfig) -> Dict[str, List[int]]:
    """Configure every transformer layer's linears; return {linear name: layers compressed}."""
    compressed: Dict[str, List[int]] = {name: [] for name in _LINEAR_PATHS}
    codecs: Dict[tuple, TacoCodec] = {}
    for chunk in model_chunks:
        gpt = unwrap(chunk)
        config.check_layers(gpt.config.num_layers)
        for layer in gpt.decoder.layers:
            settings = config.for_layer(layer.layer_number)
            for name, (parent, attr) in _LINEAR_PATHS.items():
                linear = getattr(getattr(layer, parent), attr)
                if not isinstance(linear, (TacoColumnParallelLinear, TacoRowParallelLinear)):
                    raise TacoConfigError(
                        f"layer {layer.layer_number} {attr} is a {type(linear).__name__}: TACO needs the megatron_taco "
                        "layer spec (megatron_taco.megatron.specs.transformer_layer_spec)"
                    )
                key = (settings.group_size, settings.fmt, settings.transform, settings.scales)
                codec = codecs.setdefault(key, _codec(settings, config.backend)) if settings.enabled else None
                fwd = codec if settings.compresses(name, "fwd") else None
                bwd = codec if settings.compresses(name, "bwd") else None
                cfg = None
                if fwd is not None or bwd is not None:
                    cfg = LinearCompression(f"layer {layer.layer_number} {name}", fwd, bwd,
                                            config.min_bytes, config.chunk_bytes)
                    compressed[name].append(layer.layer_number)
                if isinstance(linear, TacoRowParallelLinear):
                    linear.set_taco(cfg)
                else:
                    linear.taco = cfg
    return compressed
