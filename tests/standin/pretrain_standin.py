"""A stand-in for Megatron-LM 0.19's pretrain_gpt.py (no Megatron-LM code), for the launcher test.

It makes Megatron-LM's calls in Megatron-LM's order: imports ``megatron.training`` (whose model builder
imports ``get_gpt_layer_local_spec`` by name) before anything else, parses its flags with Megatron-LM's
argument parser and an extra_args_provider of its own, and builds the model with Megatron-LM's
``GPTModelBuilder`` (``megatron/training/models/gpt.py``: the positional spec call). Then it writes what
it got (the parsed TACO flags, the attached settings, the norms) as JSON.
"""

import json
import os
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.training.arguments import core_transformer_config_from_args, parse_args
from megatron.training.global_vars import set_args
from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

from megatron_taco.megatron.cpu_runtime import cpu_config_overrides, enable_cpu_runtime
from megatron_taco.megatron.specs import LOCAL_SPEC_CONFIG
from megatron_taco.megatron.telemetry import TELEMETRY
from megatron_taco.testing.distributed import free_port


def extra_args(parser):
    parser.add_argument("--standin-out", required=True)
    return parser


def _forward_format(linear) -> Optional[str]:
    """What the linear's forward traffic travels as (e4m3, int4, e2m1); None when it is not compressed."""
    compression = getattr(linear, "taco", None)
    codec = compression.fwd_codec if compression is not None else None
    return codec.settings.fmt if codec is not None else None


def main():
    args = parse_args(extra_args_provider=extra_args)
    if "RANK" in os.environ:  # under torchrun, as Megatron-LM runs
        dist.init_process_group("gloo")
    else:
        init = f"tcp://127.0.0.1:{free_port()}"
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=init)
    enable_cpu_runtime()
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, 1)
    model_parallel_cuda_manual_seed(1)
    args.params_dtype = args.params_dtype if hasattr(args, "params_dtype") else None
    config = core_transformer_config_from_args(args)
    for key, value in {**LOCAL_SPEC_CONFIG, **cpu_config_overrides()}.items():
        setattr(config, key, value)
    model = GPTModelBuilder(GPTModelConfig(transformer=config, vocab_size=128, seq_length=args.seq_length)).build_model(
        ProcessGroupCollection.use_mpu_process_groups()
    )
    report = {
        "taco_mode": args.taco_mode,
        "layers": [
            {
                "qkv_compressed": getattr(layer.self_attention.linear_qkv, "taco", None) is not None,
                "fc2_compressed": getattr(layer.mlp.linear_fc2, "taco", None) is not None,
                "fc2_fwd_format": _forward_format(layer.mlp.linear_fc2),
            }
            for layer in model.decoder.layers
        ],
        "final_norm": type(model.decoder.final_layernorm).__name__,
        "error_sample_interval": TELEMETRY.error_sample_interval,  # --taco-error-sample-interval, as the hooks set it
    }
    if (
        args.taco_switch is not None
    ):  # forward passes as Megatron-LM's train() makes them: args.curr_iteration set first
        set_args(args)  # initialize_megatron's global args, which megatron.training.get_args returns
        switch_iteration = int(args.taco_switch.split(":")[0])
        tokens = torch.randint(0, 128, (1, args.seq_length), generator=torch.Generator().manual_seed(0))  # every rank
        positions = torch.arange(args.seq_length)[None]
        report["fc2_fwd_format_at"] = {}
        for iteration in (0, switch_iteration - 1, switch_iteration):
            args.curr_iteration = iteration
            model(tokens, positions, None)
            report["fc2_fwd_format_at"][iteration] = [
                _forward_format(layer.mlp.linear_fc2) for layer in model.decoder.layers
            ]
    if dist.get_rank() == 0:
        with open(args.standin_out, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
