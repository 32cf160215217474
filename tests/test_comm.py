"""Compressed collectives on real gloo process groups (2, 3 and 4 ranks).

Bounds: a message's per-group error is at most 2^-4 of the group's L2 norm
(E4M3 rounding, orthogonal Hadamard; tests/test_codec.py), so
  all-gather:      ||out_r - x_r|| <= 2^-4 ||x_r|| for each rank's part;
  reduce-scatter:  ||out - sum_r x_r|| <= 2^-4 sum_r ||x_r chunk||;
  all-reduce:      the reduce-scatter bound plus 2^-4 of the reduced chunk's norm (second quantization).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_taco import comm
from megatron_taco.codec import TacoCodec
from megatron_taco.testing.distributed import run_distributed

EPS = 2.0**-4


def _inputs(shape, dtype, world):
    """Every rank's input, identical on all ranks (each rank then takes its own)."""
    gen = torch.Generator().manual_seed(1234)
    xs = [torch.randn(shape, generator=gen) * (1 + r) for r in range(world)]
    xs[0][0, :5] = 1e-4  # some near-zero mass
    return [x.to(dtype) for x in xs]


def _norm(x):
    return float(x.double().norm())


def _collectives_worker(backend: str, shape, dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    codec = TacoCodec(backend=backend)
    xs = _inputs(shape, dtype, world)
    x = xs[rank]
    checks = {}

    gathered = comm.all_gather(x, None, codec)
    parts = gathered.view(world, *shape)
    checks["ag_max_rel"] = max(_norm(parts[r].double() - xs[r].double()) / _norm(xs[r]) for r in range(world))
    checks["ag_bytes"] = gathered.float().clone()
    checks["ag_async_equal"] = torch.equal(comm.all_gather(x, None, codec, async_op=True).wait(), gathered)

    rs = comm.reduce_scatter(x, None, codec)
    rows = shape[0] // world
    mine = slice(rank * rows, (rank + 1) * rows)
    exact = sum(xr.double()[mine] for xr in xs)
    checks["rs_err"] = _norm(rs.double() - exact)
    checks["rs_bound"] = EPS * sum(_norm(xr[mine]) for xr in xs)
    checks["rs_deterministic"] = torch.equal(comm.reduce_scatter(x, None, codec), rs)
    checks["rs_async_equal"] = torch.equal(comm.reduce_scatter(x, None, codec, async_op=True).wait(), rs)

    ar = comm.all_reduce(x, None, codec)
    exact_all = sum(xr.double() for xr in xs)
    checks["ar_err"] = _norm(ar.double() - exact_all)
    checks["ar_bound"] = EPS * sum(_norm(xr) for xr in xs) + EPS * 1.1 * _norm(exact_all)
    checks["ar_shape"] = tuple(ar.shape) == tuple(x.shape) and ar.dtype == x.dtype

    # codec=None and below-threshold messages are the plain torch collectives, exactly.
    plain = torch.empty(world * shape[0], *shape[1:], dtype=dtype)
    dist.all_gather_into_tensor(plain, x)
    checks["plain_ag_equal"] = torch.equal(comm.all_gather(x, None, None), plain)
    big = comm.CommOptions(min_bytes=1 << 30)
    checks["threshold_ag_equal"] = torch.equal(comm.all_gather(x, None, codec, big), plain)
    plain_rs = torch.empty(rows, *shape[1:], dtype=dtype)
    dist.reduce_scatter_tensor(plain_rs, x.clone())
    checks["threshold_rs_equal"] = torch.equal(comm.reduce_scatter(x, None, codec, big), plain_rs)
    return checks


def _check_results(results, world):
    for rank, checks in enumerate(results):
        assert checks["ag_max_rel"] <= EPS, checks["ag_max_rel"]
        assert torch.equal(checks["ag_bytes"], results[0]["ag_bytes"]), f"rank {rank} all-gather differs from rank 0"
        assert checks["rs_err"] <= checks["rs_bound"], (checks["rs_err"], checks["rs_bound"])
        assert checks["ar_err"] <= checks["ar_bound"], (checks["ar_err"], checks["ar_bound"])
        for key in ("ag_async_equal", "rs_deterministic", "rs_async_equal", "ar_shape", "plain_ag_equal",
                    "threshold_ag_equal", "threshold_rs_equal"):
            assert checks[key], f"rank {rank}: {key}"


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collectives_within_codec_bounds(world, dtype):
    # 12 x 37 rows: 444 elements per rank chunk, not a multiple of the group size 128.
    shape = (12, 37)
    results = run_distributed(_collectives_worker, world, "torch", shape, dtype, timeout=120)
    _check_results(results, world)


def test_collectives_with_triton_kernels_in_interpreter():
    results = run_distributed(_collectives_worker, 2, "triton", (8, 100), torch.float32, timeout=180,
                              env={"TRITON_INTERPRET": "1"})
    _check_results(results, 2)


def _nan_worker():
    rank, world = dist.get_rank(), dist.get_world_size()
    codec = TacoCodec(backend="torch")
    x = torch.randn(4 * world, 128)
    if rank == 1:
        x[0, 3] = float("nan")  # row 0 belongs to rank 0's reduce-scatter chunk
    ag = comm.all_gather(x, None, codec)
    rs = comm.reduce_scatter(x, None, codec)
    return (
        bool(torch.isfinite(ag[4 * world : 4 * world + 1]).all()),  # rank 1's first row
        bool(torch.isfinite(rs[0]).all()),
        bool(torch.isfinite(rs[1:]).all()),
    )


def test_nan_on_one_rank_comes_out_nonfinite():
    results = run_distributed(_nan_worker, 2, timeout=60)
    for ag_row_finite, _, rest_finite in results:
        assert not ag_row_finite, "the NaN row of rank 1 must stay non-finite in every rank's all-gather"
        assert rest_finite
    assert not results[0][1], "rank 0's reduce-scatter chunk holds the NaN row and must be non-finite"
    assert results[1][1]


def _mismatch_worker():
    rank = dist.get_rank()
    codec = TacoCodec(group_size=64 if rank == 1 else 128, backend="torch")
    try:
        comm.all_gather(torch.randn(4, 128), None, codec)
    except comm.SettingsMismatchError as exc:
        return str(exc)
    return "no error"


def test_ranks_with_other_settings_fail_clearly_on_every_rank():
    messages = run_distributed(_mismatch_worker, 3, timeout=60)
    for message in messages:
        assert "rank 0: group_size=128" in message and "rank 1: group_size=64" in message, message


def _bad_input_worker():
    codec = TacoCodec(backend="torch")
    errors = []
    for call in (
        lambda: comm.reduce_scatter(torch.randn(3, 8), None, codec),  # 3 rows over 2 ranks
        lambda: comm.all_gather(torch.tensor(1.0), None, codec),
        lambda: comm.all_gather(torch.arange(8).view(4, 2), None, codec),
    ):
        try:
            call()
            errors.append("no error")
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
    return errors


def test_bad_inputs_raise_clear_errors():
    errors = run_distributed(_bad_input_worker, 2, timeout=60)[0]
    assert "not divisible by the group size 2" in errors[0]
    assert "0-d" in errors[1]
    assert "torch.int64" in errors[2]


def _policy_worker():
    from megatron_taco.comm.policy import FAST_LINK_GBPS, NEVER, auto_options, break_even_bytes

    options, gbps = auto_options(None, torch.device("cpu"))
    return gbps, options.min_bytes, FAST_LINK_GBPS, NEVER, break_even_bytes(gbps)


def test_auto_policy_measures_the_link_and_agrees_on_every_rank():
    results = run_distributed(_policy_worker, 2, timeout=60)
    (gbps, min_bytes, fast, never, break_even), other = results
    assert other[:2] == (gbps, min_bytes), "ranks must take the same decision"
    assert gbps > 0
    assert min_bytes == (never if gbps > fast else break_even)
    assert 0 < break_even < never
