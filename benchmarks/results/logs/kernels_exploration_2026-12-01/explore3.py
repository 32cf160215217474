"""Micro-kernels: cost of each compress piece (HW cast vs grid rounding, FWHT variants, dot-based transform)."""
import torch, triton, triton.language as tl
from triton.testing import do_bench
from megatron_taco.codec.kernels import _fwht, _round_to_grid
import sys; sys.path.insert(0, '.devout')
from fwht_sum import _fwht_sum
MIB = 1 << 20

@triton.jit
def _fwht_inplace(v, BLOCK_G: tl.constexpr, G: tl.constexpr, LOG2G: tl.constexpr):
    """in-place order: stage b pairs (i, i + 2^b); reshape (B, G>>(b+1), 2, 2^b) -> permute -> split."""
    for b in tl.static_range(LOG2G):
        lo: tl.constexpr = 1 << b
        v4 = tl.permute(tl.reshape(v, (BLOCK_G, G // (2 * lo), 2, lo)), (0, 1, 3, 2))
        a, c = tl.split(v4)
        v = tl.reshape(tl.permute(tl.join(a + c, a - c), (0, 1, 3, 2)), (BLOCK_G, G))
    return v

@triton.jit
def k(x_ptr, out_ptr, scale_ptr, h_ptr, numel, n_groups, G: tl.constexpr, LOG2G: tl.constexpr, BLOCK_G: tl.constexpr,
      VARIANT: tl.constexpr, HW: tl.constexpr, WIDE: tl.constexpr):
    pid = tl.program_id(0)
    groups = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    if WIDE:
        offsets = groups.to(tl.int64)[:, None] * G + tl.arange(0, G)[None, :]
    else:
        offsets = groups[:, None] * G + tl.arange(0, G)[None, :]
    xb = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0)
    x = xb.to(tl.float32)
    if VARIANT == 1:
        y = _fwht(x, BLOCK_G, G, LOG2G) * 0.08838834764831845
    elif VARIANT == 2:
        y = _fwht_sum(x, BLOCK_G, G, LOG2G) * 0.08838834764831845
    elif VARIANT == 3:
        h = tl.load(h_ptr + tl.arange(0, G)[:, None] * G + tl.arange(0, G)[None, :])
        y = tl.dot(xb, h, out_dtype=tl.float32) * 0.08838834764831845
    else:
        y = x
    amax = tl.max(tl.abs(y), axis=1)
    q = y * tl.where(amax > 0, 448.0 / amax, 1.0)[:, None]
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if not HW:
        q = _round_to_grid(q, 3, 2.0 ** -6, 1.5 * 2.0 ** (-9 + 23))
    codes = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(out_ptr + offsets, codes, mask=(groups < n_groups)[:, None])
    tl.store(scale_ptr + groups, amax / 448.0, mask=groups < n_groups)

x = torch.randn(128 * MIB // 2, device="cuda", dtype=torch.bfloat16)
cp = torch.empty_like(x); copy_ms = do_bench(lambda: cp.copy_(x), return_mode="median")
copy_bw = 2 * x.numel() * 2 / copy_ms / 1e6
G = 128; n_groups = x.numel() // G
out = torch.empty(x.numel(), dtype=torch.uint8, device="cuda"); sc = torch.empty(n_groups, device="cuda")
H = torch.ones(1, 1)
while H.shape[0] < G:
    H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
h = H.to(torch.bfloat16).cuda().contiguous()
ref = None
for variant in (1, 2):
    for hw in (True,):
        for wide in (False,):
            for tile, warps in ((512, 1), (1024, 1), (1024, 2), (2048, 2), (2048, 4), (4096, 4), (4096, 8), (8192, 8)):
                bg = tile // G
                if variant == 3 and bg < 16:
                    continue
                grid = (triton.cdiv(n_groups, bg),)
                try:
                    fn = lambda: k[grid](x, out, sc, h, x.numel(), n_groups, G=G, LOG2G=7, BLOCK_G=bg, VARIANT=variant, HW=hw, WIDE=wide, num_warps=warps)
                    fn(); torch.cuda.synchronize()
                    if variant in (1, 2) and ref is not None and not torch.equal(out, ref): print("  MISMATCH vs variant 1")
                    if variant == 1: ref = out.clone()
                    ms = do_bench(fn, return_mode="median")
                    print(f"variant {variant} hw {hw} wide {wide} tile {tile} warps {warps}: {ms:.4f} ms frac {(x.numel()*3)/ms/1e6/copy_bw:.2f}", flush=True)
                except Exception as e:
                    import traceback; traceback.print_exc(); break
