"""TACO inside megatron-core: compressed TP/SP linears on real gloo ranks, flags, telemetry."""

import argparse
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from megatron_taco.codec.format import CodecSettings
from megatron_taco.config.taco import (
    LINEARS,
    LinearSettings,
    TacoConfig,
    TacoConfigError,
    add_taco_args,
    taco_config_from_args,
)
from megatron_taco.testing.distributed import run_distributed
from megatron_taco.testing.models import TINY_GPT, TINY_QWEN
from megatron_taco.training.data import synthetic_batches
from megatron_taco.training.loop import TrainConfig, Trainer

ALWAYS = dict(min_bytes=0)  # compress every message (the link probe would skip tiny CPU messages)
FP8_ASH = TacoConfig(default=LinearSettings(mode="fp8-ash"), **ALWAYS)

# Compressed vs uncompressed training, 30 steps: the largest per-step |loss_taco - loss| / loss, measured
# on CPU on 2026-12-01 (torch 2.13.0, numpy 2.4.6, triton 3.9.0; the same numbers at 87d8ee0, where the
# bounds were first set from 0.237% / 0.961% / 1.998% in that day's earlier environment): GPT with SP
# 0.328% (step 29), Qwen without SP 1.093% (step 25), Qwen with SP 1.665% (step 26); each bound is 1.3x
# of its case (benchmarks/results/logs/fp8_ash_loss_bounds_cpu_2026-12-01.log). The two runs drift apart as training goes on, so any change of the codec's numbers, right
# or wrong, or of the environment's moves these: re-measure after one. Mistakes in the codec settings
# are caught directly by test_every_linear_gets_exactly_the_codec_the_flags_ask_for.
LOSS_REL_BOUND = {"gpt-sp": 0.0043, "qwen-nosp": 0.0142, "qwen-sp": 0.0217}


def _train(shape, sp, steps, taco, lr=3e-3):
    cfg = TrainConfig(shape, tensor_parallel=2, sequence_parallel=sp, lr=lr, taco=taco)
    trainer = Trainer(cfg)
    data = synthetic_batches(shape.vocab_size, shape.seq_length, cfg.micro_batch_size, seed=5)
    losses = [trainer.train_step(data)["loss"] for _ in range(steps)]
    trainer.close()
    return losses


@pytest.mark.parametrize("shape", [TINY_GPT, TINY_QWEN], ids=["gpt", "qwen"])
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "nosp"])
def test_mode_none_is_bit_identical_to_stock_megatron(shape, sp):
    stock = run_distributed(_train, 2, shape, sp, 3, None, timeout=120)[0]
    none = run_distributed(_train, 2, shape, sp, 3, TacoConfig(), timeout=120)[0]
    assert stock == none


def test_compression_off_by_threshold_takes_the_stock_path_exactly():
    """When no message reaches --taco-min-bytes (e.g. the link probe switched compression off),
    TACO's linears run megatron-core's own code path: same numbers as stock."""
    never = TacoConfig(default=LinearSettings(mode="fp8-ash"), min_bytes=1 << 40)
    stock = run_distributed(_train, 2, TINY_GPT, True, 3, None, timeout=120)[0]
    off = run_distributed(_train, 2, TINY_GPT, True, 3, never, timeout=120)[0]
    assert stock == off


@pytest.mark.parametrize("case", list(LOSS_REL_BOUND))
def test_fp8_ash_training_stays_close_to_baseline(case):
    shape, sp = {"gpt-sp": (TINY_GPT, True), "qwen-nosp": (TINY_QWEN, False), "qwen-sp": (TINY_QWEN, True)}[case]
    base = run_distributed(_train, 2, shape, sp, 30, None, timeout=300)[0]
    taco = run_distributed(_train, 2, shape, sp, 30, FP8_ASH, timeout=300)[0]
    rel = [abs(a - b) / b for a, b in zip(taco, base)]
    worst = max(rel)
    assert worst <= LOSS_REL_BOUND[case], f"{case}: loss {worst:.3%} from the baseline at step {rel.index(worst)}"
    assert taco != base, "compression must change the numbers a little"
    assert taco[-1] < 0.85 * taco[0], "training with TACO must still learn"


