"""Acceptance on real Megatron-LM: its own pretrain_gpt.py with TACO, through the launcher and the patch.

    python -m benchmarks.megatron_lm_check --megatron-lm /path/to/Megatron-LM [--rows NAME,... | --suite S]
        [--megatron-lm-016 /path/to/Megatron-LM-core_v0.16.1] [--json results.json] [--report results.md]

from the repository root, or ``bash scripts/megatron_lm_check.sh /path/to/Megatron-LM [flags]``, which runs this
file by path: there megatron_taco must be importable (``pip install -e .`` or the repository on PYTHONPATH).

Every row is one ``torchrun --nproc-per-node 2`` (4 for ``--suite four-gpu``) run of Megatron-LM's ``pretrain_gpt.py`` with
``--mock-data`` (TP=2 + sequence parallelism, or PP=2 with 4 micro-batches per step for the MAPL rows;
``--suite four-gpu``: PP=2 x DP=2 with the distributed optimizer, 4 ranks;
8 layers, hidden 2048, sequence 2048, micro-batch 4):
through ``python -m megatron_taco.launch`` or through a copy of the checkout patched by
``scripts/apply_patch.sh``. A row's speed is the median of Megatron-LM's own "elapsed time per
iteration" over the log intervals after the first (warm-up) one; with ``repeats`` > 1 it is the median
over runs, taken in A-B-A order with its baseline. Its ratio is against the matching uncompressed run
(``--taco-mode none``, same implementation, precision, model and link) of the same invocation.
Rows accumulate in the JSON file across invocations (each call of the device machine is limited to
10 minutes); the report is rewritten from all rows each time.
Link regimes (``LINK_REGIMES`` in megatron_taco/testing/distributed.py): ``nvlink`` (default NCCL
transports) and ``socket`` (``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo``); and ``one-gpu``
(``--suite one-gpu``) for a machine with one GPU: both ranks on it, ``--distributed-backend gloo``
(megatron_taco/testing/one_gpu/sitecustomize.py says how). It runs the same code paths (Megatron-LM's, TE's, TACO's
kernels and hooks) and checks start-up, telemetry and losses; its speed is gloo's through the host, so those rows
get no ratio. On the GPU machine (TE from ``../shared/tools/te_kit.py``'s folder, a Megatron-LM tree carried along):

    bash .te/install.sh && export PYTHONPATH=/tmp/site:$PWD
    python3 benchmarks/megatron_lm_check.py --megatron-lm DIR --suite one-gpu \
        --json $OUT/megatron_lm_one_gpu.json --report $OUT/megatron_lm_one_gpu.md   # ~1-2 min a row
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

from megatron_taco.testing.distributed import LINK_REGIMES, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_GPU = "one-gpu"  # the link of rows with both ranks on one GPU over gloo: the code paths and losses, not the speed
ONE_GPU_SITE = os.path.join(ROOT, "megatron_taco", "testing", "one_gpu")

MODELS = {
    "gpt": [
        "--num-layers",
        "8",
        "--hidden-size",
        "2048",
        "--num-attention-heads",
        "16",
        "--max-position-embeddings",
        "2048",
    ],
    "qwen": [
        "--num-layers",
        "8",
        "--hidden-size",
        "2048",
        "--num-attention-heads",
        "16",
        "--ffn-hidden-size",
        "5504",
        "--group-query-attention",
        "--num-query-groups",
        "4",
        "--add-qkv-bias",
        "--disable-bias-linear",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--position-embedding-type",
        "rope",
        "--untie-embeddings-and-output-weights",
        "--max-position-embeddings",
        "2048",
    ],
}
COMMON = [
    "--seq-length",
    "2048",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "32000",
    "--lr",
    "1e-4",
    "--min-lr",
    "1e-5",
    "--lr-decay-style",
    "constant",
    "--bf16",
    "--log-interval",
    "5",
    "--eval-iters",
    "0",
    "--eval-interval",
    "100000",
    "--seed",
    "1234",
    "--distributed-backend",
    "nccl",
    "--taco-log-interval",
    "5",
]
IMPLS = {  # without apex: no gradient-accumulation fusion (the output layer is megatron-core's), local fusions off
    "local": [
        "--transformer-impl",
        "local",
        "--no-gradient-accumulation-fusion",
        "--no-persist-layer-norm",
        "--no-masked-softmax-fusion",
        "--no-rope-fusion",
    ],
    "te": ["--transformer-impl", "transformer_engine", "--no-gradient-accumulation-fusion"],
}
PRECISIONS = {
    "bf16": [],
    "fp8": ["--fp8-format", "hybrid", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max"],
}


MAPL = {
    "none": [],
    "1": ["--mapl-ratio", "1"],
    "8": ["--mapl-ratio", "8"],
    "8-vq": ["--mapl-ratio", "8", "--mapl-vq-levels", "2"],
    "8-fixed": ["--mapl-ratio", "8", "--mapl-fixed-projection"],
    "8-topk": ["--mapl-ratio", "8", "--mapl-wire", "topk"],
    "8-fp8": ["--mapl-ratio", "8", "--mapl-wire", "fp8"],
    "8-int5": ["--mapl-ratio", "8", "--mapl-wire", "int5"],
    "8-bf16": ["--mapl-ratio", "8", "--mapl-wire", "bf16"],
    # the warm-up into the bottleneck: iterations 0-14 send h_rec + alpha (h - h_rec) d wide, then z on the wire
    "8-warm15": ["--mapl-ratio", "8", "--mapl-warmup-steps", "15"],
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One Megatron-LM run configuration; ``baseline`` is the row it is compared with."""

    name: str
    model: str = "gpt"
    impl: str = "te"
    precision: str = "bf16"
    taco: str = "none"
    link: str = "socket"
    path: str = "launcher"  # launcher | patch
    release: str = "0.19"  # 0.19: --megatron-lm; 0.16: --megatron-lm-016
    repeats: int = 1
    iters: int = 20
    pipeline: int = 1  # 1: TP=2 + SP; 2: PP=2 (TP=1, 4 micro-batches per step)
    # 2: PP=2 x DP=2 on 4 GPUs with --use-distributed-optimizer, --overlap-grad-reduce and --overlap-param-gather
    data_parallel: int = 1
    resume: bool = False  # stop at half the iterations with --save, then --load and finish (MAPL state restored?)
    # a resume row whose first half saves with this MAPL variant: the load must stop with the resume check's one
    # line (megatron_taco.mapl.megatron_lm.check_checkpoint_args), and that is the row passing
    saved_mapl: str = ""
    mapl: str = (
        "none"  # none | 1 (--mapl-ratio 1: lossless, checks the plumbing) | 8 | 8-vq (--mapl-vq-levels 2) | 8-fixed
        # | 8-topk (--mapl-wire topk) | 8-fp8 (--mapl-wire fp8) | 8-int5 (--mapl-wire int5) | 8-bf16 (--mapl-wire bf16)
        # | 8-warm15 (--mapl-warmup-steps 15);
        # "8" takes the default wire (auto: with --bf16 the wire of most rank, int5 at hidden 2048; rows of "8" ran
        # fp8 from 2026-12-06 until auto chose int5 (9910965, 2026-12-07), bf16 before)
    )

    def __post_init__(self) -> None:
        for flag, variant in (("mapl", self.mapl), ("saved_mapl", self.saved_mapl or "none")):
            if variant not in MAPL:
                raise ValueError(f"{self.name}: {flag} {variant!r} is not one of {sorted(MAPL)}")
        if self.saved_mapl and not self.resume:
            raise ValueError(f"{self.name}: saved_mapl needs resume=True (it is the saving half's MAPL variant)")

    @property
    def baseline(self) -> Optional[str]:
        if self.taco == "none" and self.mapl == "none" and self.path == "launcher":
            return None
        return _name(
            self.link,
            self.model,
            self.impl,
            self.precision,
            "none",
            pipeline=self.pipeline,
            release=self.release,
            data_parallel=self.data_parallel,
        )


