"""Compile the TACO compress / decompress-sum kernels for sm_90 on a CPU machine (no GPU) and count what the PTX holds:
shuffles, shared-memory traffic, global load/store widths, instructions. Usage, from the repository root:

    python benchmarks/results/logs/kernels_exploration_2026-12-01/compile_counts.py [KERNELS_FILE [TILE,WARPS]]

KERNELS_FILE: another version of megatron_taco/codec/kernels.py to load in its place (e.g. `git show REV:...`);
TILE,WARPS: one launch shape for both kernels instead of the file's LAUNCH_CONFIG.
The divisibility attributes matter: a real launch specialises 16-aligned pointers and sizes; without them the
loads compile to scalars. The compiling helpers are sass_counts.py's (beside it).
"""

import inspect
import re
import sys

import torch

from megatron_taco.codec import TacoCodec
from sass_counts import COMPRESS_SIGNATURE, DECOMPRESS_SIGNATURE, compile_sm90, load_kernels  # the folder's helpers


def _summary(ptx):
    mem = sorted(set(re.findall(r"(ld\.global[.a-z0-9]*|st\.global[.a-z0-9]*)", ptx)))
    instructions = len(re.findall(r"^\s+(?:@%p\d+ )?[a-z]+\.", ptx, re.M))
    return (f"shfl={ptx.count('shfl.sync')} st.shared={ptx.count('st.shared')} ld.shared={ptx.count('ld.shared')} "
            f"instructions={instructions} memory={mem}")


K = load_kernels(sys.argv[1] if len(sys.argv) > 1 else None)
takes_dtype = len(inspect.signature(K._compress_constants).parameters) == 4  # the input's bits (88ae99a on)
for fmt, transform, scales, g in [("e4m3", "ash", "fp32", 128), ("e4m3", "none", "fp32", 128), ("int4", "ash", "fp32", 128),
                                  ("e2m1", "ash", "e8m0", 32)]:
    st = TacoCodec(g, fmt, transform, scales, backend="torch").settings
    shape = tuple(int(v) for v in sys.argv[2].split(",")) if len(sys.argv) > 2 else None
    launch = shape or K.LAUNCH_CONFIG["compress"]
    consts = K._compress_constants(st, launch, True, *([16] if takes_dtype else []))
    ck = compile_sm90(K._compress_kernel, COMPRESS_SIGNATURE, consts, 7)
    print(f"compress   {fmt} {transform} {scales} G={g} launch={launch}: {_summary(ck.asm['ptx'])}")
    launch = shape or K.LAUNCH_CONFIG["decompress_sum"]
    ck = compile_sm90(K._decompress_sum_kernel, DECOMPRESS_SIGNATURE, K._decompress_constants(st, launch, True, torch.bfloat16), 8)
    print(f"decompress {fmt} {transform} {scales} G={g} launch={launch}: {_summary(ck.asm['ptx'])}")
