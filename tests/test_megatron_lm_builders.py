"""TACO through Megatron-LM's own model-building code, called the way Megatron-LM calls it.

``megatron.training.models.gpt`` (in the megatron-core wheel from 0.17) is what Megatron-LM 0.19's
``pretrain_gpt.py`` builds the model with: it calls ``get_gpt_layer_local_spec`` positionally and imported
it by name long before our hooks exist. These tests install the hooks, build through that code (and
through the spec function called positionally and by keyword), on 2 real gloo ranks with TP=2 + SP, and
check that every chosen linear sends compressed traffic and the others do not.
"""

import pytest
import torch

import megatron_taco.launch  # noqa: F401  (its Python 3.11 shim lets megatron.training import)
from megatron_taco.config.taco import LinearSettings, TacoConfig
from megatron_taco.testing.distributed import run_distributed
from megatron_taco.testing.models import TINY_GPT, TINY_QWEN

try:
    import megatron.training.models.gpt  # noqa: F401
except ImportError:
    pytest.skip(
        "needs megatron.training.models (Megatron-LM's builders; in the megatron-core wheel from 0.19)",
        allow_module_level=True,
    )

SELECTION = TacoConfig(
    default=LinearSettings(mode="fp8-ash", linears=frozenset({"qkv", "fc2"})), layers=((2, 3),), min_bytes=0
)


def _build_and_step(shape, how: str, taco: TacoConfig):
    """Install the hooks, build a TP=2 + SP model the way ``how`` says, run one forward/backward; report."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

    from megatron_taco import launch
    from megatron_taco.megatron.cpu_runtime import cpu_config_overrides, enable_cpu_runtime
    from megatron_taco.megatron.norms import SequenceParallelNorm
    from megatron_taco.megatron.specs import LOCAL_SPEC_CONFIG
    from megatron_taco.megatron.telemetry import TELEMETRY
    from megatron_taco.training.model import make_transformer_config

    enable_cpu_runtime()
    parallel_state.initialize_model_parallel(2, 1)
    model_parallel_cuda_manual_seed(3)
    launch.install_hooks()
    launch._STATE["taco"] = taco
    config = make_transformer_config(
        shape,
        tensor_parallel=2,
        pipeline_parallel=1,
        sequence_parallel=True,
        params_dtype=torch.float32,
        extra={**LOCAL_SPEC_CONFIG, **cpu_config_overrides()},
    )
    config.transformer_impl = "local"
    model_kwargs = dict(
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length,
        position_embedding_type=shape.position_embedding,
        share_embeddings_and_output_weights=shape.position_embedding != "rope",
    )
    if how == "megatron_lm_builder":  # Megatron-LM 0.19: default_layer_spec -> positional spec call
        model_config = GPTModelConfig(
            transformer=config,
            vocab_size=shape.vocab_size,
            seq_length=shape.seq_length,
            position_embedding_type=shape.position_embedding,
            share_embeddings_and_output_weights=model_kwargs["share_embeddings_and_output_weights"],
        )
        model = GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups())
    elif how == "positional":  # as gpt_builders.py calls it
        spec = get_gpt_layer_local_spec(None, False, False, False, None, normalization=shape.normalization)
        model = GPTModel(config, spec, **model_kwargs)
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, normalization=shape.normalization
        )
        model = GPTModel(config, spec, **model_kwargs)

    TELEMETRY.reset()
    tokens = torch.randint(0, shape.vocab_size, (2, shape.seq_length), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(shape.seq_length).expand(2, -1)
    loss = model(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    norms = [type(layer.input_layernorm) for layer in model.decoder.layers] + [type(model.decoder.final_layernorm)]
    return {
        "norms_sp": all(norm is SequenceParallelNorm for norm in norms),
        "traffic": {key: (rec.calls, rec.compressed_calls) for key, rec in TELEMETRY.records.items()},
        "loss": float(loss),
    }


@pytest.mark.parametrize("shape", [TINY_GPT, TINY_QWEN], ids=["gpt", "qwen"])
@pytest.mark.parametrize("how", ["megatron_lm_builder", "positional", "keyword"])
def test_taco_reaches_the_chosen_linears_however_megatron_builds_the_model(shape, how):
    report = run_distributed(_build_and_step, 2, shape, how, SELECTION, timeout=180)[0]
    assert report["norms_sp"], "without apex, SP needs the SP-capable norm in every layer and the final norm"
    expected = {}
    for layer in (2, 3):
        expected[(f"layer {layer} qkv", "all_gather", "fwd")] = (1, 1)
        expected[(f"layer {layer} qkv", "reduce_scatter", "bwd")] = (1, 1)
        expected[(f"layer {layer} fc2", "reduce_scatter", "fwd")] = (1, 1)
        expected[(f"layer {layer} fc2", "all_gather", "bwd")] = (1, 1)
    assert report["traffic"] == expected


def test_mode_none_builds_megatron_lm_model_unchanged():
    """Hooks installed but TACO off: no linear is touched (same loss as a model built without hooks)."""
    report = run_distributed(_build_and_step, 2, TINY_GPT, "megatron_lm_builder", TacoConfig(), timeout=180)[0]
    assert report["traffic"] == {}
    assert report["norms_sp"]


def _moe_start_up_line(
    taco: TacoConfig = TacoConfig(default=LinearSettings(mode="fp8-ash"), min_bytes=0), mtp: bool = False
) -> str:
    """The start-up line of a TP=1 GPT with 2 MoE experts per layer (``mtp``: dense, with one multi-token
    prediction layer instead)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_taco.megatron.attach import attach_taco
    from megatron_taco.megatron.cpu_runtime import cpu_config_overrides, enable_cpu_runtime
    from megatron_taco.megatron.specs import LOCAL_SPEC_CONFIG
    from megatron_taco.training.model import make_transformer_config

    enable_cpu_runtime()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(3)
    moe = {"num_moe_experts": 2, "moe_router_topk": 1, "moe_router_pre_softmax": True, "moe_ffn_hidden_size": 128}
    config = make_transformer_config(
        TINY_GPT,
        tensor_parallel=1,
        pipeline_parallel=1,
        sequence_parallel=False,
        params_dtype=torch.float32,
        extra={**LOCAL_SPEC_CONFIG, **cpu_config_overrides(), **({"mtp_num_layers": 1} if mtp else moe)},
    )
    spec = get_gpt_layer_local_spec(None if mtp else 2, False, False, False, None)
    model = GPTModel(
        config,
        spec,
        vocab_size=128,
        max_sequence_length=TINY_GPT.seq_length,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if mtp else None,
    )
    return attach_taco([model], taco).describe()