def _name(
    link,
    model,
    impl,
    precision,
    taco,
    pipeline=1,
    mapl="none",
    resume=False,
    saved_mapl="",
    path="launcher",
    release="0.19",
    data_parallel=1,
) -> str:
    return (
        f"{link}-{model}-{impl}-{precision}-{taco}"
        + (f"-pp{pipeline}" if pipeline > 1 else "")
        + (f"-dp{data_parallel}-distopt" if data_parallel > 1 else "")
        + (f"-mapl{mapl}" if mapl != "none" else "")
        + ("-resume" if resume else "")
        + (f"-from-mapl{saved_mapl}" if saved_mapl else "")
        + ("-patch" if path == "patch" else "")
        + ("-016" if release == "0.16" else "")
    )


def _row(link, model, impl, precision, taco, **kw) -> Row:
    naming = {
        k: v
        for k, v in kw.items()
        if k in ("pipeline", "mapl", "resume", "saved_mapl", "path", "release", "data_parallel")
    }
    return Row(_name(link, model, impl, precision, taco, **naming), model, impl, precision, taco, link, **kw)


ROWS = [
    # sockets, GPT, TP=2 + SP: local and TE layers, bf16 and TE FP8 training, none / fp8 / fp8-ash
    _row("socket", "gpt", "local", "bf16", "none"),
    _row("socket", "gpt", "local", "bf16", "fp8-ash"),
    _row("socket", "gpt", "te", "bf16", "none", repeats=3),
    _row("socket", "gpt", "te", "bf16", "fp8-ash", repeats=3),
    _row("socket", "gpt", "te", "bf16", "fp8"),
    _row("socket", "gpt", "te", "fp8", "none", repeats=3),
    _row("socket", "gpt", "te", "fp8", "fp8-ash", repeats=3),
    # the patch path (its baseline: the launcher's uncompressed run; the hooks are the same)
    _row("socket", "gpt", "te", "bf16", "fp8-ash", path="patch"),
    _row("socket", "gpt", "local", "bf16", "fp8-ash", path="patch"),
    # Qwen-style: RMSNorm, SwiGLU, RoPE, GQA, qkv bias, untied embeddings
    _row("socket", "qwen", "te", "bf16", "none"),
    _row("socket", "qwen", "te", "bf16", "fp8-ash"),
    # NVLink with --taco-min-bytes auto (the link probe should switch compression off)
    _row("nvlink", "gpt", "local", "bf16", "none", repeats=3),
    _row("nvlink", "gpt", "local", "bf16", "fp8-ash", repeats=3),
    _row("nvlink", "gpt", "te", "bf16", "none", repeats=3),
    _row("nvlink", "gpt", "te", "bf16", "fp8-ash", repeats=3),
    # Megatron-LM core_v0.16.1
    _row("socket", "gpt", "local", "bf16", "none", release="0.16"),
    _row("socket", "gpt", "local", "bf16", "fp8-ash", release="0.16"),
    _row("socket", "gpt", "local", "bf16", "fp8-ash", release="0.16", path="patch"),
    # 4-bit wire formats (G=128, fp32 scales: 3.76x on the wire), and 4-bit forward with FP8 gradients
    _row("socket", "gpt", "local", "bf16", "fp4-ash"),
    _row("socket", "gpt", "te", "bf16", "fp4-ash", repeats=3),
    _row("socket", "gpt", "te", "bf16", "int4-ash"),
    _row("socket", "gpt", "te", "bf16", "fp4-ash-fp8bwd"),
    _row("socket", "gpt", "te", "fp8", "fp4-ash", repeats=3),
    # INT4 forward with FP8 gradients, and the same with the first and last layers at FP8: the lowest measured 4-bit
    # loss gap (loss_compare_gpt25m_bpe8192.md); against TE FP8 training, the bar a Megatron-LM user compares with
    _row("socket", "gpt", "te", "bf16", "int4-ash-fp8bwd", repeats=3),
    _row("socket", "gpt", "te", "bf16", "int4-ash-edges", repeats=3),
    _row("socket", "gpt", "te", "fp8", "int4-ash-edges", repeats=3),
    # INT4 forward without the Hadamard, INT8 gradients, the first and last layers at INT8: the lowest measured 4-bit
    # loss gap since 2026-12-05 (+0.28% [-0.04%, +0.60%], 20 seeds), its kernels at copy speed (kernels.md)
    _row("socket", "gpt", "te", "bf16", "int4-int8-edges", repeats=3),
    _row("socket", "gpt", "te", "fp8", "int4-int8-edges", repeats=3),
    # --taco-switch on the real training loop: INT4 forward until iteration 10 of 20, then FP8 (the log says when)
    _row("socket", "gpt", "te", "bf16", "int4-ash-switch"),
    # INT8 at FP8's bytes, the configs' mode: the lowest measured 8-bit loss gap (loss_compare_gpt25m_bpe8192.md,
    # loss_compare_qwen25m_bpe8192.md), with bf16 and TE FP8
    _row("socket", "gpt", "te", "bf16", "int8", repeats=3),
    _row("socket", "gpt", "te", "fp8", "int8", repeats=3),
    _row("socket", "qwen", "te", "bf16", "int8"),
    # PP=2: MAPL at the stage boundary (TP=1), Megatron-LM's own 1F1B schedule
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, repeats=3),
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, mapl="1"),  # r = d: the loss must match uncompressed
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, mapl="8", repeats=3),
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, mapl="8-vq"),
    # the sparse wire: U d x d, each token's k largest values of z in FP8 and their positions, both ways
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, mapl="8-topk", repeats=3),
    # the dense FP8 wire: z and dL/dz as TACO FP8 messages at twice the rank, the same bytes as mapl8
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, mapl="8-fp8", repeats=3),
    # the 5-bit wire: 1.5x the FP8 wire's rank at no more bytes (a lead: 16x -0.87% against FP8, 5 seeds)
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, mapl="8-int5", repeats=3),
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, mapl="8-bf16", repeats=3),  # the default before auto
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, mapl="8-warm15"),  # d wide for 15 of the 20 iterations
    # diagnostic: a fixed U and no anchors have no replica sync (where does the time go?)
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, mapl="8-fixed"),
    # 10 iterations, save (torch_dist), load, 10 more: the loss should follow the uninterrupted mapl8 row
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, mapl="8", resume=True),
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, mapl="8", path="patch"),
    _row("socket", "qwen", "te", "bf16", "none", pipeline=2),
    _row("socket", "qwen", "te", "bf16", "none", pipeline=2, mapl="8"),
    _row("nvlink", "gpt", "te", "bf16", "none", pipeline=2),
    _row("nvlink", "gpt", "te", "bf16", "none", pipeline=2, mapl="8"),
    _row("socket", "gpt", "local", "bf16", "none", pipeline=2, release="0.16"),
    _row("socket", "gpt", "local", "bf16", "none", pipeline=2, mapl="8", release="0.16"),
    # 4 GPUs, PP=2 x DP=2, the distributed optimizer with overlapped gradient reduce and parameter gather: MAPL at
    # r = d must train as uncompressed (its anchors' gradient shards gathered over DP, tests/test_megatron_lm_mapl.py
    # on CPU), and at 8x
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, data_parallel=2),
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, data_parallel=2, mapl="1"),
    _row("socket", "gpt", "te", "bf16", "none", pipeline=2, data_parallel=2, mapl="8"),
    # one GPU, both ranks on it over gloo: the user's paths run and train (losses, start-up lines), no speed
    _row(ONE_GPU, "gpt", "te", "bf16", "none"),
    _row(ONE_GPU, "gpt", "te", "bf16", "int8"),
    _row(ONE_GPU, "gpt", "te", "bf16", "int8", path="patch"),
    _row(ONE_GPU, "gpt", "local", "bf16", "none"),
    _row(ONE_GPU, "gpt", "local", "bf16", "int8"),
    _row(ONE_GPU, "gpt", "te", "fp8", "none"),
    _row(ONE_GPU, "gpt", "te", "fp8", "int8"),
    # INT4 forward under TE FP8 training: TACO takes TE's FP8 all-gathers (4-bit is fewer bytes), TE's quantizer casts
    _row(ONE_GPU, "gpt", "te", "fp8", "int4-ash-edges"),
    _row(ONE_GPU, "gpt", "te", "fp8", "int4-int8-edges"),
    _row(ONE_GPU, "qwen", "te", "bf16", "none"),
    _row(ONE_GPU, "qwen", "te", "bf16", "int8"),
    # PP=2 and MAPL: gloo sends CUDA tensors point to point only through the shim's host buffers (the first try,
    # without them, failed with "writev ... Bad address"; the buffers are tested on CPU, not yet run on a GPU)
    _row(ONE_GPU, "gpt", "te", "bf16", "none", pipeline=2),
    _row(ONE_GPU, "gpt", "te", "bf16", "none", pipeline=2, mapl="8"),
    _row(ONE_GPU, "gpt", "te", "bf16", "none", pipeline=2, mapl="8-topk"),
    _row(ONE_GPU, "gpt", "te", "bf16", "none", pipeline=2, mapl="8-fp8"),
    _row(ONE_GPU, "gpt", "te", "bf16", "none", pipeline=2, mapl="8-int5"),
    # save at iteration 10, load, 10 more, at the default wire; and a checkpoint of the bf16 wire (the default before
    # 2026-12-06) loaded by a run of the default wire: the load stops with one line naming the flags it was saved with
    _row(ONE_GPU, "gpt", "te", "bf16", "none", pipeline=2, mapl="8", resume=True),
    _row(ONE_GPU, "gpt", "te", "bf16", "none", pipeline=2, mapl="8", resume=True, saved_mapl="8-bf16"),
    # the warm-up: d wide until iteration 15 of 20 (the log says when it ends), and resumed at 10, inside it
    _row(ONE_GPU, "gpt", "te", "bf16", "none", pipeline=2, mapl="8-warm15"),
    _row(ONE_GPU, "gpt", "te", "bf16", "none", pipeline=2, mapl="8-warm15", resume=True),
]
SUITES = {
    "smoke": [
        "socket-gpt-local-bf16-none",
        "socket-gpt-local-bf16-fp8-ash",
        "socket-gpt-te-bf16-none",
        "socket-gpt-te-bf16-fp8-ash",
        "socket-gpt-te-bf16-int8",
    ],
    "mapl-smoke": [
        "socket-gpt-te-bf16-none-pp2",
        "socket-gpt-te-bf16-none-pp2-mapl8",
        "socket-gpt-te-bf16-none-pp2-mapl8-topk",
        "socket-gpt-te-bf16-none-pp2-mapl8-fp8",
        "socket-gpt-te-bf16-none-pp2-mapl8-int5",
        "socket-gpt-te-bf16-none-pp2-mapl8-bf16",
    ],
    "four-bit": [
        "socket-gpt-te-bf16-none",
        "socket-gpt-te-bf16-fp4-ash",
        "socket-gpt-te-bf16-int4-ash",
        "socket-gpt-te-bf16-fp4-ash-fp8bwd",
        "socket-gpt-te-fp8-none",
        "socket-gpt-te-fp8-fp4-ash",
        "socket-gpt-te-bf16-int4-ash-fp8bwd",
        "socket-gpt-te-bf16-int4-ash-edges",
        "socket-gpt-te-fp8-int4-ash-edges",
        "socket-gpt-te-bf16-int4-int8-edges",
        "socket-gpt-te-fp8-int4-int8-edges",
        "socket-gpt-te-bf16-int4-ash-switch",
    ],
    "int8": [
        "socket-gpt-te-bf16-none",
        "socket-gpt-te-bf16-fp8-ash",
        "socket-gpt-te-bf16-int8",
        "socket-gpt-te-fp8-none",
        "socket-gpt-te-fp8-int8",
        "socket-qwen-te-bf16-none",
        "socket-qwen-te-bf16-int8",
    ],
    ONE_GPU: [row.name for row in ROWS if row.link == ONE_GPU],
    "four-gpu": [row.name for row in ROWS if row.data_parallel > 1],
    "all": [row.name for row in ROWS if row.link != ONE_GPU and row.data_parallel == 1],
}
PARALLEL = {
    1: [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "4",
    ],
    2: ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "4", "--global-batch-size", "16"],
}
DATA_PARALLEL = {  # on top of PARALLEL: the same 4 micro-batches per rank and step
    1: [],
    2: ["--global-batch-size", "32", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
}
# TACO settings by row name: a --taco-mode, a 4-bit forward with FP8 gradients, that with the edge layers at FP8,
# that switched to FP8 after iteration 10, and INT4 forward with INT8 gradients and edge layers
TACO = {mode: ["--taco-mode", mode] for mode in ("none", "fp8", "fp8-ash", "int8", "fp4-ash", "int4-ash")}
TACO["fp4-ash-fp8bwd"] = ["--taco-mode", "fp4-ash", "--taco-bwd-mode", "fp8-ash"]
TACO["int4-ash-fp8bwd"] = ["--taco-mode", "int4-ash", "--taco-bwd-mode", "fp8-ash"]
TACO["int4-ash-edges"] = TACO["int4-ash-fp8bwd"] + ["--taco-override", "1,last:mode=fp8-ash"]
TACO["int4-ash-switch"] = TACO["int4-ash-fp8bwd"] + ["--taco-switch", "10:mode=fp8-ash"]
TACO["int4-int8-edges"] = ["--taco-mode", "int4", "--taco-bwd-mode", "int8", "--taco-override", "1,last:mode=int8"]


def _patched_copy(checkout: str, work: str) -> str:
    """A copy of the checkout with scripts/apply_patch.sh applied (made once per invocation)."""
    dest = os.path.join(work, "patched-" + os.path.basename(os.path.abspath(checkout)))
    if not os.path.isdir(dest):
        shutil.copytree(checkout, dest, symlinks=True)
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "apply_patch.sh"), dest], check=True)
    return dest


