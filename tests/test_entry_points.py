"""Configs, the trainer's command line (TACO on, resume) and the scripts users run."""

import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_taco.testing.distributed import DistributedTestError, free_port, run_distributed
from megatron_taco.training import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))

# Published parameter counts (embeddings included), for the configs of published architectures.
PUBLISHED_PARAMS = {
    "gpt-125m.yaml": 125e6,
    "gpt-1.3b.yaml": 1.3e9,
    "qwen2.5-0.5b.yaml": 0.49e9,
    "qwen2.5-1.5b.yaml": 1.54e9,
    "qwen2.5-7b.yaml": 7.62e9,
}


def test_every_config_is_tested():
    names = {os.path.basename(c) for c in CONFIGS}
    assert names == set(PUBLISHED_PARAMS) | {"gpt-tiny.yaml", "qwen-tiny.yaml"}


def _meta_parameter_count(path):
    """Build the whole model (TP=1, PP=1) on the meta device and count its parameters."""
    from megatron_taco.megatron.cpu_runtime import cpu_config_overrides, enable_cpu_runtime
    from megatron_taco.megatron.specs import LOCAL_SPEC_CONFIG, transformer_layer_spec
    from megatron_taco.training.model import build_gpt_model, make_transformer_config
    from megatron.core import parallel_state

    args = cli.parse_args(["--config", path])
    enable_cpu_runtime()
    parallel_state.initialize_model_parallel(1, 1)
    config = make_transformer_config(
        args.shape,
        tensor_parallel=1,
        pipeline_parallel=1,
        sequence_parallel=False,
        params_dtype=torch.float32,
        extra={**LOCAL_SPEC_CONFIG, **cpu_config_overrides(), "perform_initialization": False},
    )
    with torch.device("meta"):
        model = build_gpt_model(args.shape, config, transformer_layer_spec(), initialize=False)
    parallel_state.destroy_model_parallel()
    return sum(p.numel() for p in model.parameters()), args.taco.enabled, args.mapl


@pytest.mark.parametrize(
    "path", [c for c in CONFIGS if os.path.basename(c) in PUBLISHED_PARAMS], ids=lambda p: os.path.basename(p)
)
def test_published_configs_parse_and_build_with_their_parameter_count(path):
    count, taco_on, mapl = run_distributed(_meta_parameter_count, 1, path, timeout=300)[0]
    expected = PUBLISHED_PARAMS[os.path.basename(path)]
    assert abs(count - expected) / expected < 0.04, (count, expected)
    assert taco_on


def test_every_config_runs_the_mode_the_benchmarks_time_as_the_configs():
    """configs/*.yaml share one --taco-mode, the one benchmarks/e2e.py times as the configs' (its headline rows)."""
    import yaml

    from benchmarks import e2e

    modes = {}
    for path in CONFIGS:
        with open(path) as f:
            modes[os.path.basename(path)] = yaml.safe_load(f)["taco"]["mode"]
    assert set(modes.values()) == {e2e.CONFIGS_MODE}, modes


def _train_cli(argv):
    return cli.main(argv)


@pytest.mark.parametrize("config", ["gpt-tiny.yaml", "qwen-tiny.yaml"])
def test_trainer_trains_with_taco_and_resumes_to_the_same_losses(config, tmp_path):
    path = os.path.join(ROOT, "configs", config)
    common = ["--config", path, "--taco-log-interval", "0"]
    straight = run_distributed(_train_cli, 2, common + ["--train-iters", "6"], timeout=180)[0]
    first = run_distributed(_train_cli, 2, common + ["--train-iters", "3", "--save", str(tmp_path)], timeout=180)[0]
    resumed = run_distributed(_train_cli, 2, common + ["--train-iters", "6", "--load", str(tmp_path)], timeout=180)[0]
    assert first == straight[:3]
    assert resumed == straight[3:], "resuming must reproduce the uninterrupted run exactly"
    assert straight[-1] < straight[0]
    with pytest.raises(
        cli.StartupError,
        match=r"^--load .*: its checkpoint is at step 3, so --train-iters 3 leaves "
        r"nothing to train; use --train-iters > 3$",
    ):
        cli.startup_config(cli.parse_args(common + ["--train-iters", "3", "--load", str(tmp_path)]), 2)


