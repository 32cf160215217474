"""The multi-process harness itself: results, failures and hangs are reported per rank."""

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from megatron_taco.testing import distributed
from megatron_taco.testing.distributed import DistributedTestError, run_distributed


def _rank_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_ranks_run_and_return(world):
    results = run_distributed(_rank_sum, world, timeout=60)
    assert [r[0] for r in results] == list(range(world))
    assert all(r[1] == world for r in results)
    assert all(r[2] == world * (world + 1) / 2 for r in results)


def test_a_port_taken_by_another_run_does_not_break_the_rendezvous(monkeypatch):
    # The race of side-by-side runs: a port found free (``free_port``) is bound by someone else before the ranks
    # listen on it. The parent's store binds a port the kernel chooses instead, so a taken port never reaches it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(distributed, "free_port", lambda: taken.getsockname()[1])
        results = run_distributed(_rank_sum, 2, timeout=60)
    assert [r[2] for r in results] == [3.0, 3.0]


_threads_at_fork = []  # filled while one test is recording (a fork hook cannot be removed once registered)
_recording_forks = False


def _record_threads_at_fork():
    if _recording_forks:
        _threads_at_fork.append(len(os.listdir("/proc/self/task")))


os.register_at_fork(before=_record_threads_at_fork)


def test_ranks_are_forked_while_the_parent_runs_no_store_thread():
    # Forking while the store's server thread ran let a rank inherit a lock that thread held: ~1 run in 10 hung
    # (4 ranks, 2 cores; three CI tests timed out). The threads at each fork must be those the parent had before.
    global _recording_forks
    threads_before = len(os.listdir("/proc/self/task"))
    _threads_at_fork.clear()
    _recording_forks = True
    try:
        results = run_distributed(_rank_sum, 4, timeout=60)
    finally:
        _recording_forks = False
    assert [r[2] for r in results] == [10.0] * 4
    assert _threads_at_fork == [threads_before] * 4


def test_runs_side_by_side_in_threads_spawn_their_ranks(monkeypatch):
    # A rank forked while another run's thread built its TCPStore hung in TCPStore's constructor (mapl_loopback
    # --parallel 2 on CPU): with other Python threads alive, the ranks must be spawned, never forked.
    global _recording_forks
    monkeypatch.delenv("TACO_TEST_START_METHOD", raising=False)
    _threads_at_fork.clear()
    _recording_forks = True
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            runs = [pool.submit(run_distributed, _rank_sum, 2, timeout=120) for _ in range(2)]
            results = [run.result() for run in runs]
    finally:
        _recording_forks = False
    assert [[r[2] for r in result] for result in results] == [[3.0, 3.0], [3.0, 3.0]]
    assert _threads_at_fork == []  # no fork


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 hangs here: its peer is gone


def test_failure_on_one_rank_reports_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="rank 1 failed") as info:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    assert "boom on rank one" in str(info.value)
    assert time.monotonic() - start < 45, "a failed rank must not wait for the full timeout"


def _hang():
    time.sleep(60)


def test_hang_times_out_and_names_ranks():
    with pytest.raises(DistributedTestError, match=r"timed out after 3s; ranks \[0, 1\]"):
        run_distributed(_hang, 2, timeout=3)
