"""The trainer's start-up checks: every bad flag, value, combination, config file or checkpoint is one line
naming it and what is allowed.

These call the two checks ``examples/pretrain_gpt.py`` runs before it starts torch.distributed
(``cli.parse_args``, ``cli.startup_config``) in this process; tests/test_entry_points.py runs the entry
point itself for the exit code and the single line of output from 2 ranks, and for Ctrl-C.
"""

import os
import sys

import pytest
import torch

from megatron_taco.training import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "gpt-tiny.yaml")  # TP=2 + SP, micro-batch 4, global batch 8


def _startup_error(argv, world_size=2) -> str:
    """The StartupError these flags raise on ``world_size`` ranks (one line)."""
    with pytest.raises(cli.StartupError) as info:
        cli.startup_config(cli.parse_args(argv), world_size)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--micro-batch-size", "0"], "--micro-batch-size: invalid value 0; expected an integer >= 1"),
        (["--log-interval", "0"], "--log-interval: invalid value 0; expected an integer >= 1"),
        (["--train-iters", "0"], "--train-iters: invalid value 0; expected an integer >= 1"),
        (["--train-iters", "-5"], "--train-iters: invalid value -5; expected an integer >= 1"),
        (["--global-batch-size", "0"], "--global-batch-size: invalid value 0; expected an integer >= 1"),
        (
            ["--tensor-model-parallel-size", "0"],
            "--tensor-model-parallel-size: invalid value 0; expected an integer >= 1",
        ),
        (
            ["--pipeline-model-parallel-size", "0"],
            "--pipeline-model-parallel-size: invalid value 0; expected an integer >= 1",
        ),
        (["--eval-iters", "-1"], "--eval-iters: invalid value -1; expected an integer >= 0"),
        (["--eval-interval", "-1"], "--eval-interval: invalid value -1; expected an integer >= 0"),
        (["--save-interval", "-1"], "--save-interval: invalid value -1; expected an integer >= 0"),
        (["--micro-batch-size", "two"], "argument --micro-batch-size: invalid int value: 'two' (see --help)"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag (see --help)"),
        (
            ["--taco-mode", "bogus"],
            "--taco-mode: invalid value 'bogus'; choose from none, fp8, fp8-ash, int8, int8-ash, fp4, fp4-ash, int4, int4-ash",
        ),
        (["--data", "no/such/folder"], "--data no/such/folder: no such file or directory"),
        (["--taco-layers", "2-99"], "--taco-layers: layer range 2-99 exceeds the model's 4 layers"),
        (["--taco-switch", "mode=fp8"], "--taco-switch: invalid value 'mode=fp8'; use ITER:key=value[,key=value]"),
        (["--taco-switch", "0:mode=fp8"], "--taco-switch: invalid value '0'; expected an integer >= 1"),
        (["--taco-switch", "5:layers=2"], "--taco-switch: unknown key 'layers' in '5:layers=2'; keys: mode, bwd_mode"),
        (
            ["--taco-switch", "5:mode=fp8", "--taco-scales", "e4m3", "--taco-mode", "int4"],
            "--taco-scales e4m3 (E4M3 group scales times a message scale, NVFP4's layout) is for the 4-bit modes, not "
            "--taco-mode fp8; use fp32, dual or e8m0 with 8-bit codes (in --taco-switch '5:mode=fp8')",
        ),
        (
            ["--taco-switch", "10:mode=none", "--train-iters", "10"],
            "--taco-switch: iteration 10 is not before the run's last (--train-iters 10)",
        ),
        (["--mapl-ratio", "4"], "--mapl-ratio/--mapl-rank need --pipeline-model-parallel-size > 1"),
        (
            ["--sequence-parallel", "--tensor-model-parallel-size", "1", "--global-batch-size", "16"],
            "--sequence-parallel needs --tensor-model-parallel-size > 1",
        ),
        (
            ["--lr-decay-style", "cosine", "--lr-warmup-iters", "20", "--train-iters", "10"],
            "--lr-decay-iters 10 must be larger than --lr-warmup-iters 20",
        ),
    ],
)
def test_bad_flags_fail_with_the_flag_and_what_it_allows(flags, message):
    assert _startup_error(["--config", TINY, *flags]).startswith(message)


def test_backends_that_cannot_run_here_fail_at_start_up(monkeypatch):
    assert _startup_error(["--config", TINY, "--taco-backend", "tee"]).startswith(
        "--taco-backend: invalid value 'tee'; choose from auto, torch, triton, te"
    )
    # what Transformer Engine's block quantizer does not cover is named before anything runs, GPU or not
    assert _startup_error(["--config", TINY, "--taco-backend", "te", "--taco-mode", "fp4-ash"]).startswith(
        "--taco-backend te casts to FP8 only (Transformer Engine's block quantizer), not --taco-mode fp4-ash"
    )
    # the config's int8 included
    assert _startup_error(["--config", TINY, "--taco-backend", "te"]).startswith(
        "--taco-backend te casts to FP8 only (Transformer Engine's block quantizer), not --taco-mode int8"
    )
    te_fp8 = ["--config", TINY, "--taco-backend", "te", "--taco-mode", "fp8-ash"]
    assert _startup_error([*te_fp8, "--taco-group-size", "64"]).startswith(
        "--taco-backend te: Transformer Engine's block quantizer has 128-element groups with fp32 scales, "
        "not --taco-group-size 64 --taco-scales fp32"
    )
    assert _startup_error([*te_fp8, "--taco-override", "1-1:mode=int4"]).startswith(
        "--taco-backend te casts to FP8 only (Transformer Engine's block quantizer), not --taco-mode int4"
    )
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        assert _startup_error(te_fp8).startswith(
            "--taco-backend te: Transformer Engine's FP8 cast needs a GPU (no CUDA device here); use auto"
        )
        assert _startup_error(["--config", TINY, "--taco-backend", "triton"]).startswith(
            "--taco-backend triton: Triton's kernels need a GPU here"
        )


