"""megatron-core layer specs built from local (non-TE) modules and the SP-capable norm.

One transformer-layer spec serves GPT-style (LayerNorm, GeLU, MHA) and
Qwen2-style (RMSNorm, SwiGLU, GQA, qkv bias, RoPE) models: those differences
live in ``TransformerConfig`` (normalization, gated_linear_unit,
activation_func, num_query_groups, add_qkv_bias) and in ``GPTModel``'s
position-embedding arguments. TACO needs nothing from the spec: it attaches to
the built linears (``megatron_taco.megatron.attach``).
"""

from __future__ import annotations

from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_taco.megatron.norms import SequenceParallelNorm

__all__ = ["LOCAL_SPEC_CONFIG", "transformer_layer_spec", "decoder_block_spec"]

# TransformerConfig fields for models built from these specs: the fused paths they turn off
# need apex or Transformer Engine (CUDA extensions that are not installed with megatron-core).
LOCAL_SPEC_CONFIG = dict(
    gradient_accumulation_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    bias_activation_fusion=False,
    persist_layer_norm=False,
)


def transformer_layer_spec() -> ModuleSpec:
    """A pre-norm transformer layer: norm -> attention -> residual, norm -> MLP -> residual."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=SequenceParallelNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=DotProductAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=SequenceParallelNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def decoder_block_spec(
    config: TransformerConfig, layer_spec: ModuleSpec, vp_stage: Optional[int] = None
) -> TransformerBlockSubmodules:
    """The decoder of this pipeline stage: its layers plus the SP-capable final norm."""
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=SequenceParallelNorm)
