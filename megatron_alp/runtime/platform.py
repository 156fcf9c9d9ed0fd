"""Run Megatron-Core 0.16 on machines without a GPU.

Megatron-Core assumes CUDA: it asks ``torch.cuda.current_device()`` for the device of new
tensors, builds some tensors with a literal ``device="cuda"``, synchronises streams and keeps
its dropout RNG states in the CUDA generator. On a CPU-only machine (developer laptops, CI)
each of those fails. :func:`apply_cpu_shims` patches exactly these points so the real
Megatron-Core layers, parallel state and schedules run over the gloo backend; on a machine
with a GPU it does nothing. Every shim lives here, documented. What the project does
differently on a GPU (memory offload, NCCL, vLLM's sleep mode, engine settings) asks
:func:`has_gpu`, the one test of whether a GPU is present.

With ``MEGATRON_ALP_CHECK_COLLECTIVE_DEVICES=1`` the shims also track which tensors a GPU job
would hold on its GPU (``_GpuTrackingMode``), so that :mod:`megatron_alp.runtime.comm` can check every
collective's devices on a CPU job (:func:`~megatron_alp.runtime.parallel.init_distributed` installs
the checker when :func:`tracking_collectives`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
# Set when the collective-device checker runs (see check_requested and megatron_alp.runtime.comm).
_TRACKING = False
CHECK_ENV = "MEGATRON_ALP_CHECK_COLLECTIVE_DEVICES"


def has_gpu() -> bool:
    """True when CUDA is usable; every GPU/CPU branch in the project goes through this."""
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device new model tensors live on: the local GPU, or the CPU. Under the collective
    checker it is ``cuda:0``, which the shims place on the CPU while tracking it as a GPU tensor."""
    if has_gpu() or _TRACKING:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_requested() -> bool:
    """Whether this process runs the collective-device checker of :mod:`megatron_alp.runtime.comm`:
    ``MEGATRON_ALP_CHECK_COLLECTIVE_DEVICES=1`` on a CPU job (a GPU job checks itself)."""
    return os.environ.get(CHECK_ENV) == "1" and not has_gpu()


def tracking_collectives() -> bool:
    """Whether the applied shims track GPU-resident tensors for the collective-device checker."""
    return _TRACKING


def dist_backend() -> str:
    """nccl on GPUs, gloo elsewhere."""
    return "nccl" if has_gpu() else "gloo"


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Shim 2: rewrite ``device="cuda..."`` keywords and ``Tensor.cuda()`` to the CPU.

    Megatron-Core builds a few tensors with a literal CUDA device (the pipeline schedules'
    token counter, some masks). This is the mechanism ``torch.set_default_device`` uses, so it
    costs one Python call per torch function and touches nothing else.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Shim 7: Megatron's optimizers check `param.type() == "torch.cuda.FloatTensor"` (and the
            # Half/BFloat16 variants); report CPU tensors under the CUDA type names they stand for.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to:
            args = tuple(torch.device("cpu") if _is_cuda(a) else a for a in args)
        dev = kwargs.get("device")
        if dev is not None and (_is_cuda(dev) or isinstance(dev, int)):
            kwargs["device"] = torch.device("cpu")
        return func(*args, **kwargs)


class _TensorSet:
    """Tensors by identity, without keeping them alive (a ``WeakSet`` compares tensors with
    ``==``, which is elementwise)."""

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def __contains__(self, t) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t

    def add(self, t: torch.Tensor) -> bool:
        """Add ``t``; False if it was there already."""
        if t in self:
            return False
        self._refs[id(t)] = weakref.ref(t, functools.partial(self._drop, id(t)))
        return True

    def _drop(self, key: int, ref: weakref.ref) -> None:
        if self._refs.get(key) is ref:
            del self._refs[key]


# Under the collective checker: the tensors a GPU job would hold on its GPU, and those of them
# whose gradients are tracked too.
_ON_GPU = _TensorSet()
_GRAD_HOOKED = _TensorSet()
_GPU = torch.device("cuda", 0)
_DEVICE_GETTER = torch.Tensor.device.__get__


def on_accelerator(t: torch.Tensor) -> bool:
    """Whether a GPU job holds ``t`` on its GPU: ``t.is_cuda`` there; under the collective
    checker, whether the CPU shims tracked it as a GPU tensor (see ``_GpuTrackingMode``)."""
    return t.is_cuda or t in _ON_GPU


