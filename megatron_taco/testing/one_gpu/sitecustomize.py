"""Both ranks of a TP=2 (or PP=2) Megatron-LM run on one GPU over gloo: `benchmarks/megatron_lm_check.py`'s
``one-gpu`` link, for sessions that are lent a single GPU. It checks Megatron-LM's and TACO's code paths on the GPU
(Triton kernels, TE layers, the hooks, losses), not speed: gloo carries every message through the host.

Python imports this file at start-up when its folder leads PYTHONPATH (the check puts it there for ``one-gpu`` rows
only, with MEGATRON_TACO_ONE_GPU=1). It fills three gaps that NCCL does not have, and changes no arithmetic:

- NCCL refuses two ranks on one device, and Megatron-LM calls ``torch.cuda.set_device(LOCAL_RANK)``: every rank is
  given LOCAL_RANK 0.
- gloo has no coalesced all-reduce of CUDA tensors (megatron-core DDP's gradient all-reduce, over a data-parallel
  group of one rank here): each tensor is all-reduced on its own, which sums the same values.
- gloo sends and receives only host memory point to point (PP=2's activations and gradients; a CUDA tensor fails
  with "writev ... Bad address"): a send goes from a host copy, a receive lands in a host buffer that is copied into
  the CUDA tensor when the request is waited on (as Megatron-LM's schedules do before they read it).

The last two apply to CPU tensors too, so that the CPU tests (tests/test_megatron_lm_check.py) run their code.
"""

import os

if os.environ.get("MEGATRON_TACO_ONE_GPU") == "1":
    os.environ["LOCAL_RANK"] = "0"

    import torch
    import torch.distributed as dist

    def _allreduce_each(group, tensors, opts=None):
        """ProcessGroup.allreduce_coalesced as one all-reduce per tensor, each waited on (CPU or CUDA tensors)."""
        opts = opts or dist.AllreduceCoalescedOptions()
        single = dist.AllreduceOptions()
        single.reduceOp = opts.reduceOp
        work = None
        for tensor in tensors:
            work = group.allreduce([tensor], single)
            work.wait()
        return work

    dist.ProcessGroup.allreduce_coalesced = _allreduce_each

    _send, _recv = dist.ProcessGroup.send, dist.ProcessGroup.recv
    _sends_in_flight = []  # (request, host copy): a copy lives until its send completes

    def _send_from_host(group, tensors, dst, tag=0):
        """ProcessGroup.send from host copies of ``tensors``."""
        host = [tensor.detach().to("cpu", copy=True) for tensor in tensors]
        request = _send(group, host, dst, tag)
        _sends_in_flight[:] = [(r, h) for r, h in _sends_in_flight if not r.is_completed()] + [(request, host)]
        return request

    class _HostReceive:
        """A receive into host buffers; ``wait`` copies them into the tensors the caller passed."""

        def __init__(self, request, host, tensors):
            self._request, self._host, self._tensors = request, host, tensors

        def wait(self, timeout=None):
            self._request.wait() if timeout is None else self._request.wait(timeout)
            with torch.no_grad():  # the schedule's receive buffers are leaves that require grad
                for tensor, host in zip(self._tensors, self._host):
                    tensor.copy_(host)
            return True

        def __getattr__(self, name):  # is_completed, exception, ...: the gloo request's
            return getattr(self._request, name)

    def _receive_to_host(group, tensors, src, tag=0):
        """ProcessGroup.recv into host buffers shaped as ``tensors``."""
        host = [torch.empty_like(tensor, device="cpu") for tensor in tensors]
        return _HostReceive(_recv(group, host, src, tag), host, tensors)

    dist.ProcessGroup.send, dist.ProcessGroup.recv = _send_from_host, _receive_to_host
