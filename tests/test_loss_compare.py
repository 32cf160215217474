"""benchmarks/loss_compare.py: the paired 95% interval, and a tiny real comparison on gloo that resumes."""

import json
import statistics

import pytest

from megatron_taco.config.taco import LinearSettings, TacoConfig

from benchmarks import loss_compare


def test_paired_interval_is_the_t_interval_of_the_mean():
    # n = 5: mean 3, sample sd sqrt(2.5), t(0.975, 4) = 2.776 -> half-width 2.776 * sqrt(2.5) / sqrt(5)
    mean, sd, low, high = loss_compare.paired_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0 and sd == pytest.approx(statistics.stdev([1, 2, 3, 4, 5]))
    assert (low, high) == pytest.approx((3.0 - 2.776 * 0.5**0.5, 3.0 + 2.776 * 0.5**0.5))
    assert loss_compare.paired_interval([0.4, 0.4])[2:] == pytest.approx((0.4, 0.4))  # no spread, no width


def test_arms_name_taco_settings(tmp_path, capsys):
    assert loss_compare.arm_config("none") is None
    settings = loss_compare.arm_config("fp4-ash/int4-ash+sr").default
    assert (settings.mode, settings.bwd_mode, settings.stochastic_bwd) == ("fp4-ash", "int4-ash", True)
    assert loss_compare.arm_config("fp8-ash").min_bytes == 0  # every message compressed
    # read by the product's flags: the plain arms give the configs the studies so far trained with
    assert loss_compare.arm_config("int4-ash/fp8-ash") == TacoConfig(
        default=LinearSettings(mode="int4-ash", bwd_mode="fp8-ash"), min_bytes=0
    )
    edges = loss_compare.arm_config("int4-ash/fp8-ash@1,8:mode=fp8-ash@2:linears=fc1+fc2")
    assert [edges.for_layer(n).mode_for("fwd") for n in (1, 2, 3, 8)] == ["fp8-ash", "int4-ash", "int4-ash", "fp8-ash"]
    assert edges.for_layer(1).mode_for("bwd") == "fp8-ash" and edges.for_layer(2).linears == {"fc1", "fc2"}
    with pytest.raises(ValueError, match="--taco-override: unknown key 'mod'"):
        loss_compare.arm_config("int4-ash@1:mod=none")
    with pytest.raises(ValueError, match="--taco-mode: invalid value 'int3'"):
        loss_compare.arm_config("int3")
    flags = ["--model", "gpt-tiny", "--device", "cpu", "--json", str(tmp_path / "x.json"), "--tp-loopback", "--steps",
             "2", "--warmup", "0", "--eval-iters", "1", "--micro-batch-size", "2", "--arms", "none;int4-ash@9:mode=none"]  # fmt: skip
    with pytest.raises(SystemExit):  # gpt-tiny has 4 layers: one line before any run starts
        loss_compare.main(flags)
    assert "--taco-override: layer range 9 exceeds the model's 4 layers" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_tiny_comparison_trains_every_run_once_and_resumes(tmp_path, capsys):
    path = tmp_path / "runs.json"
    flags = ["--model", "gpt-tiny", "--arms", "none;fp8-ash", "--seeds", "2", "--steps", "2", "--micro-batches", "1",
             "--micro-batch-size", "2", "--warmup", "0", "--eval-iters", "1", "--device", "cpu", "--json", str(path),
             "--goal", "fp8-ash=0.25"]  # fmt: skip
    loss_compare.main(flags)
    runs = json.loads(path.read_text())["runs"]
    assert sorted(runs) == ["fp8-ash | seed 0", "fp8-ash | seed 1", "none | seed 0", "none | seed 1"]
    assert all(len(r["train"]) == 2 and r["valid"] > 0 and r["parameters"] > 0 for r in runs.values())
    assert runs["none | seed 0"]["valid"] != runs["none | seed 1"]["valid"]  # seeds differ
    commit = json.loads(path.read_text())["commit"]
    assert {r["commit"] for r in runs.values()} == {commit}  # each run names the commit that trained it
    report = (tmp_path / "runs.md").read_text()
    assert "| fp8-ash | 2 |" in report and "+0.25%: " in report
    assert f"- Commit: {commit}; date" in report  # one call: one commit, no per-commit counts
    loss_compare.main(flags)  # again: nothing left to train
    assert "0 runs to train (4 already in" in capsys.readouterr().out
    loss_compare.main(flags[:-2] + ["--report-only", "--arms", "none"])  # one arm's report (no --goal), no training
    assert "rewritten from 4 runs" in capsys.readouterr().out
    report = (tmp_path / "runs.md").read_text()
    assert "| none | 2 |" in report and "fp8-ash |" not in report
    trained, rewritten = report.split("\n")[2].split(" (the last call that trained); this report: ")
    assert "--report-only" not in trained and "--steps 2" in trained  # the command that trained the runs
    assert "--report-only --arms none`" in rewritten  # and the one that wrote this report
    longer = list(flags)
    longer[longer.index("--steps") + 1] = "3"
    with pytest.raises(SystemExit, match="holds runs of another set-up"):
        loss_compare.main(longer)