def _selection_worker(taco):
    from megatron_taco.megatron.telemetry import TELEMETRY

    TELEMETRY.reset()
    cfg = TrainConfig(TINY_GPT, tensor_parallel=2, sequence_parallel=True, taco=taco)
    trainer = Trainer(cfg)
    trainer.train_step(synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, 2, seed=1))
    trainer.close()
    return trainer.taco_attached.layers, {k: (r.calls, r.compressed_calls) for k, r in TELEMETRY.records.items()}


def test_per_layer_selection_compresses_exactly_the_chosen_layers():
    taco = TacoConfig(
        default=LinearSettings(mode="fp8-ash", linears=frozenset({"fc1", "fc2"})),
        layers=((2, 3),),
        overrides=((((3, 3),), LinearSettings(mode="fp8", linears=frozenset({"qkv"}), direction="fwd")),),
        **ALWAYS,
    )
    attached, records = run_distributed(_selection_worker, 2, taco, timeout=120)[0]
    assert attached == {"qkv": [3], "proj": [], "fc1": [2], "fc2": [2]}
    expected = {
        ("layer 2 fc1", "all_gather", "fwd"),
        ("layer 2 fc1", "reduce_scatter", "bwd"),
        ("layer 2 fc2", "reduce_scatter", "fwd"),
        ("layer 2 fc2", "all_gather", "bwd"),
        ("layer 3 qkv", "all_gather", "fwd"),
        ("layer 3 qkv", "reduce_scatter", "bwd"),
    }
    assert set(records) == expected
    micro_batches = 2
    for key, (calls, compressed) in records.items():
        assert calls == micro_batches
        # layer 3 qkv compresses forward only: its backward reduce-scatter runs uncompressed.
        assert compressed == (0 if key == ("layer 3 qkv", "reduce_scatter", "bwd") else micro_batches), key


_COLLECTIVES = (
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_to_all_single",
    "_all_gather_base",
    "_reduce_scatter_base",
)


def _count_worker(taco):
    """Count every collective on the TP group during one training step (after a warm-up step)."""
    from megatron.core import parallel_state

    cfg = TrainConfig(TINY_GPT, tensor_parallel=2, sequence_parallel=True, taco=taco)
    trainer = Trainer(cfg)
    data = synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, 2, seed=1)
    trainer.train_step(data)  # first step: settings handshakes
    tp_ranks = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    counts = {}
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counting(name):
        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            tensor = args[1] if name != "all_reduce" else args[0]
            if ranks == tp_ranks:
                key = (
                    name,
                    "compressed" if tensor.dtype == torch.uint8 else str(tensor.dtype).replace("torch.", ""),
                    tuple(tensor.shape),
                )
                counts[key] = counts.get(key, 0) + 1
            return originals[name](*args, **kwargs)

        return wrapper

    # megatron-core also holds aliases of the gather / reduce-scatter functions: count those too.
    from megatron.core.tensor_parallel import layers, mappings

    patched = []
    for module in (dist, mappings, layers):
        for attr, fn in list(vars(module).items()):
            for name, original in originals.items():
                if fn is original and (module is dist or attr.startswith("dist_")):
                    patched.append((module, attr, fn))
                    setattr(module, attr, counting(name))
    try:
        trainer.train_step(data)
    finally:
        for module, attr, fn in patched:
            setattr(module, attr, fn)
        trainer.close()
    return counts


