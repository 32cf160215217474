"""Host time per TacoCodec.compress / decompress call with the Triton launches stubbed (CPU): the codec's own Python.

    PYTHONPATH=<checkout> python host_overhead.py
"""
import time

import torch

from megatron_taco.codec import TacoCodec, kernels


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


kernels._compress_kernel = kernels._decompress_sum_kernel = _NoLaunch()
codec = TacoCodec(128, "e4m3", "ash", "fp32", backend="triton")
x = torch.randn(1 << 16)
message = codec.compress(x)
for name, call in (
    ("compress", lambda: codec.compress(x, out=message)),
    ("decompress", lambda: codec.decompress(message, x.shape, torch.bfloat16, validate=False)),
):
    for _ in range(500):
        call()
    best = []
    for _ in range(5):
        start, n = time.perf_counter(), 5000
        for _ in range(n):
            call()
        best.append((time.perf_counter() - start) / n * 1e6)
    print(f"{name}: {min(best):.1f} us per call (best of 5 x 5000; Triton launch stubbed)")
