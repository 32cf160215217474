"""Loss you can trust: a baseline and TACO variants trained side by side, same seeds, data and steps, with the 95%
interval of each variant's difference from the baseline.

    # 2 GPUs (NCCL), the headline shape: ~25M parameters, 5 seeds, 1000 steps (resumable across 10-minute calls)
    python -m benchmarks.loss_compare --model gpt-25m --arms "none;fp8-ash;fp4-ash;int4-ash;fp4-ash/fp8-ash" \\
        --seeds 5 --steps 1000 --parallel 10 --json benchmarks/results/loss_compare_gpt.json
    # 1 GPU: each run's two ranks computed in one process (benchmarks/tp_loopback.py)
    python -m benchmarks.loss_compare --model gpt-25m --arms "none;fp8-ash" --tp-loopback --parallel 10 --json ...
    # CPU (gloo, fp32): exploring, not a headline
    python -m benchmarks.loss_compare --model gpt-tiny --steps 200 --seeds 5 --device cpu --parallel 1 \\
        --json benchmarks/results/loss_compare_cpu.json

Every run is TP=2 + SP on 2 ranks (a process pair; ``--parallel`` pairs at a time share the GPUs: that changes how
fast they go, not what they compute). ``--backend gloo`` on a machine with one GPU puts both ranks on it (gloo
carries the CUDA tensors through the host; NCCL refuses two ranks on one device): the same arithmetic (a sum of
two ranks rounds once, whichever library adds), but slow: 1.0-1.3 s per step of gpt-25m with 3 pairs on one H200,
about 20 minutes per 1000-step run (``results/logs/loss_compare_gloo_one_gpu_2026-12-02.md``). ``--tp-loopback``
computes both ranks in one process instead: a TP=1 model whose linears do TP=2 + SP's arithmetic and send TP=2's
messages through the codec (``benchmarks/tp_loopback.py``; on CPU it gives a real TP=2 run's gradients to 1e-5),
as fast as TP=1. Arm ``none`` is megatron-core's stock linears (with ``--tp-loopback``: TP=2's uncompressed
arithmetic, the partial sums rounded to bf16 before they add); ``tp1`` (``--tp-loopback`` only) is the control:
uncompressed with TP=1's arithmetic, so its difference from ``none`` measures how far two equally exact runs drift
apart (the noise floor a TACO arm's difference must be read against); ``MODE[/BWD_MODE][+sr][@OVERRIDE]...`` is
TACO with MODE on the forward traffic, BWD_MODE on the gradients (default MODE), stochastic rounding of the
gradients' 4-bit codes with ``+sr`` and each ``@OVERRIDE`` as a ``--taco-override``
(``int4-ash/fp8-ash@1,8:mode=fp8-ash``: FP8 in layers 1 and 8), every message compressed (no link policy: a loss
study must compress). ``FIRST>STEP>THEN`` trains with arm FIRST (a TACO arm) for steps 1..STEP and THEN's settings
after (``int4-ash/fp8-ash>800>fp8-ash``: 4-bit forward, FP8 for the last 200 steps of 1000; THEN may be ``none``):
the lead that the 4-bit gaps open late in the decay of the learning rate; the trainer's ``--taco-switch`` does the same
with THEN's whole settings. (The switch makes new codecs: a ``+sr``
arm's stochastic rounding draws other noise after it.)
Seed s sets the initialisation and the order of the training data, the same for every arm; the data is real
text (the Python standard library's sources, byte-level, or with ``--vocab-size V`` a BPE vocabulary of V tokens
trained on the training split), validation on held-out files. Byte-level gpt-25m at 1000 steps ends in the steep
part of its curve, where two equally exact runs end up to 8% apart (the ``tp1`` control,
``results/logs/loss_compare_gpt25m_reading_2026-12-03.md``); on BPE text (``--vocab-size 8192``, one epoch) the
control's 95% interval is [-0.16%, +0.35%] over 10 seeds ([-0.40%, +0.73%] over the first 5;
``results/logs/loss_compare_bpe8192_int4_20_seeds_reading_2026-12-07.md``).

Runs train with PyTorch's deterministic algorithms where they exist; each run's record lists the ops that have none
(``nondeterministic``, also in the report), the suspects when a GPU run does not reproduce itself.

Statistics: for each seed, the variant's final validation loss relative to the baseline's of the same seed, in
percent; their mean, sample standard deviation and the t-distribution's 95% interval of the mean (paired by seed). The
report adds each arm's training-loss gap per tenth of the run (mean over seeds): how a gap grows, beside the
control's; ``--plot PNG`` draws them in 50 windows, every seed and the mean. A goal (``--goal ARM=P``) is met when
the upper end is <= P. With the control arm in the study, a goal the control's own interval reaches past reads
'not shown' (unless the arm's whole interval is above it: missed). Results accumulate in ``--json`` after every run:
a call cut short keeps what it finished, and the same command again trains only the runs still missing. The report
(``--report``, default: the json's name with ``.md``) is rewritten after every run. """

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import re
import shlex
import statistics
import time
import warnings
from collections import Counter
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import yaml

