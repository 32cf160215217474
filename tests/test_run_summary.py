"""The trainer's end-of-run summary and its periodic MAPL traffic lines, from real 2-rank runs.

Every number is checked against what the run must have sent, worked out here from the config
(tokens per step, hidden size d, wire width r, dtypes, the codec's message layout), not from the
code that counts it.
"""

import contextlib
import io
import math
import os
import re

import pytest
import yaml

from megatron_taco.testing.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "gpt-tiny.yaml")
MODEL = yaml.safe_load(open(TINY))["model"]
TRAINING = yaml.safe_load(open(TINY))["training"]
S, D, LAYERS, VOCAB = MODEL["seq_length"], MODEL["hidden_size"], MODEL["num_layers"], MODEL["vocab_size"]
MICRO, GLOBAL = TRAINING["micro_batch_size"], TRAINING["global_batch_size"]
TOKENS = GLOBAL * S  # per step (the config's TP=2 and the PP=2 runs here both have data-parallel size 1)
FP32 = 4
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
NUM = r"([\d.]+ (?:B|KiB|MiB|GiB))"


def _bytes(text):
    value, unit = text.split()
    return float(value) * UNITS[unit]


def _close(text, expected):
    """A printed size (4 significant digits) against the expected bytes."""
    return _bytes(text) == pytest.approx(expected, rel=6e-4)


def _trainer(argv, stop_after=None):
    """cli.main on this rank: (stdout, stderr, losses or exit code, TensorBoard scalars of rank 0).
    ``stop_after``: every rank agrees on a Ctrl-C before that step + 1, as the real SIGINT path does."""
    import torch.distributed as dist

    from megatron_taco.training import cli

    scalars = []

    class Writer:
        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def close(self):
            scalars.append("closed")

    cli._tensorboard_writer = lambda directory: Writer() if directory and dist.get_rank() == 0 else None
    cli._check_tensorboard = lambda: None  # the Writer above stands in for the tensorboard package
    if stop_after is not None:
        agreed, checks = cli._interrupt_agreed, []

        def stop(device):
            checks.append(1)
            cli._interrupt_requested = len(checks) > stop_after
            return agreed(device)

        cli._interrupt_agreed = stop
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            result = cli.main(argv)
        except SystemExit as exc:
            result = exc.code
    return out.getvalue(), err.getvalue(), result, scalars


def _one(pattern, text):
    found = re.findall(pattern, text, re.M)
    assert len(found) == 1, (pattern, text[-4000:])
    return found[0]


def _step_lines(text):
    """{step: (loss, tokens/s)} from the per-step lines."""
    return {
        int(m[0]): (float(m[1]), float(m[2]))
        for m in re.findall(r"^step (\d+)/\d+ \| loss ([\d.]+) .*\| (\d+) tokens/s", text, re.M)
    }


def _check_steps_line(text, first, last, of, head="run summary: ", resumed=""):
    """Steps run and the mean tokens/s over the steps after the first (from the step lines' own rates)."""
    steps = _step_lines(text)
    assert sorted(steps) == list(range(first, last + 1))
    after = f"steps {first + 1}-{last}" if last > first + 1 else f"step {last}"
    mean, first_rate = map(
        float,
        _one(
            rf"^{re.escape(head)}{last - first + 1} steps \({first}-{last} of {of}{re.escape(resumed)}\) in [\d.]+ s; "
            rf"(\d+) tokens/s mean over {after} \(step {first}, with start-up: (\d+) tokens/s\)$",
            text,
        ),
    )
    # the mean of the later steps is total tokens over total time: the harmonic mean of their rates
    later = [steps[s][1] for s in range(first + 1, last + 1)]
    assert mean == pytest.approx(len(later) / sum(1 / r for r in later), rel=2e-3)
    assert first_rate == pytest.approx(steps[first][1], abs=1)
    return steps