def place_on_device(module: torch.nn.Module) -> torch.nn.Module:
    """Move a freshly built model to this rank's GPU. A CPU job keeps it in place; under the
    collective checker its parameters and buffers are tracked as the GPU tensors they are on a
    GPU job."""
    if has_gpu():
        module.cuda(torch.cuda.current_device())
    elif _TRACKING:
        for t in (*module.parameters(), *module.buffers()):
            _ON_GPU.add(t)
    return module


def _gpu_like(dev) -> bool:
    """A device argument that means a GPU: a CUDA device or string, or a bare ordinal."""
    return _is_cuda(dev) or (isinstance(dev, int) and not isinstance(dev, bool))


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (x for x in v if isinstance(x, torch.Tensor))


def _track_grad(grad: torch.Tensor) -> None:
    _ON_GPU.add(grad)


def _tracking_parameter_new(new):
    """``Parameter(data)`` makes a new tensor object outside torch functions; it lives where its
    data does."""

    def __new__(cls, data=None, requires_grad=True):
        param = new(cls, data, requires_grad)
        if data is not None and data in _ON_GPU:
            _ON_GPU.add(param)
        return param

    return staticmethod(__new__)


def _move(func, args, kwargs):
    """``.cuda()``, ``.cpu()`` and ``.to(...)`` while tracking: the result is a GPU tensor when the
    target is the GPU (with no device given: when the source is), and a move between "devices"
    returns a copy, as it does on a GPU, so tracking the result never re-labels the source."""
    src = args[0]
    tracked = src in _ON_GPU
    if func is torch.Tensor.cuda:
        to_gpu, out = True, src
    else:
        target = None if func is torch.Tensor.cpu else kwargs.get("device", args[1] if len(args) > 1 else None)
        if func is torch.Tensor.cpu:
            to_gpu = False
        elif isinstance(target, torch.Tensor):
            to_gpu = target in _ON_GPU
        elif target is None or isinstance(target, (bool, torch.dtype)):
            to_gpu = tracked
        else:
            to_gpu = _gpu_like(target)
        cpu = torch.device("cpu")
        args = tuple(cpu if i == 1 and _gpu_like(a) else a for i, a in enumerate(args))
        if _gpu_like(kwargs.get("device")):
            kwargs = {**kwargs, "device": cpu}
        out = func(*args, **kwargs)
    if out is src and to_gpu != tracked:
        out = src.clone()
    if to_gpu:
        _ON_GPU.add(out)
    return out


