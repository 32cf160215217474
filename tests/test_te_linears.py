"""TACO on Transformer Engine's linears (2 GPUs, NCCL, TE installed; skipped elsewhere with the reason).

Each TE module runs forward and backward stock, then with TACO attached: the traffic TACO saw must be
exactly the module's TP messages (bf16), or only the ones TE does not already send in FP8 (under
``fp8_autocast``), and outputs and input gradients must stay within the FP8 codec's error of stock.
"""

import importlib.util

import pytest
import torch

from megatron_taco.testing.distributed import run_distributed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None or torch.cuda.device_count() < 2,
    reason="needs Transformer Engine and 2 GPUs (the GPU machine: ../shared/tools/te_kit.py installs TE)",
)


@pytest.fixture(autouse=True)
def _spawned_ranks(monkeypatch):
    """Fresh rank processes: the parent may have touched CUDA (TE's import does), which a fork cannot inherit."""
    monkeypatch.setenv("TACO_TEST_START_METHOD", "spawn")


SEQ, BATCH, HIDDEN, FFN = 256, 2, 512, 1024
# FP8 E4M3 after the Hadamard: relative L2 error of one quantization ~2-3%; two in a row (all-reduce) ~4%
REL_ERROR_BOUND = 0.06


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _te_module_traffic(kind: str, sequence_parallel: bool, fp8: bool):
    import transformer_engine.pytorch as te
    import torch.distributed as dist

    from megatron_taco.codec import TacoCodec
    from megatron_taco.megatron.taco_linears import LinearCompression
    from megatron_taco.megatron.te_linears import TeCompression, compress_te_linear
    from megatron_taco.megatron.telemetry import TELEMETRY

    group = dist.new_group([0, 1])
    torch.manual_seed(0)  # same weights on both ranks: each holds its own shard of a random matrix
    common = dict(sequence_parallel=sequence_parallel, tp_group=group, tp_size=2, params_dtype=torch.bfloat16)
    if kind == "layernorm_mlp":
        module = te.LayerNormMLP(HIDDEN, FFN, set_parallel_mode=True, **common)
    elif kind == "column":
        module = te.LayerNormLinear(HIDDEN, FFN, parallel_mode="column", **common)
    else:
        module = te.Linear(FFN, HIDDEN, parallel_mode="row", **common)
    module = module.cuda()
    rank = dist.get_rank()
    gen = torch.Generator(device="cuda").manual_seed(10 + rank)
    width = FFN // 2 if kind == "row" else HIDDEN
    rows = SEQ // 2 if sequence_parallel and kind != "row" else SEQ  # the row linear's input is not SP-split
    x = torch.randn(rows, BATCH, width, device="cuda", dtype=torch.bfloat16, generator=gen)
    x[:, :, :4] *= 30  # outlier channels, as in real activations
    grad = torch.randn(module(x).shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step():
        inp = x.clone().requires_grad_(True)
        with te.fp8_autocast(enabled=fp8):
            out = module(inp)
        out.backward(grad)
        return out.detach(), inp.grad.detach()

    if fp8:  # TE's delayed scaling: the first step fills the amax history every later step scales by
        step()
    stock_out, stock_grad = step()
    codec = TacoCodec(transform="ash")
    column = LinearCompression("layer 1 fc1", codec, codec, 0, 128 << 20) if kind != "row" else None
    row = LinearCompression("layer 1 fc2", codec, codec, 0, 128 << 20) if kind != "column" else None
    compress_te_linear(module, TeCompression(column, row))
    TELEMETRY.reset()
    taco_out, taco_grad = step()
    traffic = {key: (rec.calls, rec.compressed_calls) for key, rec in TELEMETRY.records.items()}
    compress_te_linear(module, None)
    TELEMETRY.reset()
    again_out, _ = step()
    return {
        "traffic": sorted(traffic.items()),
        "out_error": _rel(taco_out, stock_out),
        "grad_error": _rel(taco_grad, stock_grad),
        "detached_is_stock": bool(torch.equal(again_out, stock_out)) and not TELEMETRY.records,
    }


def _keys(result):
    return {key for key, (calls, compressed) in result["traffic"] if calls == compressed}


@pytest.mark.parametrize("kind", ["column", "row", "layernorm_mlp"])
def test_te_linears_send_their_bf16_tp_traffic_through_taco(kind):
    result = run_distributed(_te_module_traffic, 2, kind, True, False, backend="nccl", timeout=300)[0]
    expected = set()
    if kind != "row":
        expected |= {("layer 1 fc1", "all_gather", "fwd"), ("layer 1 fc1", "reduce_scatter", "bwd")}
    if kind != "column":
        expected |= {("layer 1 fc2", "reduce_scatter", "fwd"), ("layer 1 fc2", "all_gather", "bwd")}
    assert {key for key, _ in result["traffic"]} == expected and _keys(result) == expected, result
    assert 0 < result["out_error"] < REL_ERROR_BOUND and 0 < result["grad_error"] < REL_ERROR_BOUND, result
    assert result["detached_is_stock"]


@pytest.mark.parametrize("kind", ["column", "row"])
def test_te_linears_without_sequence_parallel_compress_the_all_reduce(kind):
    result = run_distributed(_te_module_traffic, 2, kind, False, False, backend="nccl", timeout=300)[0]
    expected = {("layer 1 fc1", "all_reduce", "bwd")} if kind == "column" else {("layer 1 fc2", "all_reduce", "fwd")}
    assert _keys(result) == expected and len(result["traffic"]) == 1, result
    assert 0 < result["out_error" if kind == "row" else "grad_error"] < REL_ERROR_BOUND, result


@pytest.mark.parametrize("kind", ["column", "row"])
def test_under_te_fp8_taco_leaves_te_fp8_all_gathers_alone(kind):
    """TE sends the column input and the row output grad in FP8 itself; TACO takes what goes in bf16."""
    result = run_distributed(_te_module_traffic, 2, kind, True, True, backend="nccl", timeout=300)[0]
    expected = (
        {("layer 1 fc1", "reduce_scatter", "bwd")} if kind == "column" else {("layer 1 fc2", "reduce_scatter", "fwd")}
    )
    assert {key for key, _ in result["traffic"]} == expected and _keys(result) == expected, result
    assert result["out_error"] < REL_ERROR_BOUND and result["grad_error"] < REL_ERROR_BOUND, result