def test_count_of_tp_collectives_shows_which_were_compressed():
    counts = run_distributed(_count_worker, 2, FP8_ASH, timeout=120)[0]
    compressed = sum(n for (_, kind, _), n in counts.items() if kind == "compressed")
    layers, linears, micro_batches = TINY_GPT.num_layers, 4, 2
    # every linear: one forward and one backward collective per micro-batch, all compressed
    assert compressed == layers * linears * 2 * micro_batches, counts
    # What stays uncompressed, per micro-batch: the embedding's all-reduce (forward) and all-gather
    # (backward of its SP scatter); the output layer's all-gather (forward), re-gather and
    # reduce-scatter (backward); then small ones: the vocab-parallel cross-entropy's [s, b]
    # all-reduces and the SP norms' gradient all-reduce.
    s, b, h = TINY_GPT.seq_length, 2, TINY_GPT.hidden_size

    def activation_sized(table):
        return sum(
            n
            for (_, kind, shape), n in table.items()
            if kind != "compressed" and torch.Size(shape).numel() >= s * b * h // 2
        )

    assert activation_sized(counts) == 5 * micro_batches, counts
    # Site for site, the compressed run replaces the stock run's activation collectives, except
    # the stock column-parallel backward's re-gather of its input, which TACO's linears skip.
    stock = run_distributed(_count_worker, 2, None, timeout=120)[0]
    regathers = layers * 2 * micro_batches
    assert compressed + activation_sized(counts) + regathers == activation_sized(stock), stock


TINY_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "gpt-tiny.yaml")
_LINEAR_PATHS = {
    "qkv": ("self_attention", "linear_qkv"),
    "proj": ("self_attention", "linear_proj"),
    "fc1": ("mlp", "linear_fc1"),
    "fc2": ("mlp", "linear_fc2"),
}


def _settings_worker(argv):
    """Start the trainer from command-line flags as ``megatron_taco.training.cli`` does; return every
    linear's (forward, backward) codec settings and backend, and the settings in the header of every
    compressed message sent during one training step."""
    from megatron_taco.codec.format import describe_settings_bytes
    from megatron_taco.megatron.attach import unwrap
    from megatron_taco.training import cli

    args = cli.parse_args(["--config", TINY_CONFIG, *argv])
    trainer = Trainer(cli.startup_config(args, dist.get_world_size()))
    linears = {}
    for layer in unwrap(trainer.model).decoder.layers:
        for name, (parent, attr) in _LINEAR_PATHS.items():
            cfg = getattr(getattr(layer, parent), attr).taco
            linears[layer.layer_number, name] = (
                None
                if cfg is None
                else tuple(
                    None if codec is None else (codec.settings, codec.backend)
                    for codec in (cfg.fwd_codec, cfg.bwd_codec)
                )
            )

    on_the_wire = set()
    originals = {name: getattr(dist, name) for name in ("all_gather_into_tensor", "all_to_all_single")}

    def reading_headers(name):
        def wrapper(output, message, *rest, **kwargs):
            # a compressed message: a 16-byte header and its codes and scales (the 24-byte settings
            # handshake, TACO + settings or zeros for uncompressed + min_bytes + chunk_bytes, is not one)
            if message.dtype == torch.uint8 and message.shape[-1] > 24:
                for row in message.view(-1, message.shape[-1]):
                    raw = bytes(row[:8].tolist())
                    assert raw[:4] == b"TACO", raw
                    on_the_wire.add(describe_settings_bytes(raw[4:8]))
            return originals[name](output, message, *rest, **kwargs)

        return wrapper

    for name in originals:
        setattr(dist, name, reading_headers(name))
    try:
        trainer.train_step(synthetic_batches(args.shape.vocab_size, args.shape.seq_length, args.micro_batch_size, 1))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        trainer.close()
    return linears, on_the_wire


def _expected(layers, linears, fwd, bwd, backend="auto"):
    return {
        (n, name): (None if fwd is None else (fwd, backend), None if bwd is None else (bwd, backend))
        for n in layers
        for name in linears
    }


ASH_E4M3 = CodecSettings(group_size=128, fmt="e4m3", transform="ash", scales="fp32")


