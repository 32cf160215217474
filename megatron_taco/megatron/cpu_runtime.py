"""Run megatron-core (0.16-0.19) on CPU with gloo, for tests and CPU demos.

megatron-core assumes CUDA in a handful of places: the model-parallel RNG
tracker forks CUDA generators, buffers are allocated on
``torch.cuda.current_device()``, ``pipeline_parallel/schedules.py`` builds
tensors with ``device="cuda"``, and the 0.17+ DDP wrapper calls
``torch.cuda.current_stream()`` unconditionally (and P2P shape exchange calls
``torch.cuda.synchronize()``); the distributed optimizer accepts parameters only
if their type names are ``torch.cuda.*Tensor``. ``enable_cpu_runtime()``
redirects exactly those, and only when CUDA is absent: it refuses to run on a
machine with a GPU, where the real CUDA paths must be used.

Models built under it also need :func:`cpu_config_overrides` in their
``TransformerConfig`` (the fused CUDA kernels off, CPU initialisation).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Dict, Iterator

import torch

__all__ = ["enable_cpu_runtime", "cpu_config_overrides"]

_ENABLED = False


class CpuRNGStatesTracker:
    """Drop-in for megatron-core's ``CudaRNGStatesTracker`` that forks CPU generator states.

    Tensor-parallel regions (e.g. dropout inside TP-sharded layers) draw from a
    named state forked here, exactly as the CUDA tracker does on GPU.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: set = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> Dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class _NullStream:
    """Stand-in for a CUDA stream on CPU: waits, records and syncs do nothing."""

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> None:
        return None

    def synchronize(self) -> None:
        pass


def _cpu_factory(fn: Callable) -> Callable:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapped


def _redirect_cuda_factories(module: types.ModuleType) -> None:
    """Give ``module`` a private ``torch`` whose tensor factories map device='cuda' to CPU."""
    proxy = types.ModuleType(f"{module.__name__}.torch_on_cpu")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # PEP 562
    for name in ("zeros", "ones", "empty", "full", "tensor", "arange"):
        setattr(proxy, name, _cpu_factory(getattr(torch, name)))
    module.torch = proxy


_MODULES_WITH_CUDA_LITERALS = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.transformer.utils",
    "megatron.core.utils",
)


def _clip_grads_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    """CPU version of megatron-core's ``clip_grad_by_total_norm_fp32`` (same arithmetic)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _distributed_optimizer_takes_cpu_parameters() -> None:
    """megatron-core's ``DistributedOptimizer._build_model_and_main_param_groups`` with the CPU tensor types in its
    type checks (``'torch.cuda.FloatTensor'`` -> ``'torch.FloatTensor'``, likewise half and bfloat16): its own
    source, recompiled; nothing else changes."""
    import inspect
    import textwrap

    from megatron.core.optimizer import distrib_optimizer

    name = "_build_model_and_main_param_groups"
    wrapper = inspect.getattr_static(distrib_optimizer.DistributedOptimizer, name)  # a classmethod / staticmethod
    lines, first = inspect.getsourcelines(wrapper.__func__)
    decorators = sum(1 for line in lines if line.lstrip().startswith("@"))  # re-applied below
    source = textwrap.dedent("".join(lines[decorators:]))
    for kind in ("Float", "Half", "BFloat16"):
        source = source.replace(f"'torch.cuda.{kind}Tensor'", f"'torch.{kind}Tensor'")
    source = "\n" * (first - 1 + decorators) + source  # tracebacks keep the file's line numbers
    namespace: Dict[str, Any] = {}
    exec(compile(source, inspect.getsourcefile(wrapper.__func__), "exec"), vars(distrib_optimizer), namespace)
    setattr(distrib_optimizer.DistributedOptimizer, name, type(wrapper)(namespace[name]))


def enable_cpu_runtime() -> None:
    """Make megatron-core's CUDA-only paths work on CPU. Idempotent; refuses on a CUDA machine."""
    global _ENABLED
    if _ENABLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "megatron_taco: enable_cpu_runtime() is for machines without CUDA; "
            "this machine has a GPU, use the NCCL/CUDA path instead"
        )
    import importlib

    from megatron.core.optimizer import optimizer as mp_optimizer
    from megatron.core.tensor_parallel import random as mp_random

    # initialize_rng_tracker() instantiates this class; model_parallel_cuda_manual_seed
    # seeds the data-parallel stream with torch.cuda.manual_seed, a no-op without CUDA.
    mp_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    mp_random._CUDA_RNG_STATE_TRACKER = None
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    torch.cuda.manual_seed = torch.manual_seed
    # Buffers (DDP grad buffers, p2p receive buffers) are allocated on current_device().
    torch.cuda.current_device = lambda: "cpu"
    for name in _MODULES_WITH_CUDA_LITERALS:
        _redirect_cuda_factories(importlib.import_module(name))
    # The clipping helper asserts grads are torch.cuda.FloatTensor; optimizer.py holds it by name.
    mp_optimizer.clip_grad_by_total_norm_fp32 = _clip_grads_by_total_norm
    torch.cuda.current_stream = lambda *args, **kwargs: _NullStream()
    # p2p shape exchange (variable_seq_lengths) synchronizes the device: nothing to wait for on CPU
    torch.cuda.synchronize = lambda *args, **kwargs: None
    _distributed_optimizer_takes_cpu_parameters()
    _ENABLED = True


def cpu_config_overrides() -> Dict[str, Any]:
    """TransformerConfig fields that must be set for megatron-core models on CPU.

    (On top of ``specs.LOCAL_SPEC_CONFIG``: the jit-fused bias-dropout and batched
    p2p sync are CUDA-only.)
    """
    return dict(use_cpu_initialization=True, batch_p2p_sync=False, bias_dropout_fusion=False)
