"""Compile the TACO compress / decompress-sum kernels for sm_90 on a CPU machine (no GPU) and count what the PTX holds:
shuffles, shared-memory traffic, global load/store widths, instructions. Usage, from the repository root:

    python benchmarks/results/logs/kernels_exploration_2026-12-01/compile_counts.py [KERNELS_FILE [TILE,WARPS]]

KERNELS_FILE: another version of megatron_taco/codec/kernels.py to load in its place (e.g. `git show REV:...`);
TILE,WARPS: one launch shape for both kernels instead of the file's LAUNCH_CONFIG.
The divisibility attributes matter: a real launch specialises 16-aligned pointers and sizes; without them the
loads compile to scalars.
"""

import importlib.util
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_taco.codec import TacoCodec

if len(sys.argv) > 1 and sys.argv[1] != "-":
    spec = importlib.util.spec_from_file_location("kernels_under_test", sys.argv[1])
    K = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(K)
else:
    from megatron_taco.codec import kernels as K


def _compile(fn, sig, consts, n_div):
    consts = dict(consts)
    num_warps = consts.pop("num_warps")
    consts.pop("enable_fp_fusion")
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(n_div)}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, enable_fp_fusion=False))


def _summary(ptx):
    mem = sorted(set(re.findall(r"(ld\.global[.a-z0-9]*|st\.global[.a-z0-9]*)", ptx)))
    instructions = len(re.findall(r"^\s+(?:@%p\d+ )?[a-z]+\.", ptx, re.M))
    return (f"shfl={ptx.count('shfl.sync')} st.shared={ptx.count('st.shared')} ld.shared={ptx.count('ld.shared')} "
            f"instructions={instructions} memory={mem}")


for fmt, transform, scales, g in [("e4m3", "ash", "fp32", 128), ("e4m3", "none", "fp32", 128), ("int4", "ash", "fp32", 128),
                                  ("e2m1", "ash", "e8m0", 32)]:
    st = TacoCodec(g, fmt, transform, scales, backend="torch").settings
    shape = tuple(int(v) for v in sys.argv[2].split(",")) if len(sys.argv) > 2 else None
    launch = shape or K.LAUNCH_CONFIG["compress"]
    sig = {"x_ptr": "*bf16", "out_ptr": "*u8", "x_row_stride": "i64", "out_row_stride": "i64", "numel": "i32",
           "n_groups": "i32", "scales_offset": "i32", "head0": "i32", "head1": "i32", "head2": "i32", "head3": "i32",
           "eps": "fp32", "seed": "i32", "row_amax_ptr": "*fp32"}
    ck = _compile(K._compress_kernel, sig, K._compress_constants(st, launch, True), 7)
    print(f"compress   {fmt} {transform} {scales} G={g} launch={launch}: {_summary(ck.asm['ptx'])}")
    launch = shape or K.LAUNCH_CONFIG["decompress_sum"]
    sig = {"bufs_ptr": "*u8", "out_ptr": "*bf16", "n_bufs": "i32", "buf_stride": "i64", "out_row_stride": "i64",
           "numel": "i32", "n_groups": "i32", "scales_offset": "i32"}
    ck = _compile(K._decompress_sum_kernel, sig, K._decompress_constants(st, launch, True, torch.bfloat16), 8)
    print(f"decompress {fmt} {transform} {scales} G={g} launch={launch}: {_summary(ck.asm['ptx'])}")