@pytest.mark.parametrize(
    "argv,expected",
    [
        # the config's --taco-mode (int8) with every other setting at its default
        ([], _expected(range(1, 5), LINEARS, CodecSettings(128, "int8", "none"), CodecSettings(128, "int8", "none"))),
        # fp8-ash with every other setting at its default
        (["--taco-mode", "fp8-ash"], _expected(range(1, 5), LINEARS, ASH_E4M3, ASH_E4M3)),
        # every codec flag, a per-range override of each, a forward-only range with two linears
        (
            [
                "--taco-mode",
                "fp8-ash",
                "--taco-group-size",
                "64",
                "--taco-scales",
                "dual",
                "--taco-backend",
                "torch",
                "--taco-override",
                "3-4:mode=fp8,fmt=e5m2,scales=e8m0,group_size=32",
                "--taco-override",
                "2:direction=fwd,linears=fc1+fc2",
            ],
            {
                **_expected(
                    [1],
                    LINEARS,
                    CodecSettings(64, "e4m3", "ash", "dual"),
                    CodecSettings(64, "e4m3", "ash", "dual"),
                    "torch",
                ),
                **_expected([2], ["qkv", "proj"], None, None),
                **_expected([2], ["fc1", "fc2"], CodecSettings(64, "e4m3", "ash", "dual"), None, "torch"),
                **_expected(
                    [3, 4],
                    LINEARS,
                    CodecSettings(32, "e5m2", "none", "e8m0"),
                    CodecSettings(32, "e5m2", "none", "e8m0"),
                    "torch",
                ),
            },
        ),
        # 4-bit forward, FP8 gradients on layers 1-3 (not 4, gradients included); layer 3 INT4 forward only
        (
            [
                "--taco-mode",
                "fp4-ash",
                "--taco-bwd-mode",
                "fp8-ash",
                "--taco-group-size",
                "32",
                "--taco-scales",
                "e8m0",
                "--taco-layers",
                "1-3",
                "--taco-override",
                "3:mode=int4,bwd_mode=none",
            ],
            {
                **_expected(
                    [1, 2], LINEARS, CodecSettings(32, "e2m1", "ash", "e8m0"), CodecSettings(32, "e4m3", "ash", "e8m0")
                ),
                **_expected([3], LINEARS, CodecSettings(32, "int4", "none", "e8m0"), None),
                **_expected([4], LINEARS, None, None),
            },
        ),
        # FP8 forward, INT4 gradients with stochastic rounding
        (
            [
                "--taco-mode",
                "fp8-ash",
                "--taco-bwd-mode",
                "int4-ash",
                "--taco-stochastic-rounding",
                "--taco-group-size",
                "32",
                "--taco-scales",
                "e8m0",
            ],
            _expected(
                range(1, 5),
                LINEARS,
                CodecSettings(32, "e4m3", "ash", "e8m0"),
                CodecSettings(32, "int4", "ash", "e8m0", rounding="stochastic"),
            ),
        ),
        # INT8 with the Hadamard forward, without it backward
        (
            ["--taco-mode", "int8-ash", "--taco-bwd-mode", "int8"],
            _expected(range(1, 5), LINEARS, CodecSettings(128, "int8", "ash"), CodecSettings(128, "int8", "none")),
        ),
    ],
    ids=[
        "config-defaults",
        "fp8-ash-defaults",
        "every-flag",
        "four-bit-forward-fp8-backward",
        "int4-stochastic-gradients",
        "int8",
    ],
)
def test_every_linear_gets_exactly_the_codec_the_flags_ask_for(argv, expected):
    """From the trainer's flags to each linear's codec (transform, FP8 format, group size, scales,
    backend, per direction) and to the header of every message actually sent: fp8-ash without the
    Hadamard, or E5M2 in place of E4M3, anywhere on the way fails here."""
    linears, on_the_wire = run_distributed(_settings_worker, 2, argv, timeout=120)[0]
    expected = {key: None if value == (None, None) else value for key, value in expected.items()}
    for key in sorted(expected):
        assert linears[key] == expected[key], f"layer {key[0]} {key[1]}: {linears[key]} != {expected[key]}"
    assert set(linears) == set(expected)
    used = {
        settings.describe()
        for value in expected.values()
        if value
        for codec in value
        if codec
        for settings in [codec[0]]
    }
    assert on_the_wire == used, f"message headers {sorted(on_the_wire)}, flags asked for {sorted(used)}"