def test_moe_experts_run_stock_and_the_start_up_line_says_so():
    line = run_distributed(_moe_start_up_line, 1, timeout=120)[0]
    assert line == "qkv 1-4, proj 1-4, fc1 -, fc2 -; runs stock: layers 1-4 mlp (MoE experts)"


def test_the_start_up_line_names_the_modes_of_the_layers_that_compress():
    """Modes appear where a layer compresses in another mode than the flags' (here: none); a layer whose override
    reaches only linears that run stock (the MoE experts' fc1 / fc2) compresses nothing and is not named."""
    overrides = (
        (((1, 1),), LinearSettings(mode="fp8-ash", linears=frozenset({"fc1", "fc2"}))),
        (((2, 3),), LinearSettings(mode="int4-ash", bwd_mode="fp8-ash")),
    )
    config = TacoConfig(default=LinearSettings(mode="none"), overrides=overrides, min_bytes=0)
    line = run_distributed(_moe_start_up_line, 1, config, timeout=120)[0]
    assert line.startswith("qkv 2-3, proj 2-3, fc1 -, fc2 -; modes: int4-ash (backward fp8-ash) 2-3; runs stock")


def test_multi_token_prediction_layers_run_stock_and_the_start_up_line_says_so():
    """--mtp-num-layers builds transformer layers outside the decoder: TACO leaves them stock and names them."""
    line = run_distributed(_moe_start_up_line, 1, mtp=True, timeout=120)[0]
    assert line == (
        "qkv 1-4, proj 1-4, fc1 1-4, fc2 1-4; runs stock: the multi-token prediction block (1 layer, --mtp-num-layers)"
    )