def _two_steps(skip_sync: bool) -> list:
    import dataclasses

    from megatron_taco.training.data import byte_text_batches, stdlib_text_files
    from megatron_taco.training.loop import TrainConfig, Trainer

    cfg = TrainConfig(dataclasses.replace(loss_compare.MODELS["gpt-tiny"], num_layers=2), tensor_parallel=2,
                      sequence_parallel=True, micro_batch_size=2, num_microbatches=1, dtype="fp32", seed=1234)  # fmt: skip
    trainer = Trainer(cfg)
    if skip_sync:
        loss_compare._skip_single_rank_gradient_all_reduce(trainer)
    data = byte_text_batches(stdlib_text_files()[0], cfg.shape.seq_length, 2, seed=1)
    losses = [trainer.train_step(data)["loss"] for _ in range(3)]
    trainer.close()
    return losses


def test_one_gpu_gloo_leaves_out_only_the_identity_gradient_all_reduce():
    """``--backend gloo`` on one GPU skips DDP's data-parallel all-reduce (gloo has no CUDA allreduce_coalesced):
    with one data-parallel rank it is the identity, so the losses are the same, bit for bit (here on CPU)."""
    from megatron_taco.testing.distributed import run_distributed

    kept, skipped = (run_distributed(_two_steps, 2, skip)[0] for skip in (False, True))
    assert kept == skipped and kept[0] != kept[-1], (kept, skipped)


def test_the_tp_loopback_trains_in_one_process_and_keeps_its_own_runs(tmp_path, capsys):
    path = tmp_path / "loop.json"
    flags = ["--model", "gpt-tiny", "--arms", "none;fp8-ash", "--seeds", "1", "--steps", "2", "--micro-batches", "1",
             "--micro-batch-size", "2", "--warmup", "0", "--eval-iters", "1", "--device", "cpu", "--json", str(path),
             "--tp-loopback"]  # fmt: skip
    loss_compare.main(flags)
    results = json.loads(path.read_text())
    assert results["setup"]["tp_loopback"] and sorted(results["runs"]) == ["fp8-ash | seed 0", "none | seed 0"]
    assert "computed in one process per run" in (tmp_path / "loop.md").read_text()
    assert results["runs"]["none | seed 0"]["parameters"] == 236_928  # gpt-tiny's, counted once at TP=1
    assert results["runs"]["fp8-ash | seed 0"]["nondeterministic"] == []  # every op deterministic on CPU
    with pytest.raises(SystemExit, match="holds runs of another set-up"):  # never mixed with real TP=2 runs
        loss_compare.main([f for f in flags if f != "--tp-loopback"])
    with pytest.raises(SystemExit):
        loss_compare.main(flags + ["--backend", "gloo"])
    assert "no --backend" in capsys.readouterr().err


def test_a_switch_arm_trains_first_with_one_setting_then_another(tmp_path, capsys):
    """``FIRST>STEP>THEN``: FIRST's settings for steps 1..STEP, THEN's after. Switching to the same settings changes
    nothing (the loopback's linears keep their two-rank arithmetic); switching to ``none`` changes the later steps
    only."""
    path = tmp_path / "switch.json"
    arms = "fp8-ash;fp8-ash>1>fp8-ash;fp8-ash>1>none"
    flags = ["--model", "gpt-tiny", "--arms", arms, "--seeds", "1", "--steps", "3", "--micro-batches", "1",
             "--micro-batch-size", "2", "--warmup", "0", "--eval-iters", "1", "--device", "cpu", "--json", str(path),
             "--tp-loopback"]  # fmt: skip
    loss_compare.main(flags)
    runs = json.loads(path.read_text())["runs"]
    fp8, same, off = (runs[f"{arm} | seed 0"]["train"] for arm in arms.split(";"))
    assert same == fp8
    assert off[0] == fp8[0] and off[1:] != fp8[1:]
    for bad, message in [("none>1>fp8-ash", "starts from a TACO arm"), ("fp8-ash>x>none", "FIRST>STEP>THEN"),
                         ("fp8-ash>3>none", "comes after the last step"), ("fp8-ash>1>int3", "--taco-mode"),
                         ("fp8-ash>1>tp1", "cannot end in 'tp1'")]:  # fmt: skip
        with pytest.raises(SystemExit):
            loss_compare.main(flags[:3] + [bad] + flags[4:])
        assert message in capsys.readouterr().err


