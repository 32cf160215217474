"""Model shapes, TransformerConfig construction and GPTModel building for the trainer.

The initialisation here is layout-invariant: every parameter is drawn from a
generator seeded by its *global* name (global layer number, unsharded shape),
then sliced to this rank's tensor-parallel shard. A model trained with TP=2,
PP=2 or TP=1/PP=1 therefore starts from the same weights, which is what the
equivalence tests compare.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_taco.config.errors import TrainConfigError
from megatron_taco.megatron.specs import decoder_block_spec, transformer_layer_spec

__all__ = ["QWEN_ARCHITECTURE", "ModelShape", "make_transformer_config", "build_gpt_model", "tp_shard", "tp_stride"]

_ACTIVATIONS = {"gelu": (F.gelu, False), "swiglu": (F.silu, True)}


# What makes a model Qwen-style (Qwen2 / 2.5): the fields a ModelShape sets beyond the sizes
QWEN_ARCHITECTURE = dict(
    normalization="RMSNorm",
    activation="swiglu",
    position_embedding="rope",
    rotary_base=1000000,
    add_bias_linear=False,
    add_qkv_bias=True,
    norm_epsilon=1e-6,
)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Architecture of a decoder-only LM (the fields of a ``configs/*.yaml`` model section)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    num_query_groups: Optional[int] = None
    normalization: str = "LayerNorm"
    activation: str = "gelu"
    position_embedding: str = "learned_absolute"
    rotary_base: int = 10000
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    tie_embeddings: bool = False
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02

    def __post_init__(self) -> None:
        if self.activation not in _ACTIVATIONS:
            raise TrainConfigError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {self.activation!r}")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise TrainConfigError(f"normalization must be LayerNorm or RMSNorm, got {self.normalization!r}")
        if self.position_embedding not in ("learned_absolute", "rope"):
            raise TrainConfigError(
                f"position_embedding must be learned_absolute or rope, got {self.position_embedding!r}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise TrainConfigError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """Vocabulary padded to a multiple of 128 * TP, as Megatron does."""
        multiple = 128 * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    @classmethod
    def from_dict(cls, values: Dict[str, Any]) -> "ModelShape":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise TrainConfigError(f"unknown model fields {unknown}; known: {sorted(known)}")
        return cls(**values)


def make_transformer_config(
    shape: ModelShape,
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    sequence_parallel: bool,
    params_dtype: torch.dtype,
    dropout: float = 0.0,
    extra: Optional[Dict[str, Any]] = None,
) -> TransformerConfig:
    """TransformerConfig for ``shape``; ``extra`` adds fields (e.g. the CPU runtime overrides)."""
    activation, gated = _ACTIVATIONS[shape.activation]
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization=shape.normalization,
        layernorm_epsilon=shape.norm_epsilon,
        activation_func=activation,
        gated_linear_unit=gated,
        add_bias_linear=shape.add_bias_linear,
        add_qkv_bias=shape.add_qkv_bias,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        init_method_std=shape.init_method_std,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        **(extra or {}),
    )


def build_gpt_model(
    shape: ModelShape,
    config: TransformerConfig,
    layer_spec: Optional[ModuleSpec] = None,
    seed: int = 1234,
    initialize: bool = True,
    vp_stage: Optional[int] = None,
) -> GPTModel:
    """This rank's pipeline stage of a GPTModel, initialised layout-invariantly (unless ``initialize=False``)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    virtual = {} if vp_stage is None else {"vp_stage": vp_stage}  # chunk of an interleaved pipeline
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_block_spec(config, layer_spec or transformer_layer_spec(), vp_stage),
        vocab_size=shape.padded_vocab_size(tp),
        max_sequence_length=shape.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        share_embeddings_and_output_weights=shape.tie_embeddings,
        position_embedding_type=shape.position_embedding,
        rotary_base=shape.rotary_base,
        **virtual,
    )
    if initialize:
        init_layout_invariant_(model, config, seed)
    return model


_LAYER_INDEX = re.compile(r"decoder\.layers\.(\d+)\.")
_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")


def _global_name(model: GPTModel, name: str) -> str:
    match = _LAYER_INDEX.search(name)
    if not match:
        return name
    layer_number = model.decoder.layers[int(match.group(1))].layer_number  # global, 1-based
    return name[: match.start(1)] + str(layer_number - 1) + name[match.end(1) :]


@torch.no_grad()
def init_layout_invariant_(model: GPTModel, config: TransformerConfig, seed: int) -> None:
    """Initialise every parameter from its global name, then take this rank's TP shard.

    The values depend on the device type the parameters live on (CPU and CUDA generators differ),
    not on the layout: every TP x PP layout on the same kind of device starts from the same model.
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    out_std = config.init_method_std / (2.0 * config.num_layers) ** 0.5
    tied = model.share_embeddings_and_output_weights
    for name, param in model.named_parameters():
        global_name = _global_name(model, name)
        if tied and global_name == "output_layer.weight":  # the last stage's copy of the word embeddings
            global_name = "embedding.word_embeddings.weight"
        sharded = getattr(param, "tensor_model_parallel", False)
        dim = getattr(param, "partition_dim", 0) if sharded else 0
        full_shape = list(param.shape)
        if sharded:
            full_shape[dim] *= tp
        device = param.device  # drawn where the parameter lives: on a GPU, seconds of CPU sampling saved per model
        if name.endswith("bias"):
            full = torch.zeros(full_shape, device=device)
        elif "layernorm" in name or "final_layernorm" in name:
            full = torch.ones(full_shape, device=device)
        else:
            gen = torch.Generator(device=device).manual_seed(seed ^ zlib.crc32(global_name.encode()))
            std = out_std if global_name.endswith(_OUTPUT_PROJECTIONS) else config.init_method_std
            full = torch.empty(full_shape, device=device).normal_(0.0, std, generator=gen)
        if sharded:
            full = tp_shard(full, dim, tp_stride(config, name, param), tp, tp_rank)
        param.copy_(full.to(param.dtype))


def tp_stride(config: TransformerConfig, name: str, param: torch.nn.Parameter) -> int:
    """How many interleaved pieces Megatron splits ``param`` in for TP: 2 for a gated linear_fc1 ([gate; up])."""
    if config.gated_linear_unit and ".linear_fc1." in name:
        return 2
    return getattr(param, "partition_stride", 1)


def tp_shard(full: torch.Tensor, dim: int, stride: int, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s slice of ``full`` along ``dim``: each of ``stride`` pieces split evenly over ``tp``."""
    return torch.cat([piece.chunk(tp, dim=dim)[rank] for piece in full.chunk(stride, dim=dim)], dim=dim)