class _GpuTrackingMode(_CudaToCpuMode):
    """Shim 2 under the collective checker: also track which tensors a GPU job holds on the GPU.

    Tracked: tensors created on a CUDA device (a CUDA ``device=``, an ordinal such as
    ``torch.cuda.current_device()``), moved there (``.cuda()``, ``.to("cuda")``), models placed by
    :func:`place_on_device`, the outputs of any torch function with a tracked input (in-place
    results keep their own device), and the gradients of tracked tensors (autograd makes those
    outside torch functions, so a hook tracks them). A tracked tensor reports ``device`` cuda:0, as
    on a GPU, so ``device=x.device`` allocations follow it. Costs several Python calls per torch
    function: the normal CPU path uses the plain shim.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE_GETTER:
            return _GPU if args[0] in _ON_GPU else func(*args)
        if func is torch.Tensor.cuda or func is torch.Tensor.cpu or func is torch.Tensor.to:
            return _move(func, args, kwargs)
        dev = kwargs.get("device")
        inputs = [*_tensors(args), *_tensors(kwargs.values())]
        out = super().__torch_function__(func, types, args, kwargs)
        results = (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (list, tuple)) else ()
        outputs = [t for t in _tensors(results) if not any(t is i for i in inputs)]
        if _gpu_like(dev) if dev is not None else any(t in _ON_GPU for t in inputs):
            for t in outputs:
                _ON_GPU.add(t)
        if torch.is_grad_enabled():
            for t in (*inputs, *outputs):
                if t.requires_grad and t in _ON_GPU and _GRAD_HOOKED.add(t):
                    t.register_hook(_track_grad)
        return out


class _RngShim:
    """Shim 4: Megatron's RNG tracker keeps named "CUDA" generator states for dropout and
    activation recomputation. On the CPU those states are the CPU default generator's, so forking
    a tracker state (for example the ALP noise stream) and restoring it on recompute behaves as
    on a GPU."""

    @staticmethod
    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)


class _NullStream:
    """Shim 5: one stand-in for every CUDA stream and event. CPU work is synchronous, so waiting on
    or recording a stream is a no-op; a single instance makes "current stream" and "side stream"
    compare equal, so Megatron's MoE token dispatcher takes its same-stream path. It is a class
    (not a factory function) because libraries imported after the shims annotate with
    ``torch.cuda.Stream | None`` at import time (transformers, vLLM)."""

    _instance = None
    device = torch.device("cpu")

    def __new__(cls, *args, **kwargs):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def wait_stream(self, other):
        return None

    def record_event(self, event=None):
        return self

    def synchronize(self):
        return None

    def wait_event(self, event):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def query(self):
        return True


_NULL_STREAM = _NullStream()


def _null_streams() -> None:
    """Shim 5: CUDA streams/events used by the MoE dispatchers (see _NullStream)."""
    torch.cuda.Stream = _NullStream
    torch.cuda.current_stream = lambda *a, **k: _NULL_STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def reclaim_cpu_streams() -> None:
    """Put shim 5 back after vLLM's CPU worker was imported into this process (an in-process
    engine): that module installs stream stand-ins of its own in ``torch.cuda``, whose
    ``record_event`` returns None, and a Megatron MoE layer built afterwards (a reference model, a
    later command in the same process) dies waiting on that None. The shim's stream does all the
    worker asks of its own. A no-op where the shims are not applied."""
    if _APPLIED:
        _null_streams()


def _fix_missing_te_names() -> None:
    """Megatron-Core 0.16.1's MoE router reads ``te_general_gemm`` without defining it when
    Transformer Engine is absent (NameError); define it as None, its own "TE absent" value."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _fix_adam_step_restore() -> None:
    """Without Apex and TE, Megatron-Core 0.16's DistributedOptimizer uses torch's AdamW, whose
    per-parameter state has a ``step``; loading a checkpoint copies each checkpointed tensor into
    *all* state keys, ``step`` included, which no checkpoint holds. Copy the others only."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    if distrib_optimizer.HAVE_APEX_OR_TE or getattr(cls, "_megatron_alp_step_fix", False):
        return
    original = cls._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            return original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    cls._set_main_param_and_optimizer_states = set_states
    cls._megatron_alp_step_fix = True


def apply_cpu_shims() -> bool:
    """Apply the CPU shims once per process when no GPU is present; returns whether applied.
    The fixes for an absent Transformer Engine / Apex apply on every machine."""
    global _APPLIED, _TRACKING
    _fix_missing_te_names()
    _fix_adam_step_restore()
    if _APPLIED or has_gpu():
        return _APPLIED
    from megatron.core.tensor_parallel import random as mcore_random

    _TRACKING = check_requested()
    # Shim 1: new tensors placed on "the current CUDA device" go to the CPU (under the collective
    # checker: device 0, which shim 2 places on the CPU and tracks as a GPU tensor).
    torch.cuda.current_device = (lambda: 0) if _TRACKING else (lambda: "cpu")
    # Shim 2: literal CUDA devices become the CPU (see _CudaToCpuMode and _GpuTrackingMode).
    (_GpuTrackingMode() if _TRACKING else _CudaToCpuMode()).__enter__()
    if _TRACKING:
        torch.nn.Parameter.__new__ = _tracking_parameter_new(torch.nn.Parameter.__new__)
    # Shim 3: there is nothing to synchronise; p2p communication and timers call these.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    _null_streams()
    # Shim 6: the MoE all-to-all dispatcher turns split sizes into host numpy arrays by copying
    # them off the GPU; on the CPU no copy happens and torch's all_to_all_single then rejects the
    # tensors, so do the numpy conversion here too.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def _to_host(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = _to_host
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    # Shim 4: the RNG tracker's "CUDA" states are the CPU generator's (see _RngShim).
    torch.cuda.get_rng_state = _RngShim.get_rng_state
    torch.cuda.random.get_rng_state = _RngShim.get_rng_state
    torch.cuda.manual_seed = _RngShim.manual_seed
    mcore_random._set_cuda_rng_state = _RngShim.set_rng_state
    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    # The tracker warns when the CPU RNG moves inside a fork; on the CPU that is the fork's
    # purpose, so the warning carries no information here.
    logging.getLogger(mcore_random.__name__).setLevel(logging.ERROR)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    _APPLIED = True
    return True
