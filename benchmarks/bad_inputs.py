"""Bad inputs a new user would try, through the entry points the README shows: each must end in one line.

    python -m benchmarks.bad_inputs [--out benchmarks/results/bad_inputs.md] [--only SUBSTRING]

Every case runs as its own process from a scratch folder: the trainer through ``scripts/run.sh`` (2 ranks
for the TP=2 config), the Megatron-LM launcher on the stand-in script that calls Megatron-LM's own parser
and model builder (``tests/standin/pretrain_standin.py``, megatron-core 0.19 wheel), and
``scripts/apply_patch.sh``. A case passes when the exit code is non-zero, stderr is exactly one line starting
with ``error:`` (or ``usage:``) and nothing anywhere says ``Traceback``. The report lists every case with its
line; CPU is enough (about 15 s a trainer case).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
from typing import List, Optional

from benchmarks.provenance import project_commit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_SH = os.path.join(ROOT, "scripts", "run.sh")
STANDIN = os.path.join(ROOT, "tests", "standin", "pretrain_standin.py")
STANDIN_MODEL = [
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
]


@dataclasses.dataclass(frozen=True)
class Case:
    what: str  # what the user did wrong
    argv: List[str]  # after the entry point
    entry: str = "trainer"  # trainer | launcher | patch
    files: tuple = ()  # (name, text) written into the scratch folder first
    before: tuple = ()  # trainer arguments of a run that must succeed there first (a checkpoint to load)


def _cases() -> List[Case]:
    tiny, qwen = "configs/gpt-tiny.yaml", "configs/qwen-tiny.yaml"
    pp2 = [tiny, "--tensor-model-parallel-size", "1", "--no-sequence-parallel", "--pipeline-model-parallel-size", "2"]
    trainer = [
        ("zero micro-batch", [tiny, "--micro-batch-size", "0"]),
        ("zero log interval", [tiny, "--log-interval", "0"]),
        ("zero iterations", [tiny, "--train-iters", "0"]),
        ("negative iterations", [tiny, "--train-iters", "-5"]),
        ("global batch not a multiple of the micro-batches", [tiny, "--global-batch-size", "6"]),
        ("TP that does not divide the ranks", [tiny, "--tensor-model-parallel-size", "3"]),
        ("zero PP", [tiny, "--pipeline-model-parallel-size", "0"]),
        ("unknown TACO mode", [tiny, "--taco-mode", "int2"]),
        ("TACO layers past the model", [tiny, "--taco-layers", "2-99"]),
        ("unknown linear", [tiny, "--taco-linears", "fc3"]),
        ("TE backend without a GPU", [tiny, "--taco-backend", "te", "--taco-mode", "fp8-ash"]),
        ("TE backend with the config's INT8", [tiny, "--taco-backend", "te"]),
        ("TE backend with a 4-bit mode", [tiny, "--taco-backend", "te", "--taco-mode", "fp4-ash"]),
        ("Triton backend without a GPU", [tiny, "--taco-backend", "triton"]),
        ("unsupported group size", [tiny, "--taco-group-size", "100"]),
        ("unreadable byte size", [tiny, "--taco-min-bytes", "lots"]),
        ("MAPL without a pipeline", [tiny, "--mapl-ratio", "4"]),
        ("MAPL setting without MAPL", [tiny, "--mapl-anchor-rank", "8"]),
        ("MAPL ratio that does not divide the hidden size", [*pp2, "--mapl-ratio", "3"]),
        ("VQ with one code", [*pp2, "--mapl-ratio", "4", "--mapl-vq-codes", "1"]),
        ("one width per boundary, too many given", [*pp2, "--mapl-ranks", "8,8"]),
        (
            "position anchors on a RoPE model",
            [
                qwen,
                "--tensor-model-parallel-size",
                "1",
                "--no-sequence-parallel",
                "--pipeline-model-parallel-size",
                "2",
                "--mapl-ratio",
                "4",
                "--mapl-position-anchors",
                "on",
            ],
        ),
        ("SP without TP", [tiny, "--tensor-model-parallel-size", "1", "--sequence-parallel"]),
        ("virtual pipeline without a pipeline", [tiny, "--virtual-pipeline-model-parallel-size", "2"]),
        ("negative learning rate", [tiny, "--lr", "-1"]),
        ("min lr above lr", [tiny, "--min-lr", "1"]),
        ("negative warm-up", [tiny, "--lr-warmup-iters", "-1"]),
        (
            "decay shorter than the warm-up",
            [tiny, "--lr-decay-style", "linear", "--lr-decay-iters", "5", "--lr-warmup-iters", "10"],
        ),
        ("bf16 on CPU", [tiny, "--dtype", "bf16"]),
        ("unknown dtype", [tiny, "--dtype", "fp64"]),
        ("data folder that does not exist", [tiny, "--data", "no/such/folder"]),
        ("load from a folder without a checkpoint", [tiny, "--load", "."]),
        ("negative eval iterations", [tiny, "--eval-iters", "-1"]),
        ("negative save interval", [tiny, "--save-interval", "-1"]),
        ("misspelt flag", [tiny, "--micro-batchsize", "4"]),
        ("word for a number", [tiny, "--micro-batch-size", "two"]),
        ("config that does not exist", ["no_such_config.yaml"]),
    ]
    cases = [Case(what, argv) for what, argv in trainer]
    cases += [
        Case("config that is not YAML", ["broken.yaml"], files=(("broken.yaml", "model: [unclosed\n"),)),
        Case(
            "config with an unknown section",
            ["extra.yaml"],
            files=(("extra.yaml", open(os.path.join(ROOT, "configs", "gpt-tiny.yaml")).read() + "optimizer: {}\n"),),
        ),
        Case(
            "config with an unknown model key",
            ["typo.yaml"],
            files=(
                (
                    "typo.yaml",
                    open(os.path.join(ROOT, "configs", "gpt-tiny.yaml"))
                    .read()
                    .replace("model:", "model:\n  hidden_sise: 64", 1),
                ),
            ),
        ),
        Case("config that is a list", ["list.yaml"], files=(("list.yaml", "- 1\n- 2\n"),)),
    ]
    saved = (tiny, "--train-iters", "2", "--save", "ckpt")  # a TP=2 + SP checkpoint at step 2
    cases += [
        Case(
            "load a checkpoint already at --train-iters", [tiny, "--train-iters", "2", "--load", "ckpt"], before=saved
        ),
        Case(
            "load a checkpoint of another parallel layout",
            [*pp2, "--taco-mode", "none", "--train-iters", "4", "--load", "ckpt"],
            before=saved,
        ),
    ]
    if importlib.util.find_spec("tensorboard") is None:  # a mistake only where the package is missing
        cases.append(Case("TensorBoard folder without the tensorboard package", [tiny, "--tensorboard-dir", "tb"]))
    launcher = [
        ("launcher: unknown TACO mode", ["--taco-mode", "int2"]),
        ("launcher: misspelt Megatron-LM flag", ["--num-layer", "3"]),
        ("launcher: word for a number", ["--num-layers", "two"]),
        ("launcher: TACO with TE's userbuffers", ["--taco-mode", "fp8", "--tp-comm-overlap"]),
        ("launcher: TACO without tensor parallelism", ["--taco-mode", "int8"]),
        ("launcher: TACO with CUDA graphs", ["--taco-mode", "int8", "--cuda-graph-impl", "local"]),
        ("launcher: TACO layers past the model", ["--taco-mode", "fp8", "--taco-layers", "2-9"]),
        ("launcher: MAPL without a pipeline", ["--mapl-ratio", "8"]),
        ("launcher: MAPL setting without MAPL", ["--mapl-vq-levels", "2"]),
    ]
    cases += [Case(what, argv, entry="launcher") for what, argv in launcher]
    cases += [
        Case("launcher: script that does not exist", ["no_such_script.py"], entry="launcher-script"),
        Case("patch: a folder that is not Megatron-LM", ["."], entry="patch"),
    ]
    return cases


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# with --megatron-lm: Megatron-LM's own pretrain_gpt.py in place of the stand-in (the errors come at parse time,
# before anything needs a GPU)
MEGATRON_LM_MODEL = [
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
    "--micro-batch-size",
    "1",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "128",
    "--train-iters",
    "2",
]


def run_case(case: Case, megatron_lm: Optional[str] = None) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        for name, text in case.files:
            with open(os.path.join(scratch, name), "w") as f:
                f.write(text)
        env = {
            **os.environ,
            "PYTHON": sys.executable,
            "PYTHONWARNINGS": "ignore",
            "OMP_NUM_THREADS": "1",
            "TORCHRUN_ARGS": f"--master-port {_port()}",
        }  # chosen before the fork
        env.pop("TRITON_INTERPRET", None)  # a user's shell: no interpreter for Triton
        if case.before:
            subprocess.run(["bash", RUN_SH, *case.before], cwd=scratch, env=env, capture_output=True, check=True)
            env["TORCHRUN_ARGS"] = f"--master-port {_port()}"
        if case.entry == "trainer":
            cmd = ["bash", RUN_SH, *case.argv]
        elif case.entry == "launcher" and megatron_lm:
            script = os.path.join(os.path.abspath(megatron_lm), "pretrain_gpt.py")
            cmd = [sys.executable, "-m", "megatron_taco.launch", script, *MEGATRON_LM_MODEL, *case.argv]
            env["PYTHONPATH"] = ROOT
        elif case.entry == "launcher":
            cmd = [
                sys.executable,
                "-m",
                "megatron_taco.launch",
                STANDIN,
                *STANDIN_MODEL,
                "--standin-out",
                os.path.join(scratch, "out.json"),
                *case.argv,
            ]
            env["PYTHONPATH"] = ROOT
        elif case.entry == "launcher-script":
            cmd = [sys.executable, "-m", "megatron_taco.launch", *case.argv]
            env["PYTHONPATH"] = ROOT
        else:
            cmd = ["bash", os.path.join(ROOT, "scripts", "apply_patch.sh"), *case.argv]
        proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    one_line = len(lines) == 1 and lines[0].startswith(("error:", "usage:"))
    ok = proc.returncode != 0 and one_line and "Traceback" not in proc.stdout + proc.stderr
    shown = " ".join(case.argv)
    return {
        "what": case.what,
        "entry": case.entry,
        "argv": shown,
        "rc": proc.returncode,
        "ok": ok,
        "line": lines[0] if len(lines) == 1 else f"{len(lines)} lines: " + " / ".join(lines[:3])[:300],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bad_inputs.md"))
    parser.add_argument("--only", help="run the cases whose description contains this")
    parser.add_argument("--megatron-lm", help="a Megatron-LM checkout: launcher cases run its pretrain_gpt.py")
    args = parser.parse_args()
    cases = [c for c in _cases() if not args.only or args.only in c.what]
    results = []
    for case in cases:
        results.append(run_case(case, args.megatron_lm))
        r = results[-1]
        print(f"{'ok  ' if r['ok'] else 'FAIL'} rc={r['rc']} {r['what']}: {r['line']}", flush=True)
    passed = sum(r["ok"] for r in results)
    out = [
        "# Bad inputs: one line each",
        "",
        f"Written by `{' '.join(['python -m benchmarks.bad_inputs', *sys.argv[1:]])}` on {datetime.date.today()}; "
        f"commit {project_commit()}; CPU "
        f"({os.cpu_count()} cores), Python {sys.version.split()[0]}. Each case runs as a user would, from an empty "
        "folder: the trainer through `scripts/run.sh` (2 ranks for the TP=2 configs), the Megatron-LM launcher "
        + (
            f"on Megatron-LM's own `pretrain_gpt.py` ({args.megatron_lm}), "
            if args.megatron_lm
            else "on the stand-in script that calls Megatron-LM's parser and model builder, "
        )
        + "`scripts/apply_patch.sh`. "
        "Passes: non-zero exit, exactly one line on stderr (`error: ...`), no traceback anywhere.",
        "",
        f"**{passed} of {len(results)} cases pass.**",
        "",
        "| # | what | entry | arguments | exit | the line | ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(results, 1):
        line = r["line"].replace("|", "\\|")
        out.append(
            f"| {i} | {r['what']} | {r['entry']} | `{r['argv']}` | {r['rc']} | {line} | "
            f"{'yes' if r['ok'] else '**no**'} |"
        )
    with open(args.out, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"{passed} of {len(results)} cases pass; wrote {args.out}")


if __name__ == "__main__":
    main()
