"""The Megatron-LM launcher against a stand-in training script that calls Megatron-LM's parser and model
builder as Megatron-LM 0.19's pretrain_gpt.py does (tests/standin/pretrain_standin.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_taco.testing.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(ROOT, "tests", "standin", "pretrain_standin.py")
MODEL_FLAGS = [
    "--num-layers",
    "3",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
    "--no-rope-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
]

import megatron_taco.launch  # noqa: E402,F401  (its Python 3.11 shim lets megatron.training import)

try:
    import megatron.training.arguments  # noqa: F401
except ImportError:
    pytest.skip(
        "needs megatron.training (Megatron-LM's argument parser; in the megatron-core wheel from 0.17)",
        allow_module_level=True,
    )


def _launch(tmp_path, *flags, ranks=2):
    """The launcher on the stand-in: 2 ranks under torchrun at TP=2 (TACO needs TP traffic), or 1 plain process
    for flags refused while they are parsed (a failing torchrun adds its own report to stderr)."""
    from benchmarks.megatron_lm_check import torchrun
    from megatron_taco.testing.distributed import free_port

    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    launch = ["-m", "megatron_taco.launch", STANDIN, *MODEL_FLAGS, "--standin-out", str(out)]
    if ranks == 2:
        command = [*torchrun(free_port(), *launch), "--tensor-model-parallel-size", "2"]
    else:
        command = [sys.executable, *launch]
    proc = subprocess.run(
        [*command, *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


def test_launcher_adds_flags_and_attaches_chosen_layers(tmp_path):
    proc, report = _launch(tmp_path, "--taco-mode", "fp8", "--taco-layers", "2-3", "--taco-linears", "fc2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["taco_mode"] == "fp8"
    assert [layer["fc2_compressed"] for layer in report["layers"]] == [False, True, True]
    assert not any(layer["qkv_compressed"] for layer in report["layers"])
    assert "megatron_taco: TACO fp8 (local linears, pipeline stage 0): qkv -, proj -, fc1 -, fc2 2-3" in proc.stdout
    assert "megatron_taco: megatron-core" in proc.stdout


def test_launcher_applies_the_error_sample_interval(tmp_path):
    """--taco-error-sample-interval 0 turns the telemetry's codec round trips off under Megatron-LM too."""
    proc, report = _launch(tmp_path, "--taco-mode", "int8", "--taco-error-sample-interval", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["error_sample_interval"] == 0


def test_launcher_resolves_last_to_the_models_last_layer(tmp_path):
    """The best measured 4-bit setting (INT4 forward, the first and last layers at FP8) as a user writes it."""
    flags = ["--taco-mode", "int4-ash", "--taco-bwd-mode", "fp8-ash", "--taco-override", "1,last:mode=fp8-ash"]
    proc, report = _launch(tmp_path, *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [layer["fc2_fwd_format"] for layer in report["layers"]] == ["e4m3", "int4", "e4m3"]
    # the start-up line names which layers run which mode, not only the flags' default
    assert "fc2 1-3; modes: fp8-ash 1,3 | int4-ash (backward fp8-ash) 2; codec" in proc.stdout
    proc, _ = _launch(tmp_path, "--taco-mode", "fp8", "--taco-layers", "4-last", ranks=1)
    assert proc.returncode == 2 and "--taco-layers: layer range 4-last is empty in a model of 3 layers" in proc.stderr


def test_launcher_switches_settings_after_the_iteration(tmp_path):
    """--taco-switch: INT4 forward traffic until iteration 5, then FP8; the edge override follows the new flags.
    The stand-in runs forward passes with args.curr_iteration set first, as Megatron-LM 0.19's train() does. Every
    message compressed (--taco-min-bytes 0) before the switch too: re-attaching after compressed row-linear
    forwards once refused proj and fc2 as expert linears."""
    flags = ["--taco-mode", "int4-ash", "--taco-bwd-mode", "fp8-ash", "--taco-override", "1:mode=fp8-ash"]
    flags += ["--taco-min-bytes", "0"]
    proc, report = _launch(tmp_path, *flags, "--taco-switch", "5:mode=fp8-ash", "--train-iters", "10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["fc2_fwd_format_at"] == {
        "0": ["e4m3", "int4", "int4"],
        "4": ["e4m3", "int4", "int4"],
        "5": ["e4m3", "e4m3", "e4m3"],
    }
    assert "; after iteration 5: fp8-ash and its overrides; codec" in proc.stdout
    assert (
        "megatron_taco: TACO after iteration 5 (pipeline stage 0): qkv 1-3, proj 1-3, fc1 1-3, fc2 1-3" in proc.stdout
    )
    proc, _ = _launch(tmp_path, *flags, "--taco-switch", "10:mode=fp8-ash", "--train-iters", "10", ranks=1)
    assert proc.returncode == 2 and "--taco-switch: iteration 10 is not before the run's last (--train-iters 10)" in (
        proc.stderr
    )


def test_launcher_without_taco_flags_keeps_stock_behaviour(tmp_path):
    proc, report = _launch(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["taco_mode"] == "none"
    assert not any(layer["fc2_compressed"] or layer["qkv_compressed"] for layer in report["layers"])


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--taco-mode", "int2"], "--taco-mode: invalid value 'int2'"),
        (["--taco-mode", "fp8", "--tp-comm-overlap"], "--taco-mode fp8 with --tp-comm-overlap"),
        (["--taco-mode", "fp8", "--taco-layers", "2-9"], "--taco-layers: layer range 2-9 exceeds"),
        (["--taco-mode", "int4-ash", "--taco-switch", "800"], "--taco-switch: invalid value '800'; use ITER:key=value"),
        (["--taco-mode", "int4-ash", "--taco-switch", "8:mode=fp9"], "--taco-switch mode: invalid value 'fp9'"),
        (["--mapl-ratio", "8"], "--mapl-ratio/--mapl-rank need --pipeline-model-parallel-size > 1"),
        (["--mapl-anchor-rank", "8"], "--mapl-anchor-rank given without --mapl-ratio"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag (see pretrain_standin.py --help)"),
        (["--num-layers", "two"], "argument --num-layers: invalid int value: 'two' (see pretrain_standin.py --help)"),
        (["--taco-mode", "int8"], "--taco-mode int8 needs --tensor-model-parallel-size > 1"),
        (["--taco-override", "1:mode=int8", "--tp-comm-overlap"], "--taco-override with --tp-comm-overlap"),
        (["--taco-mode", "int8", "--cuda-graph-impl", "local"], "--taco-mode int8 with CUDA graphs (--cuda-graph-impl"),
        (["--taco-mode", "int8", "--enable-cuda-graph"], "--taco-mode int8 with CUDA graphs (--cuda-graph-impl"),
        (["--taco-mode", "int8", "--symmetric-ar-type", "two_shot"], "--taco-mode int8 with --symmetric-ar-type"),
        (
            ["--taco-mode", "int8", "--fp8-format", "hybrid", "--fp8-recipe", "custom"],
            "--taco-mode int8 with --fp8-recipe / --fp4-recipe custom",
        ),
        (
            ["--taco-mode", "int8", "--fp4-format", "e2m1", "--fp4-recipe", "custom"],
            "--taco-mode int8 with --fp8-recipe / --fp4-recipe custom",
        ),
        (  # the TP size from the checkpoint: refused when the model is built
            ["--taco-mode", "int8", "--use-checkpoint-args", "--use-mp-args-from-checkpoint-args"],
            "TACO needs --tensor-model-parallel-size > 1",
        ),
    ],
)
def test_launcher_rejects_bad_flags_at_start_up(tmp_path, flags, message):
    """One line, exit code 2: no usage block, no traceback."""
    proc, report = _launch(tmp_path, *flags, ranks=1)
    assert proc.returncode == 2 and report is None
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr[-2000:]


def test_launcher_refuses_taco_flags_that_yaml_cfg_would_drop(tmp_path):
    """--yaml-cfg makes Megatron-LM read every setting from the YAML file: --taco-* flags beside it would be lost."""
    config = tmp_path / "run.yaml"
    config.write_text("num_layers: 2\ndisable_msc_deprecated: false\nenable_msc: false\n")  # what parse_args reads
    proc, report = _launch(tmp_path, "--yaml-cfg", str(config), "--taco-mode", "int8", ranks=1)
    assert proc.returncode == 2 and report is None
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --taco-* / --mapl-* flags with --yaml-cfg"), (
        proc.stderr[-2000:]
    )


def test_launcher_needs_a_script():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_taco.launch", "no_such_script.py"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "not found" in proc.stderr


class _ScalarRecorder:
    """Stands in for a TensorBoard SummaryWriter (tensorboard is not installed here): records add_scalar calls."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def test_telemetry_goes_to_the_log_and_tensorboard_at_the_interval():
    import torch

    from megatron_taco import launch
    from megatron_taco.codec import TacoCodec
    from megatron_taco.config.taco import LinearSettings, TacoConfig
    from megatron_taco.megatron.telemetry import TELEMETRY

    launch.install_hooks()
    from megatron.training import training as mlm_training

    assert hasattr(mlm_training.training_log, "__wrapped__"), "Megatron-LM's training_log must be wrapped"
    launch._STATE["taco"] = TacoConfig(default=LinearSettings(mode="fp8-ash"), log_interval=5)
    try:
        TELEMETRY.reset()
        TELEMETRY.record(("layer 1 fc1", "all_gather", "fwd"), torch.randn(64, 128), TacoCodec(), True)
        writer = _ScalarRecorder()
        assert launch.log_telemetry(3, writer) == [] and writer.scalars == []
        lines = launch.log_telemetry(5, writer)
        assert lines[0].startswith("taco layer 1: 1/1 messages compressed") and "taco total" in lines[-1]
        tags = {tag for tag, _, step in writer.scalars if step == 5}
        assert "taco/layer_1_fc1/all_gather_fwd/rel_error" in tags
        assert not TELEMETRY.records, "stats restart after each report"
    finally:
        launch._STATE["taco"] = None


def _two_stage_telemetry():
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_taco import launch
    from megatron_taco.codec import TacoCodec
    from megatron_taco.config.taco import LinearSettings, TacoConfig
    from megatron_taco.megatron.telemetry import TELEMETRY

    parallel_state.initialize_model_parallel(1, 2)  # PP=2: rank 0 holds layers 1-4, rank 1 layers 5-8
    launch._STATE["taco"] = TacoConfig(default=LinearSettings(mode="fp8-ash"), log_interval=5)
    TELEMETRY.reset()
    layer = 1 + 4 * dist.get_rank()
    TELEMETRY.record((f"layer {layer} fc1", "all_gather", "fwd"), torch.randn(64, 128), TacoCodec(), True)
    writer = _ScalarRecorder()
    return launch.log_telemetry(5, writer), sorted({tag for tag, _, _ in writer.scalars})


def test_telemetry_of_every_pipeline_stage_reaches_the_log():
    """Rank 0 prints the layers of the later stages too (it printed its own stage's alone)."""
    lines, tags = run_distributed(_two_stage_telemetry, 2, timeout=120)[0]
    assert [line.split(":")[0] for line in lines] == ["taco layer 1", "taco layer 5", "taco total"], lines
    assert "2 messages of configured linears" in lines[-1]
    assert "taco/layer_5_fc1/all_gather_fwd/payload_MiB" in tags


def test_launcher_runs_the_scripts_own_checkout_and_says_which(tmp_path):
    """A script beside a ``megatron/`` folder (a Megatron-LM checkout) gets that megatron, not the installed one."""
    import megatron.core

    installed = os.path.dirname(os.path.dirname(os.path.abspath(megatron.core.__file__)))  # the installed megatron/
    (tmp_path / "megatron").symlink_to(installed, target_is_directory=True)
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("import megatron.core\nprint('ran with', megatron.core.__file__)\n")
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_taco.launch", str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"megatron_taco: megatron-core {megatron.core.__version__} from {tmp_path}\n" in proc.stdout
    assert f"ran with {tmp_path}/megatron/core/__init__.py" in proc.stdout


def test_every_megatron_lm_check_row_has_settings_the_flags_accept():
    """scripts/megatron_lm_check.sh runs only on the GPU machine: a row naming TACO settings that do not exist, or
    flags the product refuses, would cost a device call to find. Here every row's --taco-* and --mapl-* flags parse."""
    import argparse

    from benchmarks import megatron_lm_check as check
    from megatron_taco.config.mapl import add_mapl_args
    from megatron_taco.config.taco import add_taco_args, taco_config_from_args

    names = {row.name for row in check.ROWS}
    assert all(name in names for suite in check.SUITES.values() for name in suite)
    for row in check.ROWS:
        flags = add_taco_args(argparse.ArgumentParser()).parse_args(check.TACO[row.taco])
        taco_config_from_args(flags).for_model(8)
        add_mapl_args(argparse.ArgumentParser()).parse_args(check.MAPL[row.mapl])
    for name, edge, inner, gradients in (
        ("int4-ash-edges", "fp8-ash", "int4-ash", "fp8-ash"),
        ("int4-int8-edges", "int8", "int4", "int8"),
    ):
        layers = taco_config_from_args(add_taco_args(argparse.ArgumentParser()).parse_args(check.TACO[name]))
        layers = [layers.for_model(8).for_layer(n) for n in (1, 2, 7, 8)]
        assert [layer.mode_for("fwd") for layer in layers] == [edge, inner, inner, edge], name
        assert [layer.mode_for("bwd") for layer in layers] == [gradients] * 4, name


def test_layer_ranges_wait_for_the_model_when_the_checkpoint_gives_the_layers():
    """--use-checkpoint-args without --num-layers: the ranges are resolved when the model is built, not at parsing."""
    import argparse

    from megatron_taco.config.taco import add_taco_args
    from megatron_taco.launch import check_megatron_args

    args = add_taco_args(argparse.ArgumentParser()).parse_args(["--taco-mode", "int8", "--taco-layers", "2-last"])
    args.num_layers, args.tensor_model_parallel_size, args.train_iters = None, 2, 100
    assert check_megatron_args(args).enabled
    args.num_layers = 1
    with pytest.raises(ValueError, match="--taco-layers: layer range 2-last is empty in a model of 1 layers"):
        check_megatron_args(args)


def test_flags_are_refused_only_where_they_bypass_taco():
    """--symmetric-ar-type replaces the TP all-reduce, which SP does not use; with --use-mp-args-from-checkpoint-args
    the TP size is the checkpoint's, checked when the model is built."""
    import argparse

    from megatron_taco.config.taco import add_taco_args
    from megatron_taco.launch import check_megatron_args

    args = add_taco_args(argparse.ArgumentParser()).parse_args(["--taco-mode", "int8"])
    args.num_layers, args.tensor_model_parallel_size, args.train_iters = 4, 2, 100
    args.symmetric_ar_type, args.sequence_parallel = "two_shot", True
    assert check_megatron_args(args).enabled
    args.sequence_parallel = False
    with pytest.raises(ValueError, match="--taco-mode int8 with --symmetric-ar-type"):
        check_megatron_args(args)
    args.symmetric_ar_type, args.tensor_model_parallel_size = None, 1
    args.use_checkpoint_args, args.use_mp_args_from_checkpoint_args = True, True
    assert check_megatron_args(args).enabled
    args.use_mp_args_from_checkpoint_args = False
    with pytest.raises(ValueError, match="--taco-mode int8 needs --tensor-model-parallel-size > 1"):
        check_megatron_args(args)
