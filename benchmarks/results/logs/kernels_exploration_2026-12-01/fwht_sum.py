import triton, triton.language as tl

@triton.jit
def _fwht_sum(v, BLOCK_G: tl.constexpr, G: tl.constexpr, LOG2G: tl.constexpr):
    """In-place Walsh-Hadamard, stage b pairs (i, i + 2^b), b = 0, 1, ...: no permutes, only size-2 sums."""
    for b in tl.static_range(LOG2G):
        if b == 0:
            v3 = tl.reshape(v, (BLOCK_G * (G // 2), 2))
            sign = tl.where(tl.arange(0, 2) == 0, 1.0, -1.0)[None, :]
            total = tl.sum(v3, axis=1)
            diff = tl.sum(v3 * sign, axis=1)
            v3 = tl.where((tl.arange(0, 2) == 1)[None, :], diff[:, None], total[:, None])
        else:
            v3 = tl.reshape(v, (BLOCK_G * (G // (2 << b)), 2, 1 << b))
            sign = tl.where(tl.arange(0, 2) == 0, 1.0, -1.0)[None, :, None]
            total = tl.sum(v3, axis=1)
            diff = tl.sum(v3 * sign, axis=1)
            v3 = tl.where((tl.arange(0, 2) == 1)[None, :, None], diff[:, None, :], total[:, None, :])
        v = tl.reshape(v3, (BLOCK_G, G))
    return v