def _grads_worker(taco):
    # no clipping: it would rescale every gradient by the (changed) global norm
    cfg = TrainConfig(TINY_GPT, tensor_parallel=2, sequence_parallel=True, taco=taco, clip_grad=0.0)
    trainer = Trainer(cfg)
    stats = trainer.train_step(synthetic_batches(TINY_GPT.vocab_size, TINY_GPT.seq_length, 2, seed=3))
    grads = {n: p.main_grad.detach().clone() for n, p in trainer.model.module.named_parameters()}
    trainer.close()
    return stats["loss"], grads


def test_backward_compression_changes_gradients_within_codec_bound():
    base_loss, base = run_distributed(_grads_worker, 2, None, timeout=120)[0]
    bwd_only = dataclasses.replace(FP8_ASH, default=LinearSettings(mode="fp8-ash", direction="bwd"))
    loss, grads = run_distributed(_grads_worker, 2, bwd_only, timeout=120)[0]
    assert loss == base_loss, "forward is uncompressed: the loss is identical"
    rel = {n: float((grads[n] - base[n]).norm() / base[n].norm()) for n in base if base[n].norm() > 0}
    # Each compressed gradient message has per-group error <= 2^-4; it reaches a weight gradient
    # through at most 2 messages per layer below the output, attenuated by the matmuls. The
    # measured worst case on this model is about 0.03; 0.0625 * 2 is the stated bound.
    assert max(rel.values()) <= 2 * 2.0**-4, sorted(rel.items(), key=lambda kv: -kv[1])[:3]
    assert max(rel.values()) > 0, "backward compression must have changed some gradient"
    assert rel["output_layer.weight"] == 0.0, "the output layer's gradient comes before any compressed message"


def _parse(argv):
    return taco_config_from_args(add_taco_args(argparse.ArgumentParser()).parse_args(argv))


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--taco-mode", "int2"], "--taco-mode"),
        (["--taco-layers", "3-1"], "--taco-layers"),
        (["--taco-layers", "0-2"], "--taco-layers"),
        (["--taco-layers", "1,x"], "--taco-layers"),
        (["--taco-linears", "qkv,attn"], "--taco-linears"),
        (["--taco-linears", ""], "--taco-linears"),
        (["--taco-direction", "up"], "--taco-direction"),
        (["--taco-group-size", "100"], "--taco-group-size"),
        (["--taco-group-size", "big"], "--taco-group-size"),
        (["--taco-fp8-format", "e3m4"], "--taco-fp8-format"),
        (["--taco-scales", "fp16"], "--taco-scales"),
        (["--taco-mode", "fp8", "--taco-scales", "dual"], "--taco-scales"),
        (["--taco-min-bytes", "lots"], "--taco-min-bytes"),
        (["--taco-chunk-bytes", "-5"], "--taco-chunk-bytes"),
        (["--taco-backend", "cuda"], "--taco-backend"),
        (["--taco-log-interval", "-1"], "--taco-log-interval"),
        (["--taco-override", "1-2"], "--taco-override"),
        (["--taco-override", "1-2:speed=fast"], "--taco-override"),
        (["--taco-override", "1-2:mode=int2"], "--taco-override"),
    ],
)
def test_invalid_flags_name_the_flag_and_value(argv, flag):
    with pytest.raises(TacoConfigError) as info:
        _parse(argv)
    message = str(info.value)
    assert message.startswith(flag), message
    bad_value = argv[-1].split(",")[-1].split(":")[-1].split("=")[-1]
    assert bad_value in message, message