def test_taco_summary_counts_every_rank_and_the_whole_run_also_on_ctrl_c():
    """TP=2 + SP, the config's int8 on every message; telemetry lines every 2 steps reset the interval's records, Ctrl-C
    before step 4: the summary still counts all three steps of both ranks, then the one Ctrl-C line."""
    out, err, code, _ = run_distributed(
        _trainer, 2, ["--config", TINY, "--train-iters", "100", "--taco-log-interval", "2"], stop_after=3, timeout=300
    )[0]
    assert code == 130
    assert err.strip().splitlines()[-1] == "interrupted (Ctrl-C) after step 3 of 100"
    steps = _check_steps_line(out, 1, 3, 100, head="run summary, stopped by Ctrl-C after step 3 of 100: ")
    assert float(_one(r"^run summary: final loss ([\d.]+) \(step 3\)$", out)) == steps[3][0]

    # per layer, micro-batch and rank, SP's 8 messages: all-gathers of the [s/2, b, d] shard (qkv and fc1
    # forward, proj and fc2 backward) and reduce-scatters of the full [s, b, d] (the other four)
    shard, full = S // 2 * MICRO * D, S * MICRO * D
    messages = LAYERS * (GLOBAL // MICRO) * 2 * 3  # layers x micro-batches x ranks x steps
    payload = messages * 4 * (shard + full) * FP32
    group, header, scale = 128, 16, 4  # int8: a byte per value, a 4-byte fp32 scale per group of 128
    wire = messages * 4 * sum(header + math.ceil(n / group) * (group + scale) for n in (shard, full))
    sent, uncompressed, ratio, compressed, calls = _one(
        rf"^run summary: TACO tensor-parallel traffic, all ranks, whole run: {NUM} sent vs "
        rf"{NUM} uncompressed \(([\d.]+)x\); (\d+) of (\d+) messages compressed, sampled rel.err [\d.]+$",
        out,
    )
    assert _close(sent, wire) and _close(uncompressed, payload), (sent, wire, uncompressed, payload)
    assert float(ratio) == pytest.approx(payload / wire, abs=0.005)
    assert int(compressed) == int(calls) == messages * 8
    # the periodic line (rank 0's linears, steps 1-2) is unchanged: half of two steps' payload
    assert re.search(rf"^taco total: {payload / 3 / 2**20:.2f} MiB -> ", out, re.M), out[-3000:]
    assert "mapl" not in out.lower()


def test_taco_switch_turns_compression_off_after_its_iteration():
    """--taco-switch 2:mode=none: steps 1-2 compress every message, step 3 none; one line says when, and the
    summary counts the compressed messages of two steps."""
    out, err, code, _ = run_distributed(
        _trainer, 2, ["--config", TINY, "--train-iters", "3", "--taco-switch", "2:mode=none"], timeout=300
    )[0]
    assert code is not None and not isinstance(code, int), err[-3000:]
    assert "; after iteration 2: none; min-bytes" in out
    assert _one(r"^TACO after iteration 2 on this rank's layers: (.*)$", out) == "qkv -, proj -, fc1 -, fc2 -"
    messages_per_step = LAYERS * (GLOBAL // MICRO) * 2 * 8  # layers x micro-batches x ranks x SP's 8 messages
    compressed = _one(r"^run summary: TACO tensor-parallel traffic, .*; (\d+) of \d+ messages compressed", out)
    assert int(compressed) == 2 * messages_per_step


MAPL_PP2 = [
    "--config",
    TINY,
    "--tensor-model-parallel-size",
    "1",
    "--no-sequence-parallel",
    "--pipeline-model-parallel-size",
    "2",
    "--taco-mode",
    "none",
    "--mapl-ratio",
    "4",
]
R = D // 4
ANCHOR = 64  # --mapl-anchor-rank default
# replica sync per step, both ranks of the boundary: U's gradient [d, r] and the anchor gradients (tokens
# [V, k], basis [k, d], positions [s, k]) all-reduced in fp32 over the 2-rank pair: each rank sends each once
SYNC = 2 * FP32 * (D * R + VOCAB * ANCHOR + ANCHOR * D + S * ANCHOR)


def test_the_trainer_takes_the_fp8_wire_by_default_for_a_2_byte_pipeline_dtype():
    """The default --mapl-wire auto in the trainer: with --dtype bf16 (a GPU run) the FP8 wire at twice the rank
    (2d / 4 = 32 values at 4x in bytes) and the reason for the start-up line; fp32 keeps bf16 (the test above)."""
    from megatron_taco.training import cli

    for dtype, wire, rank in (("bf16", "fp8", 2 * R), ("fp16", "fp8", 2 * R), ("fp32", "bf16", R)):
        mapl = cli.parse_args(MAPL_PP2 + ["--dtype", dtype]).mapl
        assert (mapl.wire, mapl.wire_rank(D)) == (wire, rank), dtype
        assert mapl.wire_choice.startswith(f"--mapl-wire auto: {wire}, "), mapl.wire_choice
    assert cli.parse_args(MAPL_PP2 + ["--dtype", "bf16", "--mapl-wire", "bf16"]).mapl.wire_choice is None


def test_mapl_pp2_lines_and_summary_count_the_boundary_traffic():
    """PP=2 at 4x on fp32 activations: per step, d-wide activations of every token would cross forward and
    backward; r-wide ones do. Validation's forward passes are not counted."""
    out, _, losses, scalars = run_distributed(
        _trainer,
        2,
        MAPL_PP2 + ["--train-iters", "4", "--taco-log-interval", "2", "--eval-iters", "1", "--tensorboard-dir", "tb"],
        timeout=300,
    )[0]
    assert len(losses) == 4
    assert re.search(rf"^MAPL: 1 boundary, hidden {D} -> \[{R}\] \(4x\), ", out, re.M), out[:3000]
    assert "; --mapl-wire auto: bf16, the codec wires keep --mapl-ratio's bytes for a 2-byte pipeline dtype" in out
    steps = _check_steps_line(out, 1, 4, 4)
    validation = float(_one(r"^validation at step 4 \| loss ([\d.]+)$", out))
    assert _one(r"^run summary: final loss ([\d.]+) \(step 4\); final validation loss ([\d.]+) \(step 4\)$", out) == (
        f"{steps[4][0]:.4f}",
        f"{validation:.4f}",
    )

    full, wire = TOKENS * D * FP32, TOKENS * R * FP32
    lines = re.findall(
        rf"^mapl boundary 0 \(stage 0 -> 1\) per step, all ranks: forward {NUM} -> {NUM} \(([\d.]+)x\), "
        rf"backward {NUM} -> {NUM} \(([\d.]+)x\), replica sync {NUM}$",
        out,
        re.M,
    )
    assert len(lines) == 2 and lines[0] == lines[1], (lines, out[-3000:])  # steps 1-2, then 3-4 alone
    fwd_full, fwd_wire, fwd_ratio, bwd_full, bwd_wire, bwd_ratio, sync = lines[0]
    assert all(_close(text, full) for text in (fwd_full, bwd_full)), (fwd_full, bwd_full, full)
    assert all(_close(text, wire) for text in (fwd_wire, bwd_wire)), (fwd_wire, bwd_wire, wire)
    assert fwd_ratio == bwd_ratio == "4.00" and _close(sync, SYNC), (sync, SYNC)
    totals = re.findall(
        rf"^mapl total over 2 steps, all boundaries and ranks: {NUM} -> {NUM} \(4.00x\); with replica "
        rf"sync {NUM} \(([\d.]+)x\)$",
        out,
        re.M,
    )
    assert len(totals) == 2 and totals[0] == totals[1], totals
    total_full, total_wire, synced, with_sync = totals[0]
    assert _close(total_full, 2 * 2 * full) and _close(total_wire, 2 * 2 * wire)
    assert _close(synced, 2 * (2 * wire + SYNC)) and float(with_sync) == pytest.approx(
        2 * full / (2 * wire + SYNC), abs=0.005
    )
    assert scalars[-1] == "closed"
    assert ("mapl/boundary_0/forward/wire_MiB_per_step", wire / 2**20, 2) in scalars, scalars
    assert ("mapl/boundary_0/backward/uncompressed_MiB_per_step", full / 2**20, 2) in scalars, scalars

    per_step = _one(
        rf"^run summary: MAPL boundary 0 \(stage 0 -> 1\) per training step, all ranks: forward {NUM} "
        rf"sent vs {NUM} uncompressed \(4.00x\), backward {NUM} sent vs {NUM} uncompressed \(4.00x\), "
        rf"replica sync {NUM}$",
        out,
    )
    assert [_close(text, value) for text, value in zip(per_step, [wire, full, wire, full, SYNC])] == [True] * 5, (
        per_step
    )
    total_wire, total_full, synced = _one(
        rf"^run summary: MAPL total, 4 training steps, all boundaries and ranks: {NUM} sent vs {NUM} uncompressed "
        rf"\(4.00x\); with replica sync {NUM} sent \([\d.]+x\)$",
        out,
    )
    assert _close(total_wire, 4 * 2 * wire) and _close(total_full, 4 * 2 * full)
    assert _close(synced, 4 * (2 * wire + SYNC))


def test_a_configs_taco_mode_at_tp1_is_off_and_the_log_says_so():
    """A PP-only run of a config whose TACO mode is on: TP=1 has no tensor-parallel traffic. The log says TACO is
    off (it claimed the mode on every layer and then counted 0 of 0 messages)."""
    argv = [arg for arg in MAPL_PP2 if arg not in ("--taco-mode", "none")] + ["--train-iters", "1"]
    out, _, losses, _ = run_distributed(_trainer, 2, argv, timeout=300)[0]
    assert len(losses) == 1
    assert re.search(
        r"^TACO off: --tensor-model-parallel-size 1 has no tensor-parallel traffic, so --taco-mode "
        rf"{yaml.safe_load(open(TINY))['taco']['mode']} ",
        out,
        re.M,
    ), out[:3000]
    assert "on this rank's layers" not in out and "run summary: TACO" not in out


def test_mapl_vq_summary_of_a_resumed_run_counts_the_indices_sent(tmp_path):
    """Residual VQ, 2 levels of 32 codes: 2 one-byte indices per token, padded to one fp32 element, go forward;
    the r-wide gradient goes back; the code words streamed to the receiver add to the replica sync."""
    vq = MAPL_PP2 + ["--mapl-vq-levels", "2", "--mapl-vq-codes", "32"]
    first = run_distributed(
        _trainer, 2, vq + ["--train-iters", "2", "--save", str(tmp_path), "--taco-log-interval", "0"], timeout=300
    )[0][0]
    assert "run summary: 2 steps (1-2 of 2) in " in first
    assert "mapl boundary" not in first and "mapl total" not in first  # --taco-log-interval 0: no periodic lines
    out, _, losses, _ = run_distributed(
        _trainer, 2, vq + ["--train-iters", "4", "--load", str(tmp_path), "--taco-log-interval", "3"], timeout=300
    )[0]
    assert len(losses) == 2
    assert re.search(
        r"residual VQ 2 x 32 codes \(2 index bytes/token forward, sent as 4 bytes in float32\); "
        r"--mapl-wire auto: bf16, --mapl-vq-levels sends code indices$",
        out,
        re.M,
    ), out[:3000]
    _check_steps_line(out, 3, 4, 4, resumed=", resumed from step 2")
    rows = [int(n) for n in re.findall(r"^step \d/4 .*\| (\d+) code words synced$", out, re.M)]  # rank 0 sends them
    assert len(rows) == 2
    # per code word: its int64 id and r fp32 values; per step: the int64 row count
    sync = (2 * SYNC + sum(8 + n * (8 + R * FP32) for n in rows)) / 2
    index_wire, grad_wire, full = TOKENS * FP32, TOKENS * R * FP32, TOKENS * D * FP32
    fwd_wire, fwd_full, fwd_ratio, bwd_wire, bwd_full, bwd_ratio, synced = _one(
        rf"^run summary: MAPL boundary 0 \(stage 0 -> 1\) per training step, all ranks: forward {NUM} sent vs {NUM} "
        rf"uncompressed \(([\d.]+)x\), backward {NUM} sent vs {NUM} uncompressed \(([\d.]+)x\), replica sync {NUM}$",
        out,
    )
    assert _close(fwd_wire, index_wire) and _close(bwd_wire, grad_wire), (fwd_wire, bwd_wire)
    assert _close(fwd_full, full) and _close(bwd_full, full)
    assert (fwd_ratio, bwd_ratio) == (f"{full / index_wire:.2f}", "4.00")
    assert _close(synced, sync), (synced, sync)
    assert re.search(
        rf"^run summary: MAPL total, 2 training steps, all boundaries and ranks: "
        rf"{NUM} sent vs {NUM} uncompressed \({2 * full / (index_wire + grad_wire):.2f}x\)",
        out,
        re.M,
    )
    # the first periodic line after the resume covers step 3 alone
    fwd_full, fwd_wire = _one(rf"^mapl boundary 0 \(stage 0 -> 1\) per step, all ranks: forward {NUM} -> {NUM} ", out)
    assert _close(fwd_full, full) and _close(fwd_wire, index_wire), (fwd_full, fwd_wire)
    _one(r"^mapl total over 1 step, all boundaries and ranks: ", out)


def test_mapl_fp8_wire_summary_counts_the_codec_messages():
    """--mapl-wire fp8 at 4x in bytes on fp32 activations: r = d / 2 values of one byte per token, a power-of-two
    scale byte per group of them and a 16-byte header per micro-batch message, both ways."""
    out, _, losses, _ = run_distributed(
        _trainer, 2, MAPL_PP2 + ["--mapl-wire", "fp8", "--train-iters", "2", "--taco-log-interval", "0"], timeout=300
    )[0]
    assert len(losses) == 2
    rank = D // 2
    group = next(g for g in (128, 64, 32, 16) if rank % g == 0)
    per_token = rank + rank // group
    assert re.search(
        rf"^MAPL: 1 boundary, hidden {D} -> \[{rank}\] \({FP32 * D / per_token:.2f}x in bytes: z as FP8 codec "
        r"messages both ways\), ",
        out,
        re.M,
    ), out[:3000]
    messages = GLOBAL // MICRO  # one per micro-batch and direction
    wire, full = messages * 16 + TOKENS * per_token, TOKENS * D * FP32
    fwd_wire, fwd_full, _, bwd_wire, bwd_full, _, _ = _one(
        rf"^run summary: MAPL boundary 0 \(stage 0 -> 1\) per training step, all ranks: forward {NUM} sent vs {NUM} "
        rf"uncompressed \(([\d.]+)x\), backward {NUM} sent vs {NUM} uncompressed \(([\d.]+)x\), replica sync {NUM}$",
        out,
    )
    assert _close(fwd_wire, wire) and _close(bwd_wire, wire), (fwd_wire, bwd_wire, wire)
    assert _close(fwd_full, full) and _close(bwd_full, full)