def test_a_run_names_the_ops_that_have_no_deterministic_implementation():
    import torch

    with loss_compare._nondeterministic_ops() as found:
        assert torch.are_deterministic_algorithms_enabled()
        torch.zeros(4).put_(torch.tensor([1, 1]), torch.tensor([1.0, 2.0]))  # no deterministic put_ on CPU
    assert found == ["put_"] and not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError), loss_compare._nondeterministic_ops():
        raise RuntimeError("a run that fails")
    assert not torch.are_deterministic_algorithms_enabled()  # restored all the same


def test_the_control_arm_is_uncompressed_tp1_arithmetic_and_needs_the_loopback(tmp_path):
    """``tp1``: the loopback's uncompressed run with TP=1's sums instead of TP=2's; it stays next to ``none`` (fp32
    here: rounding differences only), far closer than a compressed arm, and is refused without --tp-loopback."""
    path = tmp_path / "control.json"
    flags = ["--model", "gpt-tiny", "--arms", "none;tp1;fp8-ash", "--seeds", "1", "--steps", "3", "--micro-batches",
             "1", "--micro-batch-size", "2", "--warmup", "0", "--eval-iters", "1", "--device", "cpu", "--json",
             str(path), "--tp-loopback"]  # fmt: skip
    loss_compare.main(flags)
    runs = {key.split(" |")[0]: run for key, run in json.loads(path.read_text())["runs"].items()}
    control = max(abs(a - b) for a, b in zip(runs["tp1"]["train"], runs["none"]["train"]))
    compressed = max(abs(a - b) for a, b in zip(runs["fp8-ash"]["train"], runs["none"]["train"]))
    assert 0 < control < 1e-5 and compressed > 100 * control, (control, compressed)  # different, barely
    with pytest.raises(SystemExit):
        loss_compare.main([f for f in flags if f != "--tp-loopback"] + ["--json", str(tmp_path / "other.json")])


