"""Break the code once, see the tests fail: each mutation is applied to a file, the tests that guard it run,
the file is restored. Writes benchmarks/results/mutations.md.

    python -m benchmarks.mutations [--out benchmarks/results/mutations.md] [--only SUBSTRING]

Run from the repository root with the test environment (``.venv-mcore-0.19.2``, CPU; about 3 minutes). A row passes
when at least one test fails under its mutation.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

from .provenance import project_commit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALE_BIAS = [  # the codec's stored scale 0.39% too large, in the reference and in the kernel alike
    (
        "megatron_taco/codec/reference.py",
        "        s_q = torch.where(nonfinite, nan, s_q)\n",
        "        s_q = torch.where(nonfinite, nan, s_q) * 1.0039\n",
    ),
    (
        "megatron_taco/codec/kernels.py",
        '        s_q = tl.where(nonfinite, float("nan"), s_q)\n',
        '        s_q = tl.where(nonfinite, float("nan"), s_q) * 1.0039\n',
    ),
]

# Mutations these CPU runs cannot see, checked on a GPU instead (their logs name the command and the result)
GPU_ONLY = (
    "Not in the table: INT8's second store of zeros over a non-finite group's codes, turned off, leaves the CPU tests "
    "passing (the interpreter's NaN has a zero low byte already; a GPU's 0x7FFFFFFF has 0xFF): compiled on the H200 "
    "10 of 10 byte tests of `tests/test_codec_int8.py` fail with it, 10 pass without it "
    "(`logs/mutation_int8_nonfinite_gpu_2026-12-04.log`, 2026-12-04)."
)

MUTATIONS = [  # (what, file, text, replaced by, tests, -k) or file None: SCALE_BIAS
    (
        "top-k wire picks the largest signed values, not magnitudes",
        "megatron_taco/codec/topk.py",
        "index = rows.abs().topk(self.k, dim=-1).indices.sort(-1).values",
        "index = rows.topk(self.k, dim=-1).indices.sort(-1).values",
        "tests/test_codec_topk.py",
        "",
    ),
    (
        "top-k wire: the receiver sends back the whole gradient's top k, not the coordinates that arrived",
        "megatron_taco/mapl/stage.py",
        "                    received = TopKCodec.support_only(received)\n",
        "                    pass\n",
        "tests/test_mapl_loopback.py",
        "pp2",
    ),
    (
        "4-bit nibbles packed high/low swapped (kernel)",
        "megatron_taco/codec/kernels.py",
        "v = tl.reshape(lo + (hi << 4), (BLOCK_G, G // 4, 2))",
        "v = tl.reshape(hi + (lo << 4), (BLOCK_G, G // 4, 2))",
        "tests/test_codec_4bit.py",
        "",
    ),
    (
        "E2M1 0.5 coded as 0 (reference)",
        "megatron_taco/codec/reference.py",
        "torch.where(magnitude == 0.5, torch.ones_like(bits), torch.zeros_like(bits)),",
        "torch.zeros_like(bits),",
        "tests/test_codec_4bit.py",
        "",
    ),
    (
        "INT4 ties rounded half-up, not to even (reference)",
        "megatron_taco/codec/reference.py",
        "n = torch.round(a.double() * b.double())",
        "n = torch.floor(a.double() * b.double() + 0.5)",
        "tests/test_codec_4bit.py",
        "",
    ),
    (
        "stochastic rounding's noise fixed at 0.5 (reference)",
        "megatron_taco/codec/reference.py",
        "_stochastic_magnitude(q.abs(), noise, fmt)",
        "_stochastic_magnitude(q.abs(), noise * 0 + 0.5, fmt)",
        "tests/test_codec_4bit.py",
        "",
    ),
    (
        "noise hash constant off by one (kernel)",
        "megatron_taco/codec/kernels.py",
        "    x = (x * 0x846CA68B) & 0xFFFFFFFF",
        "    x = (x * 0x846CA68A) & 0xFFFFFFFF",
        "tests/test_kernels.py",  # the stochastic-rounding byte tests (kernel against reference) live there
        "stochastic",
    ),
    (
        "a thread's elements taken at the stride of the group's threads (kernel tile)",
        "megatron_taco/codec/kernels.py",
        "    t = tl.arange(0, THREADS)[:, None, None, None] * (K * W)\n    k = tl.arange(0, K)[None, None, :, None] * W",
        "    t = tl.arange(0, THREADS)[:, None, None, None] * W\n    k = tl.arange(0, K)[None, None, :, None] * (THREADS * W)",
        "tests/test_kernels.py",
        "launch_shape",
    ),
    (
        "E2M1 codes from 1 up one too large (kernel)",
        "megatron_taco/codec/kernels.py",
        "    normal = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252",
        "    normal = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 251",
        "tests/test_codec_4bit.py",
        "",
    ),
    (
        "e4m3 message scale over M x 440 (kernel)",
        "megatron_taco/codec/kernels.py",
        "tl.math.div_rn(floored_row, FP8_MAX * 448.0)",
        "tl.math.div_rn(floored_row, FP8_MAX * 440.0)",
        "tests/test_codec_4bit.py",
        "",
    ),
    (
        "overrides skip the start-up checks",
        "megatron_taco/config/taco.py",
        '    _check_combinations(settings, f" (in {flag} {text!r})")\n',
        "",
        "tests/test_codec_4bit.py",
        "",
    ),
    (
        "layers outside --taco-layers keep their gradient mode",
        "megatron_taco/config/taco.py",
        'mode="none", bwd_mode=None)',
        'mode="none")',
        "tests/test_taco_megatron.py",
        "every_linear",
    ),
    (
        "--taco-stochastic-rounding not passed to the gradient codecs",
        "megatron_taco/megatron/attach.py",
        "rounding=rounding,",
        'rounding="nearest",',
        "tests/test_taco_megatron.py",
        "every_linear",
    ),
    (
        "MAPL gradient sums not run after finalize_model_grads",
        "megatron_taco/mapl/megatron_lm.py",
        '            _STATE["sync"].finalize_grads(kwargs.get("num_tokens", args[1] if len(args) > 1 else None))',
        "            pass",
        "tests/test_megatron_lm_mapl.py",
        "",
    ),
    (
        "tokens not handed to every stage",
        "megatron_taco/mapl/megatron_lm.py",
        '            bound.arguments["mtp_on_this_rank"] = True',
        "            pass",
        "tests/test_megatron_lm_mapl.py",
        "",
    ),
    (
        "start_mapl not run before the optimizer",
        "megatron_taco/mapl/megatron_lm.py",
        'if cfg is not None and _STATE["sync"] is None:',
        "if False:",
        "tests/test_megatron_lm_mapl.py",
        "",
    ),
    (
        "schedule sees d-wide buffers",
        "megatron_taco/mapl/megatron_lm.py",
        "            views, extra = schedule_inputs(chunks, cfg, warming)",
        "            views, extra = chunks, {}",
        "tests/test_megatron_lm_mapl.py",
        "",
    ),
    (
        "the warm-up's sender leaves out MAPL's wire round trip",
        "megatron_taco/mapl/stage.py",
        "arrived = z if self.send.wire is None else WireRoundTrip.apply(z, self.send.wire, self.send.wire)",
        "arrived = z",
        "tests/test_mapl_loopback.py",
        "leak",
    ),
    (
        "the warm-up's receiver leaves its anchors out of megatron-core DDP's hooks",
        "megatron_taco/mapl/stage.py",
        "hidden = self._received + self._touch_anchors(tokens, positions, previous)",
        "hidden = self._received",
        "tests/test_megatron_lm_mapl.py",
        "warm_up",
    ),
    (
        "the pair sums U's gradient in U's column-major layout where a replica has none",
        "megatron_taco/mapl/stage.py",
        "grad = (torch.zeros_like(boundary.projection) if grad is None else grad).contiguous()",
        "grad = torch.zeros_like(boundary.projection) if grad is None else grad.contiguous()",
        "tests/test_megatron_lm_mapl.py",
        "warm_up",
    ),
    (
        "interleaved chunks not counted at parse time",
        "megatron_taco/mapl/megatron_lm.py",
        "def _model_chunks(args: argparse.Namespace) -> Optional[int]:\n",
        "def _model_chunks(args: argparse.Namespace) -> Optional[int]:\n    return None\n",
        "tests/test_megatron_lm_mapl.py",
        "",
    ),
    (
        "U's momentum not a checkpointed buffer",
        "megatron_taco/mapl/boundary.py",
        '            self.register_buffer("projection_momentum", torch.zeros_like(projection, requires_grad=False))',
        "            self.projection_momentum = torch.zeros_like(projection, requires_grad=False)",
        "tests/test_megatron_lm_mapl.py",
        "",
    ),
    (
        "launcher argparse errors print argparse's usage block",
        "megatron_taco/launch.py",
        "        with _one_line_parse_errors():\n            args = original_parse(",
        "        with contextlib.nullcontext():\n            args = original_parse(",
        "tests/test_launch.py",
        "rejects_bad_flags",
    ),
    (
        "telemetry's error samples share the codec's call count",
        "megatron_taco/megatron/telemetry.py",
        "probe = copy.copy(codec)",
        "probe = codec",
        "tests/test_codec_4bit.py",
        "telemetry",
    ),
    (
        "--load from a smaller world: no check for this rank's file",
        "megatron_taco/training/checkpoint.py",
        "    if not os.path.exists(file):",
        "    if False:",
        "tests/test_entry_points.py",
        "smaller_world",
    ),
    (
        "--load of another layout: no layout check",
        "megatron_taco/training/checkpoint.py",
        '    if "layout" in state and state["layout"] != _layout(trainer.cfg):',
        "    if False:",
        "tests/test_entry_points.py",
        "pp2_with_mapl",
    ),
    (
        "MAPL warm-up with --mapl-ranks: d-wide messages still exchange shapes",
        "megatron_taco/mapl/stage.py",
        "    return (not cfg.uniform and not warming) or",
        "    return (not cfg.uniform) or",
        "tests/test_mapl.py",
        "own_rank",
    ),
    (
        "MAPL warm-up on the INT5 wire sent in the pipeline dtype",
        "megatron_taco/mapl/stage.py",
        "    codec = warm_up_wire_codec(cfg, width) if warming else wire_codec(cfg, widths[0])",
        "    codec = None if warming else wire_codec(cfg, widths[0])",
        "tests/test_megatron_lm_mapl.py",
        "warm_up_on_the_int5",
    ),
    (
        "--data checked only when read",
        "megatron_taco/training/cli.py",
        '    if args.data != "synthetic":\n',
        "    if False:\n",
        "tests/test_cli_errors.py",
        "",
    ),
    (
        "--taco-layers checked only at model build",
        "megatron_taco/training/loop.py",
        "            self.taco.for_model(self.shape.num_layers)",
        "            pass",
        "tests/test_cli_errors.py",
        "",
    ),
    (
        "a module without __all__",
        "megatron_taco/mapl/wire.py",
        '__all__ = [\n    "CodecWireCommunicator",\n    "IndexWireCommunicator",\n    "WireRoundTrip",\n'
        '    "compression_ratio",\n    "describe_compression",\n    "fp8_wire_codec",\n    "round_trip",\n'
        '    "warm_up_wire_codec",\n    "wire_codec",\n]\n',
        "",
        "tests/test_style.py",
        "",
    ),
    (
        "fp8-ash runs without the Hadamard",
        "megatron_taco/config/taco.py",
        'return "ash" if self.mode_for(direction).endswith("-ash") else "none"',
        'return "none"',
        "tests/test_taco_megatron.py",
        "every_linear",
    ),
    (
        "E5M2 in place of E4M3 (--taco-fp8-format ignored)",
        "megatron_taco/config/taco.py",
        'return _MODE_FORMATS.get(mode.split("-")[0], self.fmt)',
        'return _MODE_FORMATS.get(mode.split("-")[0], "e5m2")',
        "tests/test_taco_megatron.py",
        "every_linear",
    ),
    (
        "TacoCodec() defaults to E5M2: collective errors double (bounds at 1.3x of measured)",
        "megatron_taco/codec/taco.py",
        '        fmt: str = "e4m3",\n',
        '        fmt: str = "e5m2",\n',
        "tests/test_comm.py",
        "float64_model",
    ),
    (
        "chunked reduce-scatter sends its first piece every time (pipelined path, CPU)",
        "megatron_taco/comm/collectives.py",
        "messages = codec.compress_rows(chunks[:, start * row_numel : end * row_numel])",
        "messages = codec.compress_rows(chunks[:, : (end - start) * row_numel])",
        "tests/test_comm.py",
        "chunked",
    ),
    (
        "test inputs seeded with Python's salted hash()",
        "tests/test_codec.py",
        "manual_seed(zlib.crc32(repr((dist, group, fmt, transform, scales)).encode()))",
        "manual_seed(hash((dist, group, fmt, transform, scales)) % 2**31)",
        "tests/test_style.py",
        "hash",
    ),
    (
        "--tensorboard-dir checked only by rank 0 at its writer",
        "megatron_taco/training/cli.py",
        "        _check_tensorboard()\n",
        "        pass\n",
        "tests/test_cli_errors.py",
        "tensorboard",
    ),
    (
        "--load's layout checked only after the model build",
        "megatron_taco/training/cli.py",
        "        check_saved_layout(load, step, cfg, world_size)\n",
        "        pass\n",
        "tests/test_entry_points.py",
        "pp2_with_mapl",
    ),
    (
        "INT8 codes decoded without sign extension (kernel)",
        "megatron_taco/codec/kernels.py",
        "            y = codes.to(tl.int8, bitcast=True).to(tl.float32)",
        "            y = codes.to(tl.float32)",
        "tests/test_codec_int8.py",
        "",
    ),
    (
        "INT8 rounding bias off by one (kernel)",
        "megatron_taco/codec/kernels.py",
        "INT8_BIAS = tl.constexpr(12582912.0)",
        "INT8_BIAS = tl.constexpr(12582913.0)",
        "tests/test_codec_int8.py",
        "",
    ),
    (
        "INT8 grid up to 128, whose code wraps to -128 (format: reference and kernel)",
        "megatron_taco/codec/format.py",
        '"int8": ElementFormat("int8", None, 127.0,',
        '"int8": ElementFormat("int8", None, 128.0,',
        "tests/test_codec_int8.py",
        "",
    ),
    (
        "codec scale 0.39% too large (reference and kernel)",
        None,
        None,
        None,
        "tests/test_codec.py tests/test_kernels.py tests/test_codec_4bit.py",
        "",
    ),
]


def run(mutation) -> str:
    """The last line of pytest's summary for the tests under this mutation."""
    what, path, text, replacement, tests, select = mutation
    edits = [(path, text, replacement)] if path else SCALE_BIAS
    saved = {}
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    try:
        for file, old, new in edits:
            source = open(os.path.join(ROOT, file)).read()
            if old not in source:
                raise SystemExit(f"error: mutation {what!r}: {file} no longer holds the text it changes")
            saved[file] = source
            with open(os.path.join(ROOT, file), "w") as f:
                f.write(source.replace(old, new, 1))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests.split()]
        cmd += ["-k", select] if select else []
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        return done.stdout.strip().splitlines()[-1]
    finally:
        for file, source in saved.items():
            with open(os.path.join(ROOT, file), "w") as f:
                f.write(source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "mutations.md"))
    parser.add_argument("--only", help="run the mutations whose description contains this")
    args = parser.parse_args()
    commit = project_commit()
    rows = []
    for mutation in [m for m in MUTATIONS if not args.only or args.only in m[0]]:
        summary = run(mutation)
        rows.append((mutation, summary))
        print(f"{mutation[0]}: {summary}", flush=True)
    caught = sum(" failed" in summary for _, summary in rows)
    out = [
        "# Mutations: the tests fail when the code they guard is broken",
        "",
        f"Written by `{' '.join(['python -m benchmarks.mutations', *sys.argv[1:]])}` on {datetime.date.today()}; commit "
        f"{commit}; CPU, "
        f"Python {sys.version.split()[0]}. Each row changes one piece of the code, runs the tests that guard it "
        "and restores the file.",
        "",
        f"**{caught} of {len(rows)} mutations make tests fail.**",
        "",
        "| mutation | file | tests | pytest says | caught |",
        "|---|---|---|---|---|",
    ]
    for (what, path, _, _, tests, select), summary in rows:
        where = path or "codec/reference.py + codec/kernels.py"
        tests = tests + (f" -k {select}" if select else "")
        out.append(f"| {what} | `{where}` | `{tests}` | {summary} | {'yes' if ' failed' in summary else '**no**'} |")
    out += ["", GPU_ONLY]
    with open(args.out, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"{caught} of {len(rows)} caught; wrote {args.out}")


if __name__ == "__main__":
    main()
