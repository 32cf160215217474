"""Compile the TACO kernels for sm_90 on a CPU machine and count their SASS: instructions per element, registers,
shared-memory and local-memory traffic. Usage, from the repository root (a triton with its nvidia backend):

    python benchmarks/results/logs/kernels_exploration_2026-12-01/sass_counts.py [KERNELS_FILE|- [WARPSxPER_THREAD]]

KERNELS_FILE: another version of megatron_taco/codec/kernels.py to load in its place (e.g. `git show REV:...`; the
kernels before 88ae99a, whose launch is (elements per program, warps), work too); WARPSxPER_THREAD: one launch shape
for both kernels instead of the file's LAUNCH_CONFIG. Another triton: put its unpacked wheel first on PYTHONPATH (the
GPU machine has 3.6.0). Pointers and sizes get the 16-divisibility a real launch specialises (else loads compile to
scalars). SASS from nvdisasm, registers from cuobjdump, both shipped in triton/backends/nvidia/bin.
compile_counts.py beside it counts the PTX with the same helpers.
"""

import collections
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_taco.codec import TacoCodec

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# the runtime arguments of the two kernels (constexprs are added from the launch constants)
COMPRESS_SIGNATURE = {"x_ptr": "*bf16", "out_ptr": "*u8", "x_row_stride": "i64", "out_row_stride": "i64",
                      "numel": "i32", "n_groups": "i32", "scales_offset": "i32", "head0": "i32", "head1": "i32",
                      "head2": "i32", "head3": "i32", "eps": "fp32", "seed": "i32", "row_amax_ptr": "*fp32"}
DECOMPRESS_SIGNATURE = {"bufs_ptr": "*u8", "out_ptr": "*bf16", "n_bufs": "i32", "buf_stride": "i64",
                        "out_row_stride": "i64", "numel": "i32", "n_groups": "i32", "scales_offset": "i32"}
CASES = [("e4m3", "ash", "fp32", 128), ("e4m3", "none", "fp32", 128), ("int4", "ash", "fp32", 128),
         ("e2m1", "ash", "e8m0", 32), ("e2m1", "ash", "e4m3", 16)]


def load_kernels(path):
    """The kernels module at ``path`` ("-" or None: the repository's)."""
    path = path if path and path != "-" else "megatron_taco/codec/kernels.py"
    spec = importlib.util.spec_from_file_location("kernels_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_sm90(fn, signature, constants, n_divisible):
    """Compile ``fn`` for sm_90 with its launch constants; the first ``n_divisible`` arguments 16-divisible."""
    constants = dict(constants)
    num_warps = constants.pop("num_warps")
    constants.pop("enable_fp_fusion")
    signature = dict(signature, **{k: "constexpr" for k in constants})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(n_divisible)}
    src = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, enable_fp_fusion=False))


def _summary(kernel, per_thread):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass))
    total = sum(n for op, n in ops.items() if op != "NOP")
    memory = {op: n for op, n in ops.items() if op in ("STS", "LDS", "LDSM", "BAR", "STL", "LDL", "SHFL")}
    registers = re.search(r"REG:(\d+)", usage).group(1)
    return f"SASS {total} ({total / per_thread:.1f} per element) regs={registers} {memory}"


def _per_thread(constants, launch):
    """Elements per thread: G / THREADS, or (kernels before 88ae99a) elements per program / threads per program."""
    if "THREADS" in constants:
        return constants["G"] // constants["THREADS"]
    return launch[0] / (32 * launch[1])


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else None
    K = load_kernels(path)
    shape = tuple(int(v) for v in sys.argv[2].split("x")) if len(sys.argv) > 2 else None
    takes_dtype = len(inspect.signature(K._compress_constants).parameters) == 4  # the input's bits (88ae99a on)
    print(f"# triton {triton.__version__}, sm_90, {os.path.basename(path or 'kernels.py')}, launch {shape or K.LAUNCH_CONFIG}")
    for fmt, transform, scales, g in CASES:
        st = TacoCodec(g, fmt, transform, scales, backend="torch").settings
        launch = shape or K.LAUNCH_CONFIG["compress"]
        consts = K._compress_constants(st, launch, True, *([16] if takes_dtype else []))
        params = inspect.signature(K._compress_kernel.fn).parameters
        consts.update({k: True for k in ("X_WORDS", "CODE_WORDS") if k in params})  # aligned rows (the benchmark's)
        kernel = compile_sm90(K._compress_kernel, COMPRESS_SIGNATURE, consts, 7)
        print(f"compress   {fmt} {transform} {scales} G={g}: {_summary(kernel, _per_thread(consts, launch))}")
        launch = shape or K.LAUNCH_CONFIG["decompress_sum"]
        consts = K._decompress_constants(st, launch, True, torch.bfloat16)
        if "CODE_WORDS" in inspect.signature(K._decompress_sum_kernel.fn).parameters:
            consts["CODE_WORDS"] = True
        kernel = compile_sm90(K._decompress_sum_kernel, DECOMPRESS_SIGNATURE, consts, 8)
        print(f"decompress {fmt} {transform} {scales} G={g}: {_summary(kernel, _per_thread(consts, launch))}")


if __name__ == "__main__":
    main()