def command(row: Row, checkout: str, port: int, mapl: Optional[str] = None) -> List[str]:
    """The row's torchrun command line (``mapl``: another MAPL variant than the row's)."""
    script = os.path.join(checkout, "pretrain_gpt.py")
    entry = ["-m", "megatron_taco.launch", script] if row.path == "launcher" else [script]
    flags = [
        *MODELS[row.model],
        *PARALLEL[row.pipeline],
        *DATA_PARALLEL[row.data_parallel],  # a later --global-batch-size wins in argparse
        *COMMON,
        *IMPLS[row.impl],
        *PRECISIONS[row.precision],
        "--train-iters",
        str(row.iters),
        *TACO[row.taco],
        *MAPL[mapl or row.mapl],
    ]
    if row.link == ONE_GPU:
        flags[flags.index("--distributed-backend") + 1] = "gloo"
    return torchrun(port, *entry, *flags, ranks=2 * row.data_parallel)


def torchrun(port: int, *args: str, ranks: int = 2) -> List[str]:
    """``torchrun`` of ``ranks`` ranks on this host with the rendezvous port chosen before the fork."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(port), *args
    ]  # fmt: skip


_ITER_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([\d.]+)")
_ITER_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([\d.E+-]+)")


WARMUP_ITERS = 5  # Megatron-LM's logs at iterations 1 and 5 include start-up work (allocator, NCCL, autotuning)


def steady_ms_per_iter(intervals: List[List[float]]) -> Optional[float]:
    """Median of the logged per-interval ms/iteration after the warm-up iterations."""
    steady = [ms for iteration, ms in intervals if iteration > WARMUP_ITERS]
    return statistics.median(steady) if steady else None


def parse_log(text: str) -> Dict:
    """What a Megatron-LM log says: per-interval ms/iter, final loss, TACO's start-up and telemetry lines."""
    intervals = [[int(it), float(ms)] for it, ms in _ITER_MS.findall(text)]
    losses = [[int(it), float(loss)] for it, loss in _ITER_LOSS.findall(text)]
    lines = text.splitlines()

    def last(prefix):
        found = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in lines if prefix in line]
        return found[-1] if found else None

    return {
        "intervals": intervals,
        "ms_per_iter": steady_ms_per_iter(intervals),
        "final_loss": losses[-1][1] if losses else None,
        "losses": losses,
        "telemetry": last("taco total:"),
        "attached": last("megatron_taco: TACO"),
        "mapl_attached": last("megatron_taco: MAPL ("),
        "mapl_warmup": last("megatron_taco: MAPL warm-up over"),
        "mapl_telemetry": last("mapl total over"),
        "link_policy": last("--taco-min-bytes auto:"),
        "megatron": last("megatron_taco: megatron-core"),
    }


