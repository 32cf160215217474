"""Which TE message goes through TACO, on 2 gloo ranks without Transformer Engine.

``te_linears`` replaces TE's collective names with interceptors; here an interceptor wraps a plain
torch.distributed all-gather with TE's signature (TE itself needs CUDA: tests/test_te_linears.py runs
the real modules on GPUs). Checked: a message of a module with settings goes compressed under the
linear and direction of the routing table; FP8 gathers (a quantizer given), preallocated outputs and
modules without settings reach the original function untouched, and the FP8 gathers of a configured linear
and direction are counted apart in the telemetry (``--fp8-format`` training: TE's, not TACO's).
"""

import torch

from megatron_taco.testing.distributed import run_distributed


def _routing():
    import torch.distributed as dist

    from megatron_taco.codec import TacoCodec
    from megatron_taco.megatron import te_linears
    from megatron_taco.megatron.taco_linears import LinearCompression
    from megatron_taco.megatron.telemetry import TELEMETRY

    calls = []

    def gather_along_first_dim(
        inp, process_group, async_op=False, quantizer=None, output_tensor=None, external_coalescing=False
    ):
        calls.append("original")
        out = torch.empty(inp.shape[0] * 2, *inp.shape[1:], dtype=inp.dtype)
        dist.all_gather_into_tensor(out, inp, group=process_group)
        return out, None

    codec = TacoCodec(transform="ash")
    settings = te_linears.TeCompression(
        column=LinearCompression("layer 3 qkv", codec, codec, 0, 0),
        row=LinearCompression("layer 3 proj", codec, codec, 0, 0),
    )
    x = torch.randn(16, 2, 256, generator=torch.Generator().manual_seed(dist.get_rank()))
    group = dist.group.WORLD
    column_gather = te_linears._intercept(
        "transformer_engine.pytorch.module.linear", "gather_along_first_dim", gather_along_first_dim
    )
    grad_gather = te_linears._intercept(
        "transformer_engine.pytorch.module.base", "gather_along_first_dim", gather_along_first_dim
    )
    TELEMETRY.reset()
    stock, _ = column_gather(x, group)  # no module running: TE's own path
    te_linears._ACTIVE.settings, te_linears._ACTIVE.backward = settings, False
    compressed, handle = column_gather(x, group)
    column_gather(x, group, quantizer=object())  # an FP8 gather: TE's, counted apart
    column_gather(x, group, output_tensor=torch.empty(32, 2, 256))  # preallocated output: TE's
    te_linears._ACTIVE.backward = True
    grad_gather(x, group, async_op=True)  # grad of the row linear, in backward
    backward_only = LinearCompression("layer 4 qkv", None, codec, 0, 0)  # --taco-direction bwd
    te_linears._ACTIVE.settings = te_linears.TeCompression(column=backward_only)
    column_gather(x, group, quantizer=object())  # an FP8 gather in a direction TACO does not compress: not counted
    te_linears._ACTIVE.settings = None
    keys = {key: (rec.calls, rec.compressed_calls, rec.te_calls) for key, rec in TELEMETRY.records.items()}
    return calls, keys, float((compressed - stock).norm() / stock.norm()), handle, TELEMETRY.format_lines()


def test_te_messages_route_by_module_file_direction_and_quantizer():
    calls, keys, error, handle, lines = run_distributed(_routing, 2, timeout=120)[0]
    assert calls == ["original"] * 4
    assert keys == {("layer 3 qkv", "all_gather", "fwd"): (1, 1, 1), ("layer 3 proj", "all_gather", "bwd"): (1, 1, 0)}
    assert 0 < error < 0.05 and handle is None
    assert lines[0].endswith("; 1 all-gathers sent by Transformer Engine in FP8 / FP4"), lines
    assert "; 0 of 2 messages of configured linears went uncompressed" in lines[-1]  # TE's not among them
    assert lines[-1].endswith(
        "; 1 more went as Transformer Engine's own FP8 / FP4 all-gathers (--fp8-format / --fp4-format training; "
        "not in the bytes above)"
    ), lines


def test_start_up_note_names_te_fp8_and_fp4_gathers_under_sequence_parallelism():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_taco.megatron.te_linears import quantized_gathers_note

    def config(**kwargs):
        return TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=2, **kwargs
        )

    assert quantized_gathers_note(config(fp8="hybrid", sequence_parallel=True)).startswith(
        "; under --fp8-format TACO's 4-bit modes take Transformer Engine's FP8 all-gathers"
    )
    assert quantized_gathers_note(config(fp4="e2m1", sequence_parallel=True)).startswith("; under --fp4-format")
    assert quantized_gathers_note(config(fp8="hybrid")) == ""  # no SP: TE all-reduces in bf16, TACO's
    assert quantized_gathers_note(config(sequence_parallel=True)) == ""  # bf16 training


