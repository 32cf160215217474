import sys, torch
sys.path.insert(0, ".devout")
from triton.testing import do_bench
import kernels_old
from megatron_taco.codec import TacoCodec
from megatron_taco.codec import kernels as new
MIB = 1 << 20
x = torch.randn(128 * MIB // 2, device="cuda", dtype=torch.bfloat16)
for args in [(128, "int4", "ash", "fp32"), (16, "e2m1", "ash", "e4m3"), (128, "e4m3", "ash", "fp32")]:
    c = TacoCodec(*args, backend="triton")
    buf = c.compress(x)
    for n in (1, 2, 4):
        bufs = buf.unsqueeze(0).repeat(n, 1)
        out = torch.empty(1, x.numel(), dtype=torch.bfloat16, device="cuda")
        t_new = do_bench(lambda: new.decompress_rows(bufs, out, c.settings), return_mode="median")
        a = out.clone()
        t_old = do_bench(lambda: kernels_old.decompress_rows(bufs, out, c.settings), return_mode="median")
        print(f"{args} N={n}: new {t_new:.3f} ms old {t_old:.3f} ms same={torch.equal(a, out)}", flush=True)
