"""Exploration: where compress time goes; TE block quantizer speed and codes vs TACO plain FP8."""
import time, torch, triton, traceback
from triton.testing import do_bench
from megatron_taco.codec import TacoCodec
MIB = 1 << 20
def bench(fn): return do_bench(fn, warmup=25, rep=100, return_mode="median")
x = torch.randn(128 * MIB // 2, device="cuda", dtype=torch.bfloat16)  # 128 MiB bf16
x[::997] *= 40  # outliers
cp = torch.empty_like(x); copy_ms = bench(lambda: cp.copy_(x)); copy_bw = 2 * x.numel() * 2 / copy_ms / 1e6
print(f"copy 128MiB bf16: {copy_ms:.3f} ms {copy_bw:.0f} GB/s")
for args in [(128, "e4m3", "ash", "fp32"), (128, "e4m3", "none", "fp32"), (128, "e4m3", "ash", "e8m0"),
             (32, "e4m3", "ash", "fp32"), (16, "e2m1", "ash", "e4m3"), (16, "e2m1", "none", "e4m3"),
             (128, "e2m1", "ash", "fp32"), (32, "e2m1", "ash", "e8m0"), (128, "int4", "ash", "fp32"), (128, "int4", "none", "fp32")]:
    c = TacoCodec(*args, backend="triton")
    buf = c.compress(x)
    ms = bench(lambda: c.compress(x, out=buf))
    dms = bench(lambda: c.decompress(buf, x.shape, x.dtype, validate=False))
    nb = buf.numel()
    print(f"{args}: compress {ms:.3f} ms frac {(x.numel()*2+nb)/ms/1e6/copy_bw:.2f} | decompress {dms:.3f} frac {(x.numel()*2+nb)/dms/1e6/copy_bw:.2f}", flush=True)
# TE
try:
    import transformer_engine.pytorch as te, transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import Float8BlockwiseQTensorStorage
    for pow2 in (False, True):
        q = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False, block_scaling_dim=1, force_pow_2_scales=pow2)
        x2 = x.view(-1, 128)
        t = q(x2)
        ms = bench(lambda: q(x2))
        nb = x.numel() + x.numel() // 128 * 4
        print(f"TE block pow2={pow2}: {ms:.3f} ms frac {(x.numel()*2+nb)/ms/1e6/copy_bw:.2f}; data {t._rowwise_data.shape} {t._rowwise_data.dtype} scale {t._rowwise_scale_inv.shape} {t._rowwise_scale_inv.dtype}")
        dq = bench(lambda: t.dequantize(dtype=torch.bfloat16))
        print(f"  TE dequantize: {dq:.3f} ms frac {(x.numel()*2+nb)/dq/1e6/copy_bw:.2f}")
        # into a preallocated message
        n_groups = x.numel() // 128
        msg = torch.empty(16 + n_groups * 132, dtype=torch.uint8, device="cuda")
        scale = torch.empty(1, (n_groups + 3) // 4 * 4, dtype=torch.float32, device="cuda")
        dst = Float8BlockwiseQTensorStorage(msg[16:16 + n_groups * 128].view(n_groups, 128), scale, None, None, tex.DType.kFloat8E4M3, q, False)
        try:
            tex.quantize(x2, q, dst, None)
            same = torch.equal(dst._rowwise_data, t._rowwise_data)
            ms2 = bench(lambda: tex.quantize(x2, q, dst, None))
            print(f"  into message view: {ms2:.3f} ms; same codes {same}; scale rows equal {torch.equal(scale[0,:n_groups], t._rowwise_scale_inv[0,:n_groups])}")
        except Exception:
            traceback.print_exc()
        if not pow2:
            c = TacoCodec(128, "e4m3", "none", "fp32", backend="triton")
            buf = c.compress(x)
            codes = buf[16:16 + n_groups * 128].view(n_groups, 128)
            s = buf[16 + n_groups * 128:].view(torch.float32)
            print(f"  codes equal TACO none/fp32: {torch.equal(codes, t._rowwise_data.view(torch.uint8))}, mismatching {(codes != t._rowwise_data.view(torch.uint8)).sum().item()}")
            ts = t._rowwise_scale_inv[0, :n_groups]
            print(f"  scale rel diff max {((ts - s).abs() / s).max().item():.3e}, equal frac {(ts == s).float().mean().item():.4f}")
        # non-finite
        y = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16); y[1, 5] = float("nan"); y[2, 7] = float("inf"); y[3] = 0
        ty = q(y)
        print("  nonfinite: scale_inv", ty._rowwise_scale_inv[0, :4].tolist(), "codes row1[:8]", ty._rowwise_data.view(torch.uint8)[1, :8].tolist(), "row2[:8]", ty._rowwise_data.view(torch.uint8)[2, :8].tolist())
        print("  deq rows nan counts", ty.dequantize(dtype=torch.float32).isnan().sum(1).tolist())
    # fp32 input (ASH path: Triton transforms to fp32, TE casts)
    xf = x.float().view(-1, 128)
    q = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False, block_scaling_dim=1, force_pow_2_scales=False)
    ms = bench(lambda: q(xf)); print(f"TE block fp32 in: {ms:.3f} ms")
    try:
        from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer
        qn = NVFP4Quantizer(rowwise=True, columnwise=False)
        tn = qn(x.view(-1, 2048)); ms = bench(lambda: qn(x.view(-1, 2048))); print(f"TE NVFP4: {ms:.3f} ms")
    except Exception as e:
        print("TE NVFP4:", type(e).__name__, str(e)[:300])
    try:
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
        qm = MXFP8Quantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)
        tm = qm(x.view(-1, 2048)); ms = bench(lambda: qm(x.view(-1, 2048))); print(f"TE MXFP8: {ms:.3f} ms")
    except Exception as e:
        print("TE MXFP8:", type(e).__name__, str(e)[:300])
except Exception:
    traceback.print_exc()
