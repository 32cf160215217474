"""benchmarks/megatron_lm_check.py's one-GPU link: both ranks of a Megatron-LM run on one GPU over gloo.

The runs themselves need a GPU and a Megatron-LM checkout (the GPU machine); here, on CPU: the rows' commands, and
megatron_taco/testing/one_gpu/sitecustomize.py loaded by Python in two real gloo ranks started by torchrun.
"""

import os
import subprocess

import pytest

from benchmarks import megatron_lm_check as check
from megatron_taco.testing.distributed import free_port

PROBE = """
import os, torch, torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
tensors = [torch.full((3,), rank + 1.0), torch.full((5,), 10.0 * (rank + 1))]
with _coalescing_manager(dist.group.WORLD, async_ops=False):
    for tensor in tensors:
        dist.all_reduce(tensor)
# PP=2's exchange: each rank sends its tensor and receives the other's in one batch (Megatron-LM's p2p pattern)
# (the schedule's receive buffers require grad, as megatron-core's p2p_communication makes them)
mine, theirs = torch.arange(4.0) + 100 * rank, torch.zeros(4, requires_grad=True)
requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, 1 - rank), dist.P2POp(dist.irecv, theirs, 1 - rank)])
for request in requests:
    request.wait()
line = (f"rank {rank}: LOCAL_RANK {os.environ['LOCAL_RANK']}, sums {tensors[0].tolist()} {tensors[1].tolist()}, "
        f"received {theirs.tolist()} by {type(requests[1]).__name__}, "
        f"coalesced by {dist.ProcessGroup.allreduce_coalesced.__name__}\\n")
os.write(1, line.encode())  # one write: the two ranks share the pipe
dist.destroy_process_group()
"""


def _torchrun(tmp_path, env):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cmd = check.torchrun(free_port(), str(script))
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))


def test_the_one_gpu_site_gives_every_rank_device_0_and_sums_coalesced_all_reduces_one_by_one(tmp_path):
    """With the site folder first on PYTHONPATH and MEGATRON_TACO_ONE_GPU=1 both ranks read LOCAL_RANK 0 (torchrun
    gave them 0 and 1), megatron-core DDP's coalesced all-reduce goes through the shim with the same sums, and PP=2's
    batched send / receive pair arrives through host buffers."""
    site = {"PYTHONPATH": check.ONE_GPU_SITE, "OMP_NUM_THREADS": "1"}
    sums = "sums [3.0, 3.0, 3.0] [30.0, 30.0, 30.0, 30.0, 30.0]"
    assert _torchrun(tmp_path, {**site, "MEGATRON_TACO_ONE_GPU": "1"}) == [
        f"rank 0: LOCAL_RANK 0, {sums}, received [100.0, 101.0, 102.0, 103.0] by _HostReceive, "
        "coalesced by _allreduce_each",
        f"rank 1: LOCAL_RANK 0, {sums}, received [0.0, 1.0, 2.0, 3.0] by _HostReceive, coalesced by _allreduce_each",
    ]
    # without the switch the site file changes nothing (it is only on PYTHONPATH for one-GPU rows anyway)
    assert _torchrun(tmp_path, site) == [
        f"rank 0: LOCAL_RANK 0, {sums}, received [100.0, 101.0, 102.0, 103.0] by Work, coalesced by allreduce_coalesced",
        f"rank 1: LOCAL_RANK 1, {sums}, received [0.0, 1.0, 2.0, 3.0] by Work, coalesced by allreduce_coalesced",
    ]


def test_one_gpu_rows_run_megatron_lm_over_gloo_and_the_others_over_nccl():
    one_gpu = [row for row in check.ROWS if row.link == check.ONE_GPU]
    assert one_gpu and check.SUITES[check.ONE_GPU] == [row.name for row in one_gpu]
    assert not set(check.SUITES[check.ONE_GPU]) & set(check.SUITES["all"])  # "all" needs two GPUs
    for row in check.ROWS:
        cmd = check.command(row, "/megatron-lm", 1234)
        backend = cmd[cmd.index("--distributed-backend") + 1]
        assert backend == ("gloo" if row.link == check.ONE_GPU else "nccl"), row.name
        assert cmd.count("--distributed-backend") == 1


def test_one_gpu_rows_get_no_speed_ratio():
    """gloo carries the messages through the host: its times are not a speed a user would see."""

    def result(name, ms):
        row = next(row for row in check.ROWS if row.name == name)
        return {"row": check.dataclasses.asdict(row), "ms_per_iter": ms, "returncode": 0}

    rows = check.summarise(
        [
            result("one-gpu-gpt-te-bf16-none", 2900.0),
            result("one-gpu-gpt-te-bf16-int8", 1160.0),
            result("socket-gpt-te-bf16-none", 437.0),
            result("socket-gpt-te-bf16-int8", 270.0),
        ]
    )
    assert "ratio" not in rows["one-gpu-gpt-te-bf16-int8"]
    assert rows["socket-gpt-te-bf16-int8"]["ratio"] == 437.0 / 270.0


def test_the_resume_check_row_saves_with_the_bf16_wire_and_passes_only_when_the_load_stops():
    """``...-resume-from-mapl8-bf16``: the first half saves with ``--mapl-wire bf16``, the second loads at the default
    wire; the row passes when the load stopped with the resume check's line, not when it trained on or failed
    otherwise."""
    row = next(row for row in check.ROWS if row.saved_mapl)
    assert row.name == "one-gpu-gpt-te-bf16-none-pp2-mapl8-resume-from-mapl8-bf16" and row.resume
    saving, loading = check.command(row, "/m", 1, mapl=row.saved_mapl), check.command(row, "/m", 2)
    assert saving[-4:] == ["--mapl-ratio", "8", "--mapl-wire", "bf16"] and loading[-2:] == ["--mapl-ratio", "8"]
    stop = (
        "error: --load /c: its MAPL boundaries were saved with --mapl-ratio 8 --mapl-wire bf16, this run has "
        "--mapl-ratio 8 --mapl-wire fp8 (...); resume with the flags it was saved with"
    )
    trained = " iteration 20/ 20 | lm loss: 5.4 |\n"
    assert check.judge(row, 1, f"start\n{stop}\nChildFailedError", loaded=True) == {"passed": True, "stop_line": stop}
    assert not check.judge(row, 0, trained, loaded=True)["passed"]  # it trained on: the check did not stop it
    other = check.judge(row, 1, "RuntimeError: shape mismatch for mapl_send_0.u", loaded=True)
    assert not other["passed"] and other["error"] == "RuntimeError: shape mismatch for mapl_send_0.u"
    assert not check.judge(row, 1, stop, loaded=False)["passed"]  # the saving half failed: nothing was loaded
    plain = next(r for r in check.ROWS if r.resume and not r.saved_mapl)
    assert check.judge(plain, 0, trained, loaded=True) == {"passed": True}
    assert not check.judge(plain, 1, stop, loaded=True)["passed"]
    assert check._passed({"returncode": 0}) and not check._passed({"returncode": 2})  # results of before "passed"


def test_rows_refuse_an_unknown_mapl_variant_and_a_saved_variant_without_resume():
    with pytest.raises(ValueError, match="saved_mapl needs resume=True"):
        check._row(check.ONE_GPU, "gpt", "te", "bf16", "none", pipeline=2, mapl="8", saved_mapl="8-bf16")
    with pytest.raises(ValueError, match="saved_mapl '8-int2' is not one of"):
        check._row(check.ONE_GPU, "gpt", "te", "bf16", "none", pipeline=2, mapl="8", resume=True, saved_mapl="8-int2")