def run_row(row: Row, checkouts: Dict[str, str], work: str, log_dir: str, attempt: int) -> Dict:
    checkout = checkouts[row.release]
    if row.path == "patch":
        checkout = _patched_copy(checkout, work)
    port = free_port()  # chosen before the fork, one per run
    one_gpu = row.link == ONE_GPU
    env = {
        **os.environ,
        **({"MEGATRON_TACO_ONE_GPU": "1"} if one_gpu else LINK_REGIMES[row.link]),
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join(
            p for p in (ONE_GPU_SITE if one_gpu else None, ROOT, os.environ.get("PYTHONPATH")) if p
        ),
    }
    start = time.time()
    commands = [command(row, checkout, port)]
    if row.resume:  # the first half saves (with the row's saved_mapl where it has one), the second loads
        save = os.path.join(work, f"{row.name}.{attempt}.ckpt")
        commands = [
            [
                *command(row, checkout, port, mapl=row.saved_mapl),
                *("--save", save, "--save-interval", str(row.iters // 2), "--exit-interval", str(row.iters // 2)),
            ]
        ]
    proc = subprocess.run(commands[0], env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    if row.resume and proc.returncode == 0:  # a fresh port for the second half
        commands.append([*command(row, checkout, free_port()), "--load", save])
        proc = subprocess.run(commands[1], env=env, capture_output=True, text=True, timeout=600)
        log += proc.stdout + proc.stderr
    with open(os.path.join(log_dir, f"{row.name}.{attempt}.log"), "w") as f:
        f.write("".join(" ".join(c) + "\n" for c in commands) + log)
    result = {
        "row": dataclasses.asdict(row),
        "attempt": attempt,
        "returncode": proc.returncode,
        "wall_s": round(time.time() - start, 1),
        **parse_log(log),
        **judge(row, proc.returncode, log, loaded=len(commands) == 2),
    }
    if result.get("stop_line") and result["passed"]:
        status = f"the load stopped as it should: {result['stop_line']}"
    elif result["ms_per_iter"] and result["passed"]:
        status = f"{result['ms_per_iter']:.1f} ms/iter"
    else:
        status = f"FAILED: {result.get('error')}"
    print(
        f"[{datetime.datetime.now():%H:%M:%S}] {row.name} (run {attempt}): {status}, loss {result['final_loss']}, "
        f"{result['wall_s']} s",
        flush=True,
    )
    return result


STOP_LINE = "its MAPL boundaries were saved with"  # the resume check's line (mapl.megatron_lm.check_checkpoint_args)


def judge(row: Row, returncode: int, log: str, loaded: bool) -> Dict:
    """Whether a run did what its row asks: exit 0; for a ``saved_mapl`` row, a load (``loaded``: the saving half
    exited 0) that stopped with the resume check's line. The first error line when it did not."""
    errors = [line for line in log.splitlines() if re.search(r"^(\[rank\d+\]: )?(\w+Error: |error: )", line)]
    verdict: Dict = {"passed": returncode == 0}
    if row.saved_mapl:
        stops = [line for line in errors if STOP_LINE in line]
        verdict = {"passed": loaded and returncode != 0 and bool(stops), "stop_line": stops[0] if stops else None}
    if not verdict["passed"]:
        verdict["error"] = errors[0][-300:] if errors else log[-300:]
    return verdict


def _passed(result: Dict) -> bool:
    """Whether a run did what its row asks (results of before 2026-12-06 have no "passed": their return code)."""
    return result.get("passed", result["returncode"] == 0)


def _schedule(rows: List[Row]) -> List[Row]:
    """Runs in A-B-A order: each repeat of a compared row follows a repeat of its baseline."""
    order: List[Row] = []
    for attempt in range(max(row.repeats for row in rows)):
        order += [row for row in rows if attempt < row.repeats]
    return order


def summarise(results: List[Dict]) -> Dict[str, Dict]:
    """Per row: the runs' medians, their median, the ratio against its baseline."""
    by_row: Dict[str, Dict] = {}
    for result in results:
        entry = by_row.setdefault(result["row"]["name"], {"row": result["row"], "runs": []})
        entry["runs"].append(result)
    for entry in by_row.values():
        speeds = [r["ms_per_iter"] for r in entry["runs"] if r["ms_per_iter"]]
        entry["ms_per_iter"] = statistics.median(speeds) if speeds else None
    for name, entry in by_row.items():
        base = by_row.get(Row(**entry["row"]).baseline or "")
        if base and entry["row"]["link"] != ONE_GPU and base["ms_per_iter"] and entry["ms_per_iter"]:
            entry["ratio"] = base["ms_per_iter"] / entry["ms_per_iter"]
    return by_row


# The goals: (description, row, compared with, bound); speed ratio = ms(compared with) / ms(row)
GOALS = [
    ("sockets, local layers: TACO fp8-ash >= 1.6x", "socket-gpt-local-bf16-fp8-ash", "socket-gpt-local-bf16-none", 1.6),
    ("sockets, TE layers: TACO fp8-ash >= 1.6x", "socket-gpt-te-bf16-fp8-ash", "socket-gpt-te-bf16-none", 1.6),
    (
        "TE bf16 + TACO faster than TE FP8 training alone (> 1.0x)",
        "socket-gpt-te-bf16-fp8-ash",
        "socket-gpt-te-fp8-none",
        1.0,
    ),
    ("TE FP8 + TACO >= 1.2x over TE FP8 alone", "socket-gpt-te-fp8-fp8-ash", "socket-gpt-te-fp8-none", 1.2),
    (
        "NVLink, --taco-min-bytes auto (the probe turns compression off): >= 0.97x",
        "nvlink-gpt-local-bf16-fp8-ash",
        "nvlink-gpt-local-bf16-none",
        0.97,
    ),
    (
        "PP=2 sockets: MAPL 8x >= 1.5x over uncompressed PP=2",
        "socket-gpt-te-bf16-none-pp2-mapl8",
        "socket-gpt-te-bf16-none-pp2",
        1.5,
    ),
]


def goal_lines(rows: Dict[str, Dict]) -> List[str]:
    out = ["| goal | measured | runs (row / compared with) | met |", "|---|---|---|---|"]
    for text, name, base, bound in GOALS:
        if rows.get(name, {}).get("ms_per_iter") and rows.get(base, {}).get("ms_per_iter"):
            ratio = rows[base]["ms_per_iter"] / rows[name]["ms_per_iter"]
            runs = f"{len(rows[name]['runs'])} / {len(rows[base]['runs'])}"
            out.append(f"| {text} | {ratio:.2f}x | {runs} | {'yes' if ratio >= bound else 'no'} |")
        else:
            out.append(f"| {text} | not run | - | - |")
    return out


def write_report(results: List[Dict], path: str, meta: Dict) -> None:
    rows = summarise(results)
    out = [
        "# Megatron-LM acceptance: real pretrain_gpt.py with TACO and MAPL",
        "",
        f"Written by `benchmarks/megatron_lm_check.py` ({meta['command']}); project commit {meta['commit']}; "
        f"{meta['hardware']}; {meta['versions']}; {meta['date']}.",
        "",
        "TP=2 + SP (micro-batch 4 = 8192 tokens/iteration) or, for the `pp2` rows, PP=2 with TP=1 (4 micro-batches "
        "of 4 per iteration = 32768 tokens/iteration; the `dp2` rows: PP=2 x DP=2 on 4 GPUs with the distributed "
        "optimizer, 65536 tokens/iteration); 8 layers, hidden 2048, sequence 2048, `--mock-data`, "
        "20 iterations, bf16 parameters. ms/iter: median of Megatron-LM's logged per-interval times for iterations "
        f"{WARMUP_ITERS + 1}-20 (log interval 5), then the median over runs where runs > 1 (A-B-A order with the "
        "baseline). Ratio: tokens/s against the uncompressed run of the same implementation, precision, model, "
        "release, parallel layout and link (its `none` row).",
        "",
    ]
    if any(entry["row"]["link"] == ONE_GPU for entry in rows.values()):
        out += [
            f"`{ONE_GPU}` rows: both ranks on one GPU, `--distributed-backend gloo` (megatron_taco/testing/one_gpu/"
            "sitecustomize.py): Megatron-LM's, TE's and TACO's code on the GPU, where only one GPU was lent. gloo "
            "carries every message through the host, so their ms/iter is no speed a user would see and they get no "
            "ratio; they show that the run trains, what TACO attached (start-up lines), its telemetry and the loss "
            "beside the `none` row's.",
            "",
        ]
    out += [
        "| row | path | Megatron-LM | model | layers | precision | link | parallel | TACO | MAPL | runs | ms/iter | "
        "ratio | final loss | telemetry |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in rows.items():
        row = entry["row"]
        failed = [r for r in entry["runs"] if not _passed(r)]
        speed = f"{entry['ms_per_iter']:.1f}" if entry["ms_per_iter"] else "failed"
        if row.get("resume"):  # two runs with a checkpoint between: the loss is the point, not the speed
            speed = "-" if len(failed) < len(entry["runs"]) else "failed"
        runs = ", ".join(f"{r['ms_per_iter']:.0f}" if r["ms_per_iter"] else "x" for r in entry["runs"])
        pipeline, mapl = row.get("pipeline", 1), row.get("mapl", "none")
        compressed = row["taco"] != "none" or mapl != "none"
        ratio = (
            f"{entry['ratio']:.2f}x"
            if "ratio" in entry and not row.get("resume")
            else ("n/a" if compressed and not row.get("resume") and row["link"] != ONE_GPU else "-")
        )
        losses = [r["final_loss"] for r in entry["runs"] if r["final_loss"] is not None]
        telemetry = (entry["runs"][-1].get("telemetry") or "").replace("taco total: ", "")
        telemetry = telemetry.split(";")[0] if telemetry else "-"
        if mapl != "none":
            mapl_line = entry["runs"][-1].get("mapl_telemetry") or ""
            telemetry = mapl_line.split(": ", 1)[-1].split(";")[0] if mapl_line else "-"
        if row.get("saved_mapl"):  # the loss and traffic logged are the saving half's: the load is meant to stop
            runs, losses, telemetry = "-", [], f"saved with {row['saved_mapl']}, then the load (see below)"
        layout = "TP=2+SP" if pipeline == 1 else f"PP={pipeline}"
        layout += f" x DP={row['data_parallel']} (distributed optimizer)" if row.get("data_parallel", 1) > 1 else ""
        out.append(
            f"| {name} | {row['path']} | {row['release']} | {row['model']} | {row['impl']} | "
            f"{row['precision']} | {row['link']} | {layout} | {row['taco']} | {mapl} | {runs} | {speed} | "
            f"{ratio} | {losses[-1] if losses else '-'} | {telemetry} |"
        )
        for r in failed:
            out.append(f"|  | ↳ run {r['attempt']} failed: `{r.get('error', '')[:200]}` |||||||||||||")
        for r in entry["runs"]:
            if r.get("stop_line") and _passed(r):
                out.append(
                    f"|  | ↳ run {r['attempt']}: the load stopped as it should: `{r['stop_line']}` |||||||||||||"
                )
    if any(entry["row"]["link"] != ONE_GPU for entry in rows.values()):
        out += ["", "## Goals", ""] + goal_lines(rows)
    notes = os.path.splitext(path)[0] + "_notes.md"
    if os.path.exists(notes):  # what the numbers mean, written by hand after a run
        out += ["", open(notes).read().strip()]
    policies = sorted({r["link_policy"] for r in results if r.get("link_policy")})
    if policies:
        out += ["", "Link policy decisions (`--taco-min-bytes auto`, printed by rank 0):", ""]
        out += [f"- `{p}`" for p in policies]
    attached = sorted({r[key] for r in results for key in ("attached", "mapl_attached", "mapl_warmup") if r.get(key)})
    if attached:
        out += ["", "Start-up lines:", ""] + [f"- `{a}`" for a in attached]
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def _meta(args) -> Dict:
    def sh(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, shell=True, cwd=ROOT).stdout.strip()
        except OSError:
            return "?"

    versions = sh(
        f"{sys.executable} -c \"import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)\""
    )
    te = sh(
        f"{sys.executable} -c \"import transformer_engine; print('TE', transformer_engine.__version__)\" 2>/dev/null"
    )
    return {
        "command": "python benchmarks/megatron_lm_check.py " + " ".join(args),
        "commit": os.environ.get("PROJECT_COMMIT") or sh("git rev-parse --short HEAD") or "?",
        "hardware": sh("nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs"),
        "versions": f"{versions}, {te or 'no TE'}, Python {sys.version.split()[0]}",
        "date": f"{datetime.datetime.now():%Y-%m-%d}",
    }


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-lm", required=True, help="Megatron-LM checkout (core_r0.19.x)")
    parser.add_argument("--megatron-lm-016", help="Megatron-LM core_v0.16.1 checkout (its rows are skipped without)")
    parser.add_argument("--rows", help="comma-separated row names (see --list)")
    parser.add_argument("--suite", default="all", choices=sorted(SUITES))
    parser.add_argument("--repeats", type=int, help="override every row's number of runs")
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "megatron_lm.json"))
    parser.add_argument("--report", default=os.path.join(ROOT, "benchmarks", "results", "megatron_lm.md"))
    parser.add_argument("--logs", default="megatron_lm_logs", help="folder for the runs' full logs")
    parser.add_argument("--stop-on-failure", action="store_true", help="stop after the first run that fails")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the JSON file")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    by_name = {row.name: row for row in ROWS}
    if args.list:
        print("\n".join(f"{row.name}  (baseline: {row.baseline or '-'}, runs {row.repeats})" for row in ROWS))
        return
    if args.report_only:
        saved = json.load(open(args.json))
        write_report(saved["results"], args.report, saved["meta"])
        return
    names = args.rows.split(",") if args.rows else SUITES[args.suite]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"error: --rows: unknown {unknown}; see --list")
    checkouts = {"0.19": args.megatron_lm, "0.16": args.megatron_lm_016}
    for name, checkout in checkouts.items():
        if checkout and not os.path.isfile(os.path.join(checkout, "pretrain_gpt.py")):
            raise SystemExit(f"error: {checkout} has no pretrain_gpt.py (a Megatron-LM checkout is needed)")
    rows = [by_name[n] for n in names if checkouts[by_name[n].release]]
    import torch

    short = [r.name for r in rows if r.link != ONE_GPU and 2 * r.data_parallel > torch.cuda.device_count()]
    if short:
        raise SystemExit(
            f"error: {', '.join(short)} need {max(2 * by_name[n].data_parallel for n in short)} GPUs; this machine "
            f"has {torch.cuda.device_count()} (--suite one-gpu runs on one)"
        )
    if args.repeats:
        rows = [dataclasses.replace(row, repeats=args.repeats) for row in rows]
    os.makedirs(args.logs, exist_ok=True)
    work = os.path.abspath(os.path.join(args.logs, "checkouts"))
    os.makedirs(work, exist_ok=True)
    results = json.load(open(args.json))["results"] if os.path.exists(args.json) else []
    attempts: Dict[str, int] = {}
    for row in _schedule(rows):
        attempts[row.name] = attempts.get(row.name, sum(r["row"]["name"] == row.name for r in results)) + 1
        results.append(run_row(row, checkouts, work, args.logs, attempts[row.name]))
        meta = _meta(argv)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        write_report(results, args.report, meta)
        if args.stop_on_failure and not _passed(results[-1]):
            raise SystemExit(f"error: {row.name} failed: {results[-1].get('error')}")


if __name__ == "__main__":
    main()