@pytest.mark.parametrize(
    "mapl",
    [
        ["--mapl-ratio", "4", "--mapl-context-anchors", "1"],
        ["--mapl-ratio", "4", "--mapl-vq-levels", "2", "--mapl-vq-codes", "32", "--mapl-vq-sync-rows", "8"],
        ["--mapl-ratio", "4", "--mapl-warmup-steps", "3"],  # saved at step 2, inside the warm-up
    ],
    ids=["mapl-context-anchors", "mapl-vq", "mapl-warmup"],
)
def test_trainer_trains_pp2_with_mapl_and_resumes(mapl, tmp_path):
    path = os.path.join(ROOT, "configs", "gpt-tiny.yaml")
    common = [
        "--config",
        path,
        "--tensor-model-parallel-size",
        "1",
        "--no-sequence-parallel",
        "--pipeline-model-parallel-size",
        "2",
        "--taco-mode",
        "none",
        *mapl,
        # the schedule's step count must come back too (warm-up then cosine decay over the 4 steps)
        "--lr-warmup-iters",
        "1",
        "--lr-decay-style",
        "cosine",
        "--lr-decay-iters",
        "4",
    ]
    straight = run_distributed(_train_cli, 2, common + ["--train-iters", "4"], timeout=180)[0]
    run_distributed(_train_cli, 2, common + ["--train-iters", "2", "--save", str(tmp_path)], timeout=180)
    resumed = run_distributed(_train_cli, 2, common + ["--train-iters", "4", "--load", str(tmp_path)], timeout=180)[0]
    assert resumed == straight[2:]
    # another parallel layout, or another MAPL width: one line naming --load, not a state-dict traceback
    other_layout = [*common[:2], "--taco-mode", "none", "--train-iters", "4", "--load", str(tmp_path)]
    # found at start-up, before any rank builds a model (whose build notices would come before the line)
    with pytest.raises(cli.StartupError, match=r"--load .*: saved with TP=1, PP=2, virtual PP=1, this run has TP=2"):
        cli.startup_config(cli.parse_args(other_layout), 2)
    with pytest.raises(cli.StartupError, match=r"--load .*: saved with world size 2, now 4"):
        cli.startup_config(cli.parse_args(common + ["--train-iters", "4", "--load", str(tmp_path)]), 4)
    with pytest.raises(
        DistributedTestError,
        match=r"--load .*: saved with TP=1, PP=2, virtual PP=1, this run has "
        r"TP=2, PP=1, virtual PP=1; resume with the layout it was saved with",
    ):
        run_distributed(_train_cli, 2, other_layout, timeout=180)
    with pytest.raises(cli.StartupError, match=r"--load .*: its MAPL boundaries were saved with --mapl-ratio 4 "):
        cli.startup_config(
            cli.parse_args([("2" if a == "4" and common[i - 1] == "--mapl-ratio" else a) for i, a in enumerate(common)]
                           + ["--train-iters", "4", "--load", str(tmp_path)]), 2
        )  # fmt: skip
    # a checkpoint saved before layout.json existed: the same line, from the ranks' own files at load time
    os.remove(tmp_path / "iter_0000002" / "layout.json")
    with pytest.raises(
        DistributedTestError, match=r"--load .*: saved with TP=1, PP=2, virtual PP=1, this run has TP=2"
    ):
        run_distributed(_train_cli, 2, other_layout, timeout=180)
    # another MAPL width: the flags it was saved with, from the ranks' files (layout.json is gone here)
    other_width = [("2" if i and common[i - 1] == "--mapl-ratio" else a) for i, a in enumerate(common)]
    other_width_load = [*other_width, "--train-iters", "4", "--load", str(tmp_path)]
    saved_with = r"--load .*: its MAPL boundaries were saved with --mapl-ratio 4 --mapl-wire bf16, this run has "
    with pytest.raises(
        DistributedTestError, match=saved_with + r"--mapl-ratio 2 --mapl-wire bf16 \(--mapl-wire auto: "
    ):
        run_distributed(_train_cli, 2, other_width_load, timeout=180)
    # a checkpoint saved before the widths were recorded: the first tensor that does not fit (no hint about the
    # default wire: this fp32 run's auto chose bf16, test_the_hint_for_... covers the FP8 case)
    for rank_file in glob.glob(str(tmp_path / "iter_0000002" / "rank_*.pt")):
        state = torch.load(rank_file, weights_only=False)
        del state["mapl"]
        torch.save(state, rank_file)
    with pytest.raises(
        DistributedTestError,
        match=r"--load .*: the checkpoint does not fit this model \(size "
        r"mismatch for .*mapl_.*\); resume with the model and settings it was saved with",
    ):
        run_distributed(_train_cli, 2, other_width_load, timeout=180)