def test_a_bpe_vocabulary_replaces_the_bytes_and_is_part_of_the_set_up(tmp_path, capsys, monkeypatch):
    """``--vocab-size V``: the runs train on BPE tokens (the model's vocabulary is V: more embedding parameters);
    the json's set-up names V, so byte-level runs and BPE runs never mix; a bad V is one line naming the flag."""
    pytest.importorskip("tokenizers", reason="the dev extra installs tokenizers")
    monkeypatch.setenv("MEGATRON_TACO_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "bpe.json"
    flags = ["--model", "gpt-tiny", "--arms", "none", "--seeds", "1", "--steps", "2", "--micro-batches", "1",
             "--micro-batch-size", "2", "--warmup", "0", "--eval-iters", "1", "--device", "cpu", "--json", str(path),
             "--tp-loopback"]  # fmt: skip
    loss_compare.main(flags + ["--vocab-size", "300"])
    results = json.loads(path.read_text())
    assert results["setup"]["vocab_size"] == 300
    # gpt-tiny (hidden 64, untied output layer): 300 padded to 384 (megatron's multiple of 128), 128 more rows
    # in the embedding and in the output layer
    assert results["runs"]["none | seed 0"]["parameters"] == 236_928 + 2 * 128 * 64
    assert "BPE vocabulary of 300" in (tmp_path / "bpe.md").read_text()
    with pytest.raises(SystemExit, match="holds runs of another set-up"):
        loss_compare.main(flags)  # the same json, byte-level
    with pytest.raises(SystemExit):
        loss_compare.main(flags + ["--vocab-size", "100"])
    assert "--vocab-size 100: expected 256 (bytes) or a BPE vocabulary of 257-65536 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("study", ["loss_compare", "mapl_loopback"])
def test_a_warm_up_as_long_as_the_run_is_one_line_naming_the_flag(study, tmp_path, capsys):
    """Both studies refuse it before any run starts (it was a traceback from every run's rank)."""
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(f"benchmarks.{study}").main(
            ["--steps", "60", "--warmup", "100", "--json", str(tmp_path / "x.json")]
        )
    assert "--warmup 100 must be below --steps 60" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_goal_inside_the_controls_spread_reads_not_shown(tmp_path, capsys):
    """The report reads each goal against the control: an arm whose interval straddles its goal while the control's
    own interval reaches past it is 'not shown' (the set-up cannot tell), not 'missed'; an interval wholly above
    the goal is missed; without a control the straddling arm is missed."""
    valid = {  # validation losses per seed: the control and fp8-ash wander around none by a few percent
        "none": [1.00, 1.00, 1.00],
        "tp1": [1.03, 0.99, 1.05],
        "fp8-ash": [1.02, 0.995, 1.03],
        "int4-ash": [1.10, 1.11, 1.12],
    }
    path = tmp_path / "made.json"
    setup = {"model": "gpt-tiny", "steps": 2, "micro_batches": 1, "micro_batch_size": 2, "lr": 6e-4, "warmup": 50,
             "eval_iters": 50, "dtype": "fp32", "tp_loopback": True}  # fmt: skip
    runs = {f"{arm} | seed {s}": {"train": [2.0], "valid": v, "parameters": 1} for arm, vs in valid.items()
            for s, v in enumerate(vs)}  # fmt: skip
    path.write_text(json.dumps({"setup": setup, "runs": runs}))
    flags = ["--model", "gpt-tiny", "--seeds", "3", "--steps", "2", "--micro-batches", "1", "--micro-batch-size", "2",
             "--device", "cpu", "--json", str(path), "--tp-loopback", "--report-only", "--goal", "fp8-ash=0.25",
             "--goal", "int4-ash=0.5"]  # fmt: skip
    edge = "int4-ash@1:mode=fp8-ash"  # an override arm: its goal's ARM holds "=" too
    runs.update({f"{edge} | seed {s}": {"train": [2.0], "valid": v, "parameters": 1} for s, v in enumerate([1.0] * 3)})
    path.write_text(json.dumps({"setup": setup, "runs": runs}))
    loss_compare.main(flags + ["--arms", f"none;fp8-ash;int4-ash;tp1;{edge}", "--goal", f"{edge}=0.5"])
    report = (tmp_path / "made.md").read_text()
    assert "| +0.25%: not shown (the control reaches +" in report
    assert "| +0.5%: missed |" in report
    assert f"| {edge} | 3 |" in report and "| +0.5%: met |" in report
    without_goals = flags[: flags.index("--goal")]
    bad_goals = ("fp8-ash=half", "fp8=0.25", "fp8-ash", "fp8-ash=-0.5", "fp8-ash=nan")
    for bad in bad_goals:  # one line naming the flag, not a traceback
        with pytest.raises(SystemExit):
            loss_compare.main(without_goals + ["--arms", "none;fp8-ash", "--goal", bad])
        assert f"--goal {bad!r}: expected ARM=PERCENT" in capsys.readouterr().err
    assert "Noise floor: the control `tp1`" in report
    loss_compare.main(flags + ["--arms", "none;fp8-ash;int4-ash"])  # no control: nothing to read it against
    report = (tmp_path / "made.md").read_text()
    assert "| +0.25%: missed |" in report and "Noise floor" not in report


def test_the_commit_line_counts_the_runs_of_each_call():
    """A json that several calls filled names the last call's commit and how many runs each commit trained (runs
    from before the per-run record count as 'not recorded'), so a report never credits old runs to the new commit."""
    runs = {"none | seed 0": {}, "tp1 | seed 0": {}, "fp4-ash | seed 0": {"commit": "bbb2222"}}
    line = loss_compare._commits({"commit": "bbb2222", "runs": runs})
    assert (
        line
        == "bbb2222 (the last call that trained); runs per commit: bbb2222 1, not recorded 2 (the calls' log headers name each)"
    )
    assert loss_compare._commits({"commit": "bbb2222", "runs": {"none | seed 0": {"commit": "bbb2222"}}}) == "bbb2222"


def test_the_hardware_line_counts_the_runs_of_each_machine():
    """Runs of a json that calls on two GPUs filled are counted per machine, so a report never credits the H200's
    runs to the H100 of the last call; one machine throughout reads as before (its name only)."""
    runs = {"none | seed 0": {"hardware": "1 x H200"}, "none | seed 9": {"hardware": "1 x H100"}, "tp1 | seed 0": {}}
    line = loss_compare._hardware({"hardware": "1 x H100", "runs": runs})
    assert line == "1 x H100 (the last call that trained); runs per machine: 1 x H100 1, 1 x H200 1, not recorded 1"
    assert (
        loss_compare._hardware({"hardware": "1 x H100", "runs": {"none | seed 0": {"hardware": "1 x H100"}}})
        == "1 x H100"
    )


def test_the_report_shows_how_the_training_gap_grows_per_window():
    """Mean over the paired seeds of each window's training-loss ratio: an arm 1% above the baseline from step 11 on
    reads +0.00 in the first windows and +1.00 in the last; the windows split the steps every paired run has (a
    shorter arm shortens them all, the last window takes the remainder); fewer steps than windows: no table."""
    base = [3.0 - 0.05 * i for i in range(21)]
    runs = {f"none | seed {s}": {"train": base} for s in range(2)}
    runs.update({f"fp8-ash | seed {s}": {"train": base[:10] + [1.01 * x for x in base[10:]]} for s in range(2)})
    lines = loss_compare._training_gaps(["none", "fp8-ash"], runs, seeds=2)
    assert "first 21 steps" in lines[1] and lines[3].startswith("| arm | seeds | 1-2 | 3-4 |")
    assert lines[3].endswith("| 17-18 | 19-21 |")  # the remainder in the last window
    assert lines[-1] == "| `fp8-ash` | 2 | " + " | ".join(["+0.00"] * 5 + ["+1.00"] * 5) + " |"
    runs["tp1 | seed 0"] = {"train": base[:20]}  # one seed, 20 steps: every row over the first 20
    lines = loss_compare._training_gaps(["none", "fp8-ash", "tp1"], runs, seeds=2)
    assert "first 20 steps" in lines[1] and lines[3].endswith("| 19-20 |")
    assert (
        lines[-2].startswith("| `fp8-ash` | 2 |") and lines[-1] == "| `tp1` | 1 | " + " | ".join(["+0.00"] * 10) + " |"
    )
    short = {k: {"train": r["train"][:5]} for k, r in runs.items()}
    assert loss_compare._training_gaps(["none", "fp8-ash"], short, 2) == []


def test_the_plot_draws_the_gaps_of_every_seed_beside_the_report(tmp_path, monkeypatch, capsys):
    """--plot writes a PNG of the per-window training gaps (each seed's own, which the table's means hide) and the
    report links it; without matplotlib, --plot is one line naming the flag before anything runs."""
    base = [3.0 - 0.01 * i for i in range(100)]
    runs = {f"none | seed {s}": {"train": base, "valid": 1.0, "parameters": 1} for s in range(2)}
    runs.update({f"tp1 | seed {s}": {"train": base, "valid": 1.0, "parameters": 1} for s in range(2)})
    runs["fp8-ash | seed 0"] = {"train": [1.02 * x for x in base], "valid": 1.02, "parameters": 1}
    runs["fp8-ash | seed 1"] = {"train": [0.99 * x for x in base], "valid": 0.99, "parameters": 1}
    bounds, gaps = loss_compare._gap_windows(["none", "fp8-ash", "tp1"], runs, seeds=2, windows=50)
    assert bounds[0] == (0, 2) and bounds[-1] == (98, 100)
    assert [round(g, 9) for g in gaps["fp8-ash"][0]] == [2.0] * 50 and [round(g, 9) for g in gaps["fp8-ash"][1]] == [
        -1.0
    ] * 50
    setup = {"model": "gpt-tiny", "steps": 100, "micro_batches": 1, "micro_batch_size": 2, "lr": 6e-4, "warmup": 50,
             "eval_iters": 50, "dtype": "fp32", "tp_loopback": True}  # fmt: skip
    path = tmp_path / "made.json"
    path.write_text(json.dumps({"setup": setup, "runs": runs}))
    plot = tmp_path / "plots" / "gaps.png"
    plot.parent.mkdir()
    flags = ["--model", "gpt-tiny", "--seeds", "2", "--steps", "100", "--micro-batches", "1", "--micro-batch-size", "2",
             "--device", "cpu", "--json", str(path), "--tp-loopback", "--report-only", "--arms", "none;fp8-ash;tp1",
             "--plot", str(plot)]  # fmt: skip
    loss_compare.main(flags)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    assert "![training-loss gaps per window](plots/gaps.png)" in (tmp_path / "made.md").read_text()
    short = {k: dict(r, train=r["train"][:20]) for k, r in runs.items()}  # fewer steps than the plot's 50 windows
    path.write_text(json.dumps({"setup": dict(setup, steps=20), "runs": short}))
    plot.unlink()
    loss_compare.main([f if f != "100" else "20" for f in flags])
    assert not plot.exists() and "![training-loss gaps" not in (tmp_path / "made.md").read_text()  # no dangling link
    real_find_spec = loss_compare.importlib.util.find_spec
    monkeypatch.setattr(
        loss_compare.importlib.util, "find_spec", lambda name: None if name == "matplotlib" else real_find_spec(name)
    )
    with pytest.raises(SystemExit):
        loss_compare.main(flags)
    assert f"--plot {plot}: drawing needs the matplotlib package" in capsys.readouterr().err