def test_valid_flags_resolve_per_layer():
    cfg = _parse(
        [
            "--taco-mode",
            "fp8-ash",
            "--taco-layers",
            "1-4,9-12",
            "--taco-linears",
            "fc1,fc2",
            "--taco-override",
            "3-4:mode=fp8,group_size=64,linears=qkv+proj",
            "--taco-min-bytes",
            "4M",
        ]
    )
    assert cfg.min_bytes == 4 << 20
    assert cfg.for_layer(1).mode == "fp8-ash" and cfg.for_layer(1).linears == {"fc1", "fc2"}
    assert cfg.for_layer(3).mode == "fp8" and cfg.for_layer(3).group_size == 64
    assert cfg.for_layer(3).linears == {"qkv", "proj"}
    assert not cfg.for_layer(6).enabled and cfg.for_layer(10).enabled
    assert _parse([]).enabled is False and _parse([]).min_bytes is None
    with pytest.raises(TacoConfigError, match="--taco-layers: layer range 9-12 exceeds the model's 8 layers"):
        cfg.for_model(8)


def test_last_names_the_models_last_layer_once_the_model_is_known():
    """The best measured 4-bit setting keeps the edge layers at FP8 (loss_compare_gpt25m_bpe8192.md): '1,last' says
    so for any depth; 'all' in an override reaches the last layer, not past it."""
    cfg = _parse(["--taco-mode", "int4-ash", "--taco-bwd-mode", "fp8-ash", "--taco-override", "1,last:mode=fp8-ash"])
    with pytest.raises(ValueError, match="for_model"):  # never silently skipped before the model is known
        cfg.for_layer(1)
    for layers in (8, 32):
        model = cfg.for_model(layers)
        modes = [model.for_layer(n).mode for n in range(1, layers + 1)]
        assert modes == ["fp8-ash"] + ["int4-ash"] * (layers - 2) + ["fp8-ash"]
        assert {model.for_layer(n).mode_for("bwd") for n in range(1, layers + 1)} == {"fp8-ash"}
    tail = _parse(["--taco-mode", "fp8-ash", "--taco-layers", "5-last"]).for_model(6)
    assert [tail.for_layer(n).enabled for n in range(1, 7)] == [False] * 4 + [True] * 2
    assert _parse(["--taco-mode", "fp8", "--taco-override", "all:mode=none"]).for_model(4).for_layer(4).mode == "none"
    with pytest.raises(TacoConfigError, match="--taco-layers: layer range 5-last is empty in a model of 4 layers"):
        _parse(["--taco-mode", "fp8-ash", "--taco-layers", "5-last"]).for_model(4)
    for bad in ("last-3", "0-last", "first"):
        with pytest.raises(TacoConfigError, match="--taco-layers: invalid layer range"):
            _parse(["--taco-mode", "fp8-ash", "--taco-layers", bad])


def _attach_to_expert_linear():
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    from megatron_taco.codec import TacoCodec
    from megatron_taco.megatron.taco_linears import LinearCompression, compress_local_linear

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True, perform_initialization=False
    )
    linear = RowParallelLinear(
        8, 8, config=config, init_method=None, bias=False, input_is_parallel=True, skip_bias_add=True,
        is_expert=True, tp_group=dist.new_group([0, 1]),
    )  # fmt: skip
    with pytest.raises(ValueError) as error:
        compress_local_linear(linear, LinearCompression("layer 1 fc2", TacoCodec(), None, 0, 0))
    compress_local_linear(linear, None)  # stock stays allowed
    return str(error.value)


def test_expert_linears_are_refused_in_one_line():
    """An expert linear (explicit_expert_comm) does no TP reduction of its own: TACO reducing it would sum twice."""
    message = run_distributed(_attach_to_expert_linear, 2, timeout=120)[0]
    assert message.startswith("layer 1 fc2: an expert linear (explicit_expert_comm=True)"), message