def test_the_hint_for_a_checkpoint_before_the_mapl_record_names_the_bf16_wire_when_auto_chose_fp8():
    """A --mapl-ratio checkpoint saved before 2026-12-06 has the bf16 wire's widths; a bf16 run of today's default
    takes the FP8 wire at twice the rank, so its load fails on U's shape: the line then says why and what resumes."""
    from megatron_taco.training.checkpoint import _before_auto_hint

    common = ["--config", os.path.join(ROOT, "configs", "gpt-tiny.yaml"), "--tensor-model-parallel-size", "1"]
    common += ["--no-sequence-parallel", "--pipeline-model-parallel-size", "2", "--taco-mode", "none"]
    common += ["--mapl-ratio", "4", "--train-iters", "2"]
    fp8 = cli.startup_config(cli.parse_args(common + ["--dtype", "bf16"]), 2)
    assert _before_auto_hint(fp8) == (
        f"; this run's MAPL boundaries have --mapl-ratio 4 --mapl-wire fp8 ({fp8.mapl.wire_choice}): a --mapl-ratio "
        "checkpoint saved before 2026-12-06 has the bf16 wire's widths, and --mapl-wire bf16 resumes it"
    )
    for other in (["--dtype", "bf16", "--mapl-wire", "fp8"], ["--dtype", "bf16", "--mapl-wire", "bf16"], []):
        assert _before_auto_hint(cli.startup_config(cli.parse_args(common + other), 2)) == "", other


def _script_env():
    """The environment for scripts/run.sh: this Python, its own torchrun port."""
    return dict(
        os.environ, PYTHON=sys.executable, PYTHONWARNINGS="ignore", TORCHRUN_ARGS=f"--master-port {free_port()}"
    )


RUN_SH = os.path.join(ROOT, "scripts", "run.sh")