from megatron_taco.config.taco import TacoConfig, add_taco_args, taco_config_from_args
from megatron_taco.testing.distributed import run_distributed
from megatron_taco.training.data import cache_stdlib_text, stdlib_text_batches
from megatron_taco.training.loop import TrainConfig, Trainer
from megatron_taco.training.model import QWEN_ARCHITECTURE, ModelShape

from .e2e import DETERMINISTIC_CUBLAS
from .tp_loopback import simulate_two_ranks
from .provenance import project_commit

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def _config_shape(name: str, **changes) -> ModelShape:
    """The model section of ``configs/NAME.yaml``, with ``changes``."""
    with open(os.path.join(CONFIGS, f"{name}.yaml")) as f:
        return dataclasses.replace(ModelShape.from_dict(yaml.safe_load(f)["model"]), **changes)


# byte-level text: vocabulary 256 for every shape (--vocab-size replaces it)
MODELS: Dict[str, ModelShape] = {
    # ~25M parameters (8 x 12 x 512^2 = 25.2M in the layers): 5 seeds per arm fit the GPU budget
    "gpt-25m": ModelShape(
        num_layers=8, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048, vocab_size=256, seq_length=1024
    ),
    "qwen-25m": ModelShape(
        num_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=1536,
        vocab_size=256,
        seq_length=1024,
        **QWEN_ARCHITECTURE,
    ),
    # configs/gpt-125m.yaml's shape (GPT-3 Small) on the byte-level vocabulary
    "gpt-125m": _config_shape("gpt-125m", vocab_size=256),
    # CPU exploration: configs/gpt-tiny.yaml, and configs/qwen-tiny.yaml with FFN 192 (the config has 128)
    "gpt-tiny": _config_shape("gpt-tiny"),
    "qwen-tiny": _config_shape("qwen-tiny", ffn_hidden_size=192),
}
# two-sided 95% quantiles of Student's t, by degrees of freedom (1-30); beyond 30 the normal's 1.96 (+ < 2.2%)
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
T_975 += (2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


# the control arm: uncompressed, with TP=1's arithmetic under --tp-loopback (each linear's two rank partials summed
# inside one GEMM in fp32, not rounded to bf16 apiece first): as exact as ``none``, different in the last bits, so
# its difference from ``none`` is the noise floor of the comparison (how far two equally good runs drift apart)
CONTROL_ARM = "tp1"


def arm_phases(arm: str) -> Tuple[Optional[TacoConfig], Optional[Tuple[int, TacoConfig]]]:
    """The arm's settings from step 1, and for ``FIRST>STEP>THEN`` (STEP, THEN's settings after it; ``none``: every
    linear stock). A mistake raises one line."""
    first, *switch = arm.split(">")
    if not switch:
        return arm_config(arm), None
    if len(switch) != 2 or not switch[0].isdigit() or int(switch[0]) < 1:
        raise ValueError("a switch reads FIRST>STEP>THEN with STEP >= 1, e.g. int4-ash/fp8-ash>800>fp8-ash")
    start = arm_config(first)
    if start is None:
        raise ValueError(f"a switch starts from a TACO arm, not {first!r}")
    if switch[1] == CONTROL_ARM:
        raise ValueError(f"a switch cannot end in {CONTROL_ARM!r} (TP=1's arithmetic is the whole run's)")
    return start, (int(switch[0]), arm_config(switch[1]) or TacoConfig(min_bytes=0))


def arm_config(arm: str) -> Optional[TacoConfig]:
    """``none`` and the control arm -> None (stock linears); ``MODE[/BWD_MODE][+sr][@OVERRIDE]...`` -> TACO on every
    message, read by the product's own flags: --taco-mode MODE --taco-bwd-mode BWD_MODE [--taco-stochastic-rounding]
    --taco-override OVERRIDE (each, e.g. ``int4-ash/fp8-ash@1,8:mode=fp8-ash``: FP8 in layers 1 and 8) with
    --taco-min-bytes 0. A mistake raises the flag's own one-line error."""
    if arm in ("none", CONTROL_ARM):
        return None
    text, *overrides = arm.split("@")
    text, stochastic = (text[: -len("+sr")], True) if text.endswith("+sr") else (text, False)
    mode, _, bwd_mode = text.partition("/")
    flags = ["--taco-mode", mode, "--taco-min-bytes", "0"] + (["--taco-bwd-mode", bwd_mode] if bwd_mode else [])
    flags += ["--taco-stochastic-rounding"] * stochastic + [f for o in overrides for f in ("--taco-override", o)]
    return taco_config_from_args(add_taco_args(argparse.ArgumentParser(add_help=False)).parse_args(flags))


def paired_interval(differences: Sequence[float]) -> Tuple[float, float, float, float]:
    """(mean, sample standard deviation, lower, upper) of the t-distribution's 95% interval of the mean."""
    n = len(differences)
    mean = statistics.mean(differences)
    if n < 2:
        return mean, float("nan"), float("nan"), float("nan")
    sd = statistics.stdev(differences)
    t = T_975[n - 2] if n - 1 <= len(T_975) else 1.96
    half = t * sd / math.sqrt(n)
    return mean, sd, mean - half, mean + half


def _run(model: str, arm: str, seed: int, steps: int, micro_batches: int, micro_batch_size: int, lr: float,
         warmup: int, eval_iters: int, dtype: str, loopback: bool = False, vocab_size: int = 256) -> dict:  # fmt: skip
    """One training run on this process pair: per-step training losses and the final validation loss."""
    shape = dataclasses.replace(MODELS[model], vocab_size=vocab_size)
    first, switch = arm_phases(arm)
    if torch.cuda.is_available():  # rank r on GPU r mod count (with gloo on one GPU: both on it)
        torch.cuda.set_device(torch.distributed.get_rank() % torch.cuda.device_count())
    cfg = TrainConfig(
        shape,
        tensor_parallel=1 if loopback else 2,
        sequence_parallel=not loopback,
        micro_batch_size=micro_batch_size,
        num_microbatches=micro_batches,
        dtype=dtype,
        lr=lr,
        lr_warmup_iters=warmup,
        lr_decay_style="cosine",
        lr_decay_iters=steps,
        min_lr=lr / 10,
        seed=1234 + seed,
        taco=first if switch is None else dataclasses.replace(first, switch=switch),  # --taco-switch's mechanism
    )
    trainer = Trainer(cfg)
    if loopback and arm != CONTROL_ARM:
        simulate_two_ranks(trainer.models)
    elif torch.cuda.is_available() and torch.distributed.get_backend() == "gloo":
        _skip_single_rank_gradient_all_reduce(trainer)
    # megatron-core marks the TP-sharded weights; the rest is replicated on both ranks
    parameters = sum(
        p.numel() * (2 if getattr(p, "tensor_model_parallel", False) and not loopback else 1)
        for p in trainer.model.parameters()
    )
    data = stdlib_text_batches("train", vocab_size, shape.seq_length, micro_batch_size, seed=1 + seed)
    start = time.perf_counter()
    losses = []
    with _nondeterministic_ops() as nondeterministic:
        for step in range(1, steps + 1):
            losses.append(trainer.train_step(data)["loss"])
            if step % 250 == 0 and torch.distributed.get_rank() == 0:
                print(f"  {_key(arm, seed)}: step {step}/{steps}, train loss {losses[-1]:.4f}, "
                      f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
    seconds = time.perf_counter() - start
    valid = trainer.evaluate(
        stdlib_text_batches("valid", vocab_size, shape.seq_length, micro_batch_size, seed=2), eval_iters
    )
    trainer.close()
    return dict(train=losses, valid=valid, parameters=parameters, seconds=seconds, nondeterministic=nondeterministic)


@contextlib.contextmanager
def _nondeterministic_ops() -> Iterator[List[str]]:
    """Trains with PyTorch's deterministic algorithms where they exist and yields the list of the ops that have
    none (PyTorch's warning, one entry per op): a GPU run that does not reproduce itself names its cause here."""
    found: List[str] = []
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
        messages = {str(w.message) for w in caught}
        found.extend(sorted({m.split(" does not have")[0] for m in messages
                             if "deterministic implementation" in m or "not deterministic" in m}))  # fmt: skip
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def _skip_single_rank_gradient_all_reduce(trainer: Trainer) -> None:
    """Gloo has no CUDA ``allreduce_coalesced``, which megatron-core's DDP uses for the data-parallel gradient
    all-reduce. With one data-parallel rank (TP=2 on 2 ranks) that all-reduce sums one tensor, the identity, so
    leaving it out computes the same numbers; the TP all-reduces of finalize_model_grads stay (plain all_reduce).
    DDP's NaN / Inf gradient check runs inside the skipped call: here a non-finite gradient shows in the loss."""
    from megatron.core import parallel_state

    assert parallel_state.get_data_parallel_world_size() == 1, "only a single data-parallel rank can skip its sync"
    for model in trainer.models:
        model.finish_grad_sync = lambda *args, **kwargs: None


def _key(arm: str, seed: int) -> str:
    return f"{arm} | seed {seed}"


def _parameter_counts(results: dict) -> str:
    """The parameter count of the runs (one number when every arm has the same, as TACO adds none)."""
    counts = sorted({run["parameters"] for run in results["runs"].values()})
    return " / ".join(f"{c:,}" for c in counts) or "?"


def report(args, results: dict, image: Optional[str] = None) -> List[str]:
    """The markdown report of what ``results`` holds so far; ``image``: the gap plot's path from the report's folder."""
    arms = args.arms.split(";")
    base = arms[0]
    shape = dataclasses.replace(MODELS[args.model], vocab_size=args.vocab_size)
    tokens = args.steps * args.micro_batches * args.micro_batch_size * shape.seq_length
    lines = [
        f"# Loss comparison: {args.model}, {', '.join(arms)}",
        "",
        (
            f"- Command: `{results.get('command', 'not recorded')}` (the last call that trained); this report: "
            f"`{_command(args)}`"
            if args.report_only
            else f"- Command: `{results.get('command', _command(args))}`"
        ),
        f"- Commit: {_commits(results)}; date {results.get('date')}; hardware: {_hardware(results)}; "
        f"torch {results.get('torch', torch.__version__)}",
        f"- Model: {args.model} ({_parameter_counts(results)} parameters), {dataclasses.asdict(shape)}",
        f"- Training: TP=2 + SP {_transports(args, results)}, {args.dtype}, {args.steps} steps of {args.micro_batches} x {args.micro_batch_size} "
        f"sequences of {shape.seq_length} {_token_words(args.vocab_size)} = {tokens:,} tokens seen per run; Adam lr {args.lr:g}, "
        f"{args.warmup} warm-up steps, cosine to lr/10; validation: {args.eval_iters} x {args.micro_batch_size} "
        "held-out sequences (Python stdlib sources). Seed s: initialisation and data order, the same for every arm.",
        f"- Difference: 100 x (validation loss / the `{base}` run's of the same seed - 1), per seed; then mean, sample "
        "standard deviation and the t-distribution's 95% interval of the mean.",
        "",
        "| arm | seeds | validation loss, mean +- std | difference vs "
        + base
        + " per seed | mean | std | 95% interval "
        "| goal (upper end <=) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    goals = dict(goal.rsplit("=", 1) for goal in args.goal)
    runs = results["runs"]
    floor = _control_interval(arms, runs, args.seeds)
    for arm in arms:
        seeds = sorted(s for s in range(args.seeds) if _key(arm, s) in runs)
        if not seeds:
            lines.append(f"| {arm} | 0 | - | - | - | - | - | - |")
            continue
        valid = [runs[_key(arm, s)]["valid"] for s in seeds]
        spread = (
            f"{statistics.mean(valid):.4f} +- {statistics.stdev(valid):.4f}" if len(valid) > 1 else f"{valid[0]:.4f}"
        )
        paired = [s for s in seeds if _key(base, s) in runs]
        if arm == base or not paired:
            lines.append(f"| {arm} | {len(seeds)} | {spread} | - | - | - | - | - |")
            continue
        diffs = [100 * (runs[_key(arm, s)]["valid"] / runs[_key(base, s)]["valid"] - 1) for s in paired]
        mean, sd, low, high = paired_interval(diffs)
        verdict = _verdict(goals.get(arm), low, high, floor)
        lines.append(
            f"| {arm} | {len(seeds)} | {spread} | {', '.join(f'{d:+.2f}%' for d in diffs)} | {mean:+.3f}% | "
            f"{sd:.3f} | [{low:+.3f}%, {high:+.3f}%] | {verdict} |"
        )
    if floor is not None:
        lines += [
            "",
            f"Noise floor: the control `{CONTROL_ARM}` (uncompressed, only rounding differs) ends {floor[0]:+.2f}% from "
            f"`{base}`, 95% interval [{floor[2]:+.2f}%, {floor[3]:+.2f}%]. A goal inside that spread cannot be shown by "
            "this set-up: such a verdict reads 'not shown'.",
        ]
    lines += _training_gaps(arms, runs, args.seeds)
    if image:  # the picture of the same gaps, every seed and the mean
        lines += ["", f"![training-loss gaps per window]({image})"]
    nondeterministic = sorted({op for run in runs.values() for op in run.get("nondeterministic", [])})
    if nondeterministic:
        lines += ["", f"Ops without a deterministic implementation (PyTorch's list): {', '.join(nondeterministic)}."]
    before = sum("nondeterministic" not in run for run in runs.values())
    if before:
        lines += ["", f"{before} of the {len(runs)} runs trained before deterministic algorithms (c0260f1): a run "
                  "of the same seed and arm need not reproduce them."]  # fmt: skip
    missing = [(a, s) for a in arms for s in range(args.seeds) if _key(a, s) not in runs]
    if missing and args.report_only:  # arms trained with fewer seeds than --seeds: the table's seeds column
        lines += ["", f"{len(missing)} runs of --seeds {args.seeds} are not in the json (arms with fewer seeds)."]
    elif missing:
        lines += ["", f"{len(missing)} runs still missing: run the same command again to train them."]
    return lines


def write_report(args, results: dict, path: str) -> None:
    """The markdown report at ``path``, and the gap plot when ``--plot`` names one (linked only once it is drawn)."""
    drawn = bool(args.plot) and plot_training_gaps(args.plot, args.arms.split(";"), results["runs"], args.seeds)
    image = os.path.relpath(args.plot, os.path.dirname(path) or ".") if drawn else None
    with open(path, "w") as f:
        f.write("\n".join(report(args, results, image)) + "\n")


def _commits(results: dict) -> str:
    """The commit of the last call that trained, and how many runs each commit trained when the json holds runs of
    several calls (runs trained before 2026-12-03's per-run record do not name theirs; each call's log header does)."""
    last = results.get("commit") or project_commit()
    line = _last_and_per_run(results, "commit", last, "commit")
    return line if line == last else f"{line} (the calls' log headers name each)"


def _hardware(results: dict) -> str:
    """The GPU (or CPU) of the last call that trained, and how many runs each trained on when the json holds runs of
    several machines (a run records its machine since 2026-12-07; the json's machine before that stands for the older runs)."""
    return _last_and_per_run(results, "hardware", str(results.get("hardware")), "machine")


def _last_and_per_run(results: dict, field: str, last: str, noun: str) -> str:
    """`last` (the value of the last call that trained) alone when every run records it, else followed by how many
    runs record each value of `field`."""
    counts = Counter(str(run.get(field, "not recorded")) for run in results["runs"].values())
    if set(counts) <= {last}:
        return last
    per_value = ", ".join(f"{value} {n}" for value, n in sorted(counts.items()))
    return f"{last} (the last call that trained); runs per {noun}: {per_value}"


def _gap_windows(
    arms: List[str], runs: dict, seeds: int, windows: int
) -> Tuple[List[Tuple[int, int]], Dict[str, Dict[int, List[float]]]]:
    """Each arm's training loss against the baseline's (the first arm) per window of steps, per paired seed, in %:
    (the windows' [lo, hi) step bounds, {arm: {seed: gaps}}). The windows split the steps every paired run has; the
    last one takes the remainder. Empty when the runs have fewer steps than windows."""
    base = arms[0]
    paired = {arm: [s for s in range(seeds) if _key(arm, s) in runs and _key(base, s) in runs] for arm in arms[1:]}
    lengths = [len(runs[_key(a, s)]["train"]) for arm, ss in paired.items() for s in ss for a in (arm, base)]
    if not lengths or min(lengths) < windows:
        return [], {}
    steps = min(lengths)
    starts = [w * (steps // windows) for w in range(windows)]
    bounds = list(zip(starts, starts[1:] + [steps]))

    def gap(arm: str, seed: int, lo: int, hi: int) -> float:
        return 100 * (sum(runs[_key(arm, seed)]["train"][lo:hi]) / sum(runs[_key(base, seed)]["train"][lo:hi]) - 1)

    return bounds, {
        arm: {s: [gap(arm, s, lo, hi) for lo, hi in bounds] for s in ss} for arm, ss in paired.items() if ss
    }


def _training_gaps(arms: List[str], runs: dict, seeds: int, windows: int = 10) -> List[str]:
    """The table of :func:`_gap_windows` per tenth of the run, mean over the paired seeds: how a gap grows through
    the run (each seed alone spreads as widely as its validation loss; the means show the trend)."""
    bounds, gaps = _gap_windows(arms, runs, seeds, windows)
    if not gaps:
        return []
    return [
        "",
        f"Training loss against `{arms[0]}`, per tenth of the first {bounds[-1][1]} steps, mean over the paired seeds (%):",
        "",
        "| arm | seeds | " + " | ".join(f"{lo + 1}-{hi}" for lo, hi in bounds) + " |",
        "|---|---|" + "---|" * windows,
        *(
            f"| `{arm}` | {len(per_seed)} | "
            + " | ".join(f"{statistics.mean(window):+.2f}" for window in zip(*per_seed.values()))
            + " |"
            for arm, per_seed in gaps.items()
        ),
    ]


def plot_training_gaps(path: str, arms: List[str], runs: dict, seeds: int, windows: int = 50) -> bool:
    """A PNG of each arm's training-loss gap to the baseline per window (every seed thin, the mean thick; the
    control grey): the picture of how a gap grows beside the control's drift. False when there is nothing to draw."""
    bounds, gaps = _gap_windows(arms, runs, seeds, windows)
    if not gaps:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    middle = [(lo + hi) / 2 for lo, hi in bounds]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for index, (arm, per_seed) in enumerate(gaps.items()):
        colour = "grey" if arm == CONTROL_ARM else f"C{index + (index >= 7)}"  # C7 is the default cycle's grey
        for values in per_seed.values():
            ax.plot(middle, values, color=colour, alpha=0.25, linewidth=0.8)
        mean = [statistics.mean(window) for window in zip(*per_seed.values())]
        ax.plot(middle, mean, color=colour, linewidth=2.2, label=f"{arm} (mean of {len(per_seed)} seeds)")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xlabel(f"step (the middle of each window of about {bounds[0][1] - bounds[0][0]} steps)")
    ax.set_ylabel(f"training loss vs {arms[0]} (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _control_interval(arms: List[str], runs: dict, seeds: int) -> Optional[Tuple[float, float, float, float]]:
    """(mean, sd, lower, upper) of the control arm's difference from the baseline (the first arm), when both have
    >= 2 seeds in common; else None."""
    base = arms[0]
    if CONTROL_ARM not in arms[1:]:
        return None
    paired = [s for s in range(seeds) if _key(CONTROL_ARM, s) in runs and _key(base, s) in runs]
    if len(paired) < 2:
        return None
    return paired_interval(
        [100 * (runs[_key(CONTROL_ARM, s)]["valid"] / runs[_key(base, s)]["valid"] - 1) for s in paired]
    )


def _verdict(goal: Optional[str], low: float, high: float, floor: Optional[Tuple[float, ...]]) -> str:
    """An arm against its goal (the upper end of its interval must stay under it): met; missed (its interval is
    all above the goal, or the control shows the set-up could resolve it); or not shown (the control's own
    interval reaches past the goal, so this set-up cannot tell)."""
    if goal is None or math.isnan(high):
        return "-"
    if high <= float(goal):
        return f"+{goal}%: met"
    if low <= float(goal) and floor is not None and floor[3] > float(goal):
        return f"+{goal}%: not shown (the control reaches {floor[3]:+.2f}%)"
    return f"+{goal}%: missed"


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-25m", choices=sorted(MODELS))
    parser.add_argument(
        "--arms",
        default="none;fp8-ash;fp4-ash;int4-ash;fp4-ash/fp8-ash",
        help="';'-separated; the first is the baseline",
    )
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--eval-iters", type=int, default=50)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=256,
        help="256: byte-level text; larger: a BPE vocabulary of that size trained on the training split (tokenizers)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument(
        "--backend", choices=("nccl", "gloo"), help="default: nccl on GPUs, gloo on CPU; gloo puts 2 ranks on one GPU"
    )
    parser.add_argument(
        "--tp-loopback", action="store_true", help="each run's two TP ranks computed in one process (1 GPU)"
    )
    parser.add_argument("--parallel", type=int, default=1, help="process pairs at a time")
    parser.add_argument(
        "--goal", action="append", default=[], help="ARM=PERCENT (e.g. fp8-ash=0.25): the upper end it must stay under"
    )
    parser.add_argument("--json", required=True, help="results so far (read to resume, rewritten after every run)")
    parser.add_argument("--report", help="markdown report (default: --json with .md)")
    parser.add_argument(
        "--plot", help="also draw the training-loss gaps per window into this PNG (needs matplotlib), with the report"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the report of --arms from --json; train nothing"
    )
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else __import__("sys").argv[1:]
    args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.warmup >= args.steps and not args.report_only:  # one line here, not a traceback from every run
        parser.error(
            f"--warmup {args.warmup} must be below --steps {args.steps} (the cosine decay follows the warm-up)"
        )
    if args.vocab_size != 256 and not 256 < args.vocab_size <= 65536:
        parser.error(f"--vocab-size {args.vocab_size}: expected 256 (bytes) or a BPE vocabulary of 257-65536 tokens")
    if args.vocab_size != 256 and importlib.util.find_spec("tokenizers") is None:
        parser.error(
            f"--vocab-size {args.vocab_size}: a BPE vocabulary needs the tokenizers package (pip install tokenizers)"
        )
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error(f"--plot {args.plot}: drawing needs the matplotlib package (pip install matplotlib)")
    if args.tp_loopback and args.backend:
        parser.error("--tp-loopback runs each run in one process: no --backend")
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if not args.tp_loopback and args.backend == "nccl" and (args.device != "cuda" or torch.cuda.device_count() < 2):
        parser.error(
            f"--backend nccl needs 2 GPUs for the pair's ranks ({torch.cuda.device_count()} found, --device "
            f"{args.device}); --tp-loopback computes both in one process on one GPU (--backend gloo: two, slowly)"
        )
    arms = args.arms.split(";")
    if CONTROL_ARM in arms and not args.tp_loopback:
        parser.error(f"--arms: {CONTROL_ARM!r} (TP=1's arithmetic as a noise-floor control) needs --tp-loopback")
    for arm in arms:
        try:
            first, switch = arm_phases(arm)
            for config in (first, switch and switch[1]):
                if config:  # an override's layers must exist in the model (else every run fails)
                    config.for_model(MODELS[args.model].num_layers)
            if switch is not None and switch[0] >= args.steps:
                raise ValueError(f"the switch after step {switch[0]} comes after the last step ({args.steps})")
        except ValueError as exc:
            parser.error(f"--arms: {arm!r}: {exc}")
    for goal in args.goal:
        arm, _, percent = goal.rpartition("=")  # an override arm holds "=" itself
        if arm not in arms or not re.fullmatch(r"\d+(\.\d+)?", percent):  # a percentage, e.g. 0.5
            parser.error(f"--goal {goal!r}: expected ARM=PERCENT with ARM one of {arms}")
    report_path = args.report or os.path.splitext(args.json)[0] + ".md"
    results = {"runs": {}}
    if os.path.exists(args.json):
        with open(args.json) as f:
            results = json.load(f)
        if results.get("setup") != _setup(args):
            raise SystemExit(f"{args.json} holds runs of another set-up ({results.get('setup')}); use another --json")
    if args.report_only:
        if not results["runs"]:
            raise SystemExit(f"--report-only: no runs in {args.json}")
        write_report(args, results, report_path)
        print(f"loss_compare: {report_path} rewritten from {len(results['runs'])} runs in {args.json}")
        return
    results.update(setup=_setup(args), date=datetime.date.today().isoformat(), commit=project_commit())
    results.update(command=_command(args), torch=torch.__version__)  # the last training command (not --report-only)
    results["hardware"] = (
        f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        if args.device == "cuda"
        else f"CPU ({os.cpu_count()} cores)"
    )

    def save():
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        write_report(args, results, report_path)

    if args.device == "cuda":  # CUDA is initialised here (the GPU's name), so ranks start fresh, not forked
        os.environ.setdefault("TACO_TEST_START_METHOD", "spawn")
    todo = [(arm, seed) for seed in range(args.seeds) for arm in arms if _key(arm, seed) not in results["runs"]]
    if todo and args.vocab_size != 256:
        cache_stdlib_text(args.vocab_size)
    print(f"loss_compare: {len(todo)} runs to train ({len(results['runs'])} already in {args.json})", flush=True)
    save()
    from concurrent.futures import ThreadPoolExecutor, as_completed

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = {
            pool.submit(
                run_distributed,
                _run,
                1 if args.tp_loopback else 2,
                args.model,
                arm,
                seed,
                args.steps,
                args.micro_batches,
                args.micro_batch_size,
                args.lr,
                args.warmup,
                args.eval_iters,
                args.dtype,
                args.tp_loopback,
                args.vocab_size,
                backend=args.backend,
                env=DETERMINISTIC_CUBLAS,
                timeout=24 * 3600,
            ): (arm, seed)
            for arm, seed in todo
        }
        failed = []
        for future in as_completed(futures):
            arm, seed = futures[future]
            try:
                results["runs"][_key(arm, seed)] = dict(
                    future.result()[0],
                    backend=_transport(args),
                    commit=results["commit"],
                    date=results["date"],
                    hardware=results["hardware"],
                )
            except Exception as exc:  # the other runs go on; this one is reported and left to a re-run
                print(f"  {_key(arm, seed)}: FAILED: {exc}", flush=True)
                failed.append(_key(arm, seed))
                continue
            run = results["runs"][_key(arm, seed)]
            print(f"  {_key(arm, seed)}: final train {run['train'][-1]:.4f} valid {run['valid']:.4f}", flush=True)
            save()
    print("\n".join(report(args, results)), flush=True)
    if failed:
        raise SystemExit(
            f"loss_compare: {len(failed)} runs failed ({', '.join(failed)}); the same command retries them"
        )


def _token_words(vocab_size: int) -> str:
    if vocab_size == 256:
        return "byte-level tokens"
    return f"tokens of a BPE vocabulary of {vocab_size} (tokenizers, trained on the training split)"


def _command(args) -> str:
    return f"python -m benchmarks.loss_compare {shlex.join(args.argv)}"


def _setup(args) -> dict:
    """What must match for runs to be compared (the arms and seeds may grow)."""
    keys = ("model", "steps", "micro_batches", "micro_batch_size", "lr", "warmup", "eval_iters", "dtype")
    setup = {k: getattr(args, k) for k in keys}
    if args.tp_loopback:  # (files of real TP=2 runs keep their set-up)
        setup["tp_loopback"] = True
    if args.vocab_size != 256:  # (files of byte-level runs keep their set-up)
        setup["vocab_size"] = args.vocab_size
    return setup


def _transport(args) -> str:
    """How this command's runs connect their two TP ranks (``--tp-loopback`` is part of the set-up)."""
    if args.tp_loopback:
        return "computed in one process per run (`--tp-loopback`, benchmarks/tp_loopback.py)"
    return f"over {args.backend}"


def _transports(args, results: dict) -> str:
    """The transports of the runs so far (a resumed file may hold NCCL and gloo runs: the same arithmetic)."""
    return " / ".join(sorted({run.get("backend", _transport(args)) for run in results["runs"].values()})) or (
        _transport(args)
    )


if __name__ == "__main__":
    main()
