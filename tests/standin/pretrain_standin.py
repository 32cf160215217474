"""A stand-in for Megatron-LM's pretrain_gpt.py, written for the launcher test (no Megatron-LM code).

Like the real script it parses its flags with Megatron-LM's argument parser (with an
extra_args_provider of its own) and builds GPTModel from get_gpt_layer_local_spec; then it
writes what it got (the parsed TACO flags, the linear classes, the attached settings) as JSON.
"""

import json
import socket

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import parse_args

from megatron_taco.megatron.cpu_runtime import cpu_config_overrides, enable_cpu_runtime
from megatron_taco.megatron.specs import LOCAL_SPEC_CONFIG


def extra_args(parser):
    parser.add_argument("--standin-out", required=True)
    return parser


def main():
    args = parse_args(extra_args_provider=extra_args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    enable_cpu_runtime()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                               num_attention_heads=args.num_attention_heads, **LOCAL_SPEC_CONFIG,
                               **cpu_config_overrides())
    model = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                     max_sequence_length=args.seq_length)
    report = {
        "taco_mode": args.taco_mode,
        "layers": [
            {
                "qkv": type(layer.self_attention.linear_qkv).__name__,
                "fc2": type(layer.mlp.linear_fc2).__name__,
                "qkv_compressed": getattr(layer.self_attention.linear_qkv, "taco", None) is not None,
                "fc2_compressed": getattr(layer.mlp.linear_fc2, "taco", None) is not None,
            }
            for layer in model.decoder.layers
        ],
        "final_norm": type(model.decoder.final_layernorm).__name__,
    }
    with open(args.standin_out, "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
