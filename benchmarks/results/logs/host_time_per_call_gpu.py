"""Host microseconds per codec call on the GPU machine, and where 64 MiB time goes (probe)."""
import time, torch
from megatron_taco.codec import TacoCodec
from triton.testing import do_bench

def host_us(call, n=2000):
    for _ in range(50): call()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n): call()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / n * 1e6)
    return best

for fmt, tr in (("e4m3", "ash"), ("e4m3", "none"), ("int4", "ash")):
    codec = TacoCodec(128, fmt, tr, "fp32", backend="triton")
    for numel in (1 << 16, 1 << 25):
        x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        buf = codec.compress(x)
        c = lambda: codec.compress(x, out=buf)
        d = lambda: codec.decompress(buf, x.shape, torch.bfloat16, validate=False)
        print(f"{fmt}+{tr} numel {numel}: host compress {host_us(c, 500 if numel > 1e6 else 2000):.1f} us/call, "
              f"decompress {host_us(d, 500 if numel > 1e6 else 2000):.1f} us/call; "
              f"do_bench compress {do_bench(c, return_mode='median')*1e3:.1f} us, "
              f"no-flush (graph-free loop of 200) {0:.0f}", flush=True)
        # GPU-only time: many calls back to back, events around the whole loop
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); s.record()
        for _ in range(200): c()
        e.record(); torch.cuda.synchronize()
        print(f"   back-to-back compress: {s.elapsed_time(e)/200*1e3:.1f} us/call (max of host and GPU)", flush=True)
x = torch.randn(1 << 25, device="cuda", dtype=torch.bfloat16)
codec = TacoCodec(128, "e4m3", "ash", "fp32", backend="triton")
buf = codec.compress(x)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        codec.compress(x, out=buf)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
