"""Run a function on N real torch.distributed ranks from a test, with a timeout.

Each rank is a separate process with its own ``init_process_group`` (gloo on
CPU, NCCL when ``backend="nccl"``). The parent holds the rendezvous store (a
TCPStore on a port the kernel chose) until the ranks are done, so runs started
side by side can never take each other's port. It opens the store only after
forking every rank and then sends them its port: forking while the store's
server thread runs lets a child inherit a lock held by that thread, and the
child hangs (about 1 run in 10 with 4 ranks on 2 cores). A failure on any rank fails
the call with that rank's traceback; ranks that hang (e.g. a peer died inside a
collective) are killed when the timeout expires and named in the error.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

__all__ = ["LINK_REGIMES", "DistributedTestError", "run_distributed"]

_GRACE_AFTER_FAILURE_S = 10.0
_RENDEZVOUS_TIMEOUT = timedelta(minutes=30)  # torch's default process-group timeout, as env:// rendezvous uses

# The link regimes of DESIGN.md section 5: NCCL environment for a process pair on one 2-GPU host.
LINK_REGIMES: Dict[str, Dict[str, str]] = {
    "nvlink": {},  # default transports
    "shm": {"NCCL_P2P_DISABLE": "1"},  # host shared memory, PCIe-class
    "socket": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"},  # TCP, Ethernet-class
}


class DistributedTestError(RuntimeError):
    """Raised in the parent when a rank failed or the run timed out."""


def free_port() -> int:
    """A TCP port free on this host now: choose it in the parent, before forking the ranks that rendezvous on it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    rank: int,
    world_size: int,
    ports: "mp.SimpleQueue",
    backend: str,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    env: Dict[str, str],
    results: "mp.Queue",
) -> None:
    os.environ.update(env)
    port = ports.get()  # the parent's store is listening on it
    # for code that reads them; the rendezvous itself goes through the parent's store
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=_RENDEZVOUS_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        value = fn(*args, **kwargs)
        # Plain pickle (tensor storages by value): torch's queue reducer would pass shared-memory
        # handles that vanish when this process exits before the parent reads them.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # report everything, including SystemExit from argparse
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _start_method() -> str:
    """``TACO_TEST_START_METHOD`` if set; else ``fork`` (it skips the per-rank import of torch and megatron-core)
    while this process has one Python thread, and ``spawn`` beside others (runs side by side in a thread pool): a
    fork copies the locks other threads hold, and a rank forked while another run's thread was building its
    TCPStore hung in TCPStore's constructor (``mapl_loopback --parallel 2`` on CPU, 2026-12-07)."""
    return os.environ.get("TACO_TEST_START_METHOD") or ("fork" if threading.active_count() == 1 else "spawn")


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    backend: str = "gloo",
    env: Optional[Dict[str, str]] = None,
    **kwargs: Any,
) -> List[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results.

    ``fn`` must be a module-level function (it is pickled under the spawn start
    method). The start method: ``_start_method``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context(_start_method())
    results: "mp.Queue" = ctx.Queue()
    ports: "mp.SimpleQueue" = ctx.SimpleQueue()  # no feeder thread: put() writes before returning
    child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, ports, backend, fn, args, kwargs, child_env, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    import torch.distributed as dist

    # Port 0 lets the kernel choose, and no other run can bind it while this store listens.
    try:
        store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=_RENDEZVOUS_TIMEOUT, wait_for_workers=False)
    except BaseException:
        for proc in procs:  # they wait for a port that will not come
            proc.kill()
        raise
    for _ in procs:
        ports.put(store.port)

    values: Dict[int, Any] = {}
    errors: Dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(values) + len(errors) < world_size:
        remaining = deadline - time.monotonic()
        if errors:
            remaining = min(remaining, _GRACE_AFTER_FAILURE_S)
        if remaining <= 0:
            break
        try:
            rank, status, value = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            for r in dead:
                if r not in values and r not in errors:
                    errors[r] = f"process exited with code {procs[r].exitcode} without a result"
            continue
        if status == "ok":
            values[rank] = pickle.loads(value)
        else:
            errors[rank] = value

    for proc in procs:
        proc.join(timeout=0.5 if (errors or len(values) < world_size) else 30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    del store  # the ranks are gone: release the port

    if errors:
        first = next(iter(errors))  # the first failure reported is usually the root cause
        others = [r for r in errors if r != first]
        hung = [r for r in range(world_size) if r not in values and r not in errors]
        extra = (f"; ranks {others} failed after it" if others else "") + (
            f"; ranks {hung} did not finish" if hung else ""
        )
        raise DistributedTestError(f"rank {first} failed{extra}:\n{errors[first]}")
    if len(values) < world_size:
        hung = [r for r in range(world_size) if r not in values]
        raise DistributedTestError(f"timed out after {timeout:.0f}s; ranks {hung} did not finish")
    return [values[r] for r in range(world_size)]