def _below_min_bytes():
    import torch.distributed as dist

    from megatron_taco.codec import TacoCodec
    from megatron_taco.megatron import te_linears
    from megatron_taco.megatron.taco_linears import LinearCompression
    from megatron_taco.megatron.telemetry import TELEMETRY

    handle = object()  # TE's async handle: the caller overlaps the gather with its own work, then waits on it

    def gather_along_first_dim(
        inp, process_group, async_op=False, quantizer=None, output_tensor=None, external_coalescing=False
    ):
        out = torch.empty(inp.shape[0] * 2, *inp.shape[1:], dtype=inp.dtype)
        dist.all_gather_into_tensor(out, inp, group=process_group)
        return out, handle if async_op else None

    gather = te_linears._intercept(
        "transformer_engine.pytorch.module.linear", "gather_along_first_dim", gather_along_first_dim
    )
    codec = TacoCodec()
    te_linears._ACTIVE.settings = te_linears.TeCompression(
        column=LinearCompression("layer 2 qkv", codec, None, 2**30, 0)
    )
    te_linears._ACTIVE.backward = False
    TELEMETRY.reset()
    x = torch.randn(16, 2, 256)
    _, returned = gather(x, dist.group.WORLD, async_op=True)
    te_linears._ACTIVE.settings = None
    record = TELEMETRY.records[("layer 2 qkv", "all_gather", "fwd")]
    return returned is handle, (record.calls, record.compressed_calls, record.payload_bytes)


def test_messages_below_min_bytes_take_tes_own_collective():
    """What TACO would send uncompressed (below --taco-min-bytes, or compression off on NVLink) goes through TE's own
    collective, with its async handle (TE overlaps it with compute), and is counted as sent uncompressed."""
    own, record = run_distributed(_below_min_bytes, 2, timeout=120)[0]
    assert own and record == (1, 0, 16 * 2 * 256 * 4)


class Float8CurrentScalingQuantizer:
    """Stands in for TE's quantizer of that name (TE needs CUDA): records what it casts, returns it marked."""

    def __init__(self):
        self.cast = []

    def __call__(self, tensor):
        self.cast.append(tensor.shape)
        return ("quantized", tensor)


class Float8TensorStorage:
    """Stands in for TE's FP8 tensor: a local input TE cast before its all-gather."""

    def __init__(self, values):
        self.values, self._dtype, self.device = values, values.dtype, values.device

    def size(self, *args):
        return self.values.size(*args)

    def dequantize(self):
        return self.values


def _fp8_gathers():
    import torch.distributed as dist

    from megatron_taco.codec import TacoCodec
    from megatron_taco.megatron import te_linears
    from megatron_taco.megatron.taco_linears import LinearCompression
    from megatron_taco.megatron.telemetry import TELEMETRY

    calls = []

    def gather_along_first_dim(
        inp, process_group, async_op=False, quantizer=None, output_tensor=None, external_coalescing=False
    ):
        calls.append("original")
        return inp, None

    gather = te_linears._intercept(
        "transformer_engine.pytorch.module.linear", "gather_along_first_dim", gather_along_first_dim
    )
    x = torch.randn(16, 2, 256, generator=torch.Generator().manual_seed(dist.get_rank()))
    stock = torch.empty(32, 2, 256)
    dist.all_gather_into_tensor(stock, x)
    results = {}
    # a message of 16 x 2 x 256 fp32 values is 32 KiB: "int4-above" (--taco-min-bytes 1G) sends it uncompressed
    for mode, fmt, min_bytes in (("int4", "int4", 0), ("fp8", "e4m3", 0), ("int4-above", "int4", 2**30)):
        codec = TacoCodec(fmt=fmt)
        te_linears._ACTIVE.settings = te_linears.TeCompression(
            column=LinearCompression(f"layer 1 {mode}", codec, None, min_bytes, 0)
        )
        te_linears._ACTIVE.backward = False
        TELEMETRY.reset()
        quantizer, calls[:] = Float8CurrentScalingQuantizer(), []
        plain, _ = gather(x, dist.group.WORLD, quantizer=quantizer)  # TE casts after (MXFP8-like call)
        cast_before, _ = gather(Float8TensorStorage(x), dist.group.WORLD, quantizer=quantizer)  # TE cast it already
        record = TELEMETRY.records[(f"layer 1 {mode}", "all_gather", "fwd")]
        errors = [
            float((out[1] - stock).norm() / stock.norm()) if isinstance(out, tuple) else None
            for out in (plain, cast_before)
        ]
        results[mode] = (list(calls), quantizer.cast, record.compressed_calls, record.te_calls, errors)
    te_linears._ACTIVE.settings = None
    return results


def test_four_bit_modes_take_te_fp8_gathers_and_eight_bit_modes_leave_them():
    results = run_distributed(_fp8_gathers, 2, timeout=120)[0]
    calls, cast, compressed, by_te, errors = results["int4"]  # 4-bit: fewer bytes than TE's FP8, TACO gathers
    assert calls == [] and cast == [torch.Size([32, 2, 256])] * 2 and (compressed, by_te) == (2, 0)
    assert all(0.05 < error < 0.2 for error in errors), errors  # INT4's error on Gaussian values, then TE casts
    calls, cast, compressed, by_te, errors = results["fp8"]  # 8-bit: no fewer bytes, TE's own FP8 all-gather
    assert calls == ["original"] * 2 and cast == [] and (compressed, by_te) == (0, 2)
    calls, cast, compressed, by_te, errors = results["int4-above"]  # TACO would send it uncompressed: TE's
    assert calls == ["original"] * 2 and cast == [] and (compressed, by_te) == (0, 2)