def test_a_global_batch_that_does_not_split_into_micro_batches_per_replica_fails():
    # 4 ranks at TP=2: 2 data-parallel replicas of micro-batches of 4
    assert _startup_error(["--config", TINY, "--global-batch-size", "12"], world_size=4) == (
        "--global-batch-size 12: must be a multiple of --micro-batch-size x data-parallel size = 4 x 2 = 8"
    )


def test_load_without_a_checkpoint_fails(tmp_path):
    assert _startup_error(["--config", TINY, "--load", str(tmp_path)]) == (
        f"--load {tmp_path}: no checkpoint (missing {tmp_path / 'latest'})"
    )


def test_tensorboard_dir_without_tensorboard_fails_at_start_up(monkeypatch, tmp_path):
    """Checked on every rank before torch.distributed starts: rank 0 alone stopping at its writer left the other
    ranks failing with a traceback in their first collective."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as where tensorboard is not installed
    assert _startup_error(["--config", TINY, "--tensorboard-dir", str(tmp_path)]) == (
        "--tensorboard-dir needs the tensorboard package (pip install tensorboard)"
    )


def test_a_missing_config_file_fails(tmp_path):
    path = tmp_path / "missing.yaml"
    assert _startup_error(["--config", str(path)]) == f"--config {path}: No such file or directory ({path})"


def test_flags_without_a_config_fail():
    assert _startup_error(["--train-iters", "3"]) == "--config with a model section is required"


@pytest.mark.parametrize(
    "text,message",
    [
        ("model: [1, 2\n", "not valid YAML: expected ',' or ']', but got '<stream end>' at line 2, column 1"),
        (
            "model:\n  num_layers: 2\n   hidden_size: 8\n",
            "not valid YAML: mapping values are not allowed here at line 3, column 15",
        ),
        ("- model\n", "expected a mapping of the sections ['model', 'training', 'taco', 'mapl'], got list"),
        ("optimizer:\n  lr: 0.1\n", "unknown sections ['optimizer']; known: ['model', 'training', 'taco', 'mapl']"),
        ("training: 3\n", "section training must be a mapping of keys to values, got 3"),
        ("training:\n  micro_batch: 2\n", "unknown keys ['micro_batch'] in section training; known: ['clip_grad', "),
        ("training:\n  taco_mode: fp8\n", "unknown keys ['taco_mode'] in section training; known: ['clip_grad', "),
        ("taco:\n  mdoe: fp8\n", "unknown keys ['mdoe'] in section taco; known: ['backend', "),
        ("mapl:\n  ratios: 4\n", "unknown keys ['ratios'] in section mapl; known: ['anchor_init', "),
        ("model:\n  num_layers: 2\n  width: 8\n", "model section: unknown model fields ['width']; known: ["),
    ],
    ids=[
        "yaml-unclosed",
        "yaml-indent",
        "not-a-mapping",
        "unknown-section",
        "section-not-a-mapping",
        "unknown-training-key",
        "taco-key-in-training",
        "unknown-taco-key",
        "unknown-mapl-key",
        "unknown-model-key",
    ],
)
def test_bad_config_files_fail_with_the_file_and_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert _startup_error(["--config", str(path)]).startswith(f"--config {path}: {message}")


def test_config_values_get_the_same_checks_as_flags(tmp_path):
    path = tmp_path / "zero.yaml"
    with open(TINY) as f:
        path.write_text(f.read().replace("micro_batch_size: 4", "micro_batch_size: 0"))
    assert _startup_error(["--config", str(path)]) == "--micro-batch-size: invalid value 0; expected an integer >= 1"


def test_each_config_family_raises_its_own_error_type():
    """--taco-* -> TacoConfigError, --mapl-* -> MaplConfigError, the trainer's flags and model section ->
    TrainConfigError; all are ConfigError (a ValueError), and no family's type is another's."""
    from megatron_taco.config.errors import ConfigError, MaplConfigError, TacoConfigError, TrainConfigError
    import argparse
    import dataclasses

    from megatron_taco.config.mapl import MaplConfig
    from megatron_taco.config.taco import add_taco_args, taco_config_from_args
    from megatron_taco.testing.models import TINY_GPT
    from megatron_taco.training.loop import TrainConfig

    taco_flags = add_taco_args(argparse.ArgumentParser()).parse_args(["--taco-mode", "fp8", "--taco-layers", "2-9"])
    with pytest.raises(TacoConfigError):
        taco_config_from_args(taco_flags).for_model(3)
    with pytest.raises(MaplConfigError):
        MaplConfig(context_anchors=-1)
    with pytest.raises(TrainConfigError):
        TrainConfig(TINY_GPT, tensor_parallel=1, sequence_parallel=True)
    with pytest.raises(TrainConfigError):
        dataclasses.replace(TINY_GPT, normalization="BatchNorm")
    families = (TacoConfigError, MaplConfigError, TrainConfigError)
    assert all(issubclass(family, ConfigError) and issubclass(family, ValueError) for family in families)
    assert not any(issubclass(a, b) for a in families for b in families if a is not b)