def test_run_script_works_from_any_folder_with_paths_from_there(tmp_path):
    """From another folder: the config from the repository, --save and --load in that folder; a resume with
    nothing left to train stops both ranks with one line."""
    proc = subprocess.run(
        ["bash", RUN_SH, "configs/gpt-tiny.yaml", "--train-iters", "2", "--taco-log-interval", "2", "--save", "ckpt"],
        cwd=tmp_path,
        env=_script_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2/2 | loss" in proc.stdout
    assert (tmp_path / "ckpt" / "latest").read_text() == "2"
    total = re.search(r"^taco total: ([\d.]+) MiB -> ([\d.]+) MiB \(([\d.]+)x\); 0 of \d+ messages", proc.stdout, re.M)
    assert total, proc.stdout[-3000:]
    # the config's int8: a byte per fp32 value plus a 4-byte scale per group of 128
    assert float(total[3]) == pytest.approx(4 / (1 + 4 / 128), rel=0.01)

    proc = subprocess.run(
        ["bash", RUN_SH, "configs/gpt-tiny.yaml", "--train-iters", "2", "--load", "ckpt"],
        cwd=tmp_path,
        env=_script_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert (proc.stdout + proc.stderr).splitlines() == [
        "error: --load ckpt: its checkpoint is at step 2, so --train-iters 2 leaves nothing to train; "
        "use --train-iters > 2"
    ]


def test_run_script_finds_the_repository_environment_or_says_how_to_make_one(tmp_path):
    """A checkout without environments: one line naming the set-up scripts; with .venv-mcore-0.19.2 it runs."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "run.sh").write_text(open(RUN_SH).read())
    for part in ("examples", "megatron_taco"):
        (repo / part).symlink_to(os.path.join(ROOT, part))
    env = {k: v for k, v in _script_env().items() if k != "PYTHON"}
    proc = subprocess.run(
        ["bash", str(repo / "scripts" / "run.sh"), "configs/gpt-tiny.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert (proc.stdout + proc.stderr).splitlines() == [
        f"error: no Python environment in {repo} (.venv or .venv-mcore-0.19.2): run 'bash {repo}/scripts/run_demo.sh' "
        f"or 'bash {repo}/scripts/setup_env.sh' first, or set PYTHON"
    ]

    python = repo / ".venv-mcore-0.19.2" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    proc = subprocess.run(
        ["bash", str(repo / "scripts" / "run.sh"), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--micro-batch-size" in proc.stdout and "--taco-mode" in proc.stdout


def test_ctrl_c_stops_every_rank_with_one_line(tmp_path):
    log = tmp_path / "output.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["bash", RUN_SH, "configs/gpt-tiny.yaml", "--train-iters", "1000", "--taco-log-interval", "0"],
            cwd=tmp_path,
            env=_script_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while "step 1/1000" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the launcher and both ranks get it
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 130, text[-3000:]
    assert re.search(r"^interrupted \(Ctrl-C\) after step \d+ of 1000$", text, re.M), text[-3000:]
    assert text.count("interrupted") == 1 and "Traceback" not in text and "[rank" not in text, text[-3000:]


@pytest.mark.parametrize("vocab,seq,batch,seed", [(256, 128, 2, 3), (8192, 2048, 4, 7), (17, 1, 3, 0), (5, 64, 8, 2)])
def test_synthetic_batches_follow_the_markov_chain_definition(vocab, seq, batch, seed):
    """The vectorised generator against the chain's definition, position by position, from the same draws."""
    import itertools

    from megatron_taco.training.data import synthetic_batches

    gen = torch.Generator().manual_seed(seed * 1000003)
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    for got in itertools.islice(synthetic_batches(vocab, seq, batch, seed), 3):
        tokens = [torch.randint(0, vocab, (batch,), generator=gen)]
        noise = torch.rand(batch, seq, generator=gen) < 0.1
        random_tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
        for i in range(seq):
            tokens.append(torch.where(noise[:, i], random_tokens[:, i], successor[tokens[-1]]))
        expected = torch.stack(tokens, dim=1)
        assert torch.equal(got["tokens"], expected[:, :-1]) and torch.equal(got["labels"], expected[:, 1:])
        assert torch.equal(got["position_ids"], torch.arange(seq).expand(batch, -1))


def _load_a_checkpoint_of_one_rank(root):
    from types import SimpleNamespace

    from megatron_taco.training.checkpoint import load_checkpoint

    try:  # fails on the layout before the trainer's model is touched
        load_checkpoint(trainer=SimpleNamespace(device=torch.device("cpu")), root=root)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_load_of_a_smaller_world_is_one_line_on_every_rank(tmp_path):
    """Saved by 1 rank, loaded by 2: rank 0 reads its file and sees the world size; rank 1 has no file at all."""
    os.makedirs(tmp_path / "iter_0000002")
    torch.save({"world_size": 1}, tmp_path / "iter_0000002" / "rank_00000.pt")
    (tmp_path / "latest").write_text("2")
    messages = run_distributed(_load_a_checkpoint_of_one_rank, 2, str(tmp_path), timeout=60)
    assert messages == [f"--load {tmp_path}: saved with world size 1, now 2"] * 2
