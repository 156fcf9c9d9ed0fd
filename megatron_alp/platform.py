"""Run Megatron-Core 0.16 on machines without a GPU.

Megatron-Core assumes CUDA: it asks ``torch.cuda.current_device()`` for the device of new
tensors, builds some tensors with a literal ``device="cuda"``, synchronises streams and keeps
its dropout RNG states in the CUDA generator. On a CPU-only machine (developer laptops, CI)
each of those fails. :func:`apply_cpu_shims` patches exactly these points so the real
Megatron-Core layers, parallel state and schedules run over the gloo backend; on a machine
with a GPU it does nothing. Keep every shim here, documented, so nothing else in the
project needs to know whether a GPU is present.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


def has_gpu() -> bool:
    """True when CUDA is usable; every GPU/CPU branch in the project goes through this."""
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device new model tensors live on: the local GPU, or the CPU."""
    if has_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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

    def query(self):
        return True


_NULL_STREAM = _NullStream()


def _fix_missing_te_names() -> None:
    """Megatron-Core 0.16.1's MoE router reads ``te_general_gemm`` without defining it when
    Transformer Engine is absent (NameError); define it as None, its own "TE absent" value."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply_cpu_shims() -> bool:
    """Apply the CPU shims once per process when no GPU is present; returns whether applied.
    The Transformer-Engine-absent fix applies on every machine."""
    global _APPLIED
    _fix_missing_te_names()
    if _APPLIED or has_gpu():
        return _APPLIED
    from megatron.core.tensor_parallel import random as mcore_random

    # Shim 1: new tensors placed on "the current CUDA device" go to the CPU.
    torch.cuda.current_device = lambda: "cpu"
    # Shim 2: literal CUDA devices become the CPU (see _CudaToCpuMode).
    _CudaToCpuMode().__enter__()
    # Shim 3: there is nothing to synchronise; p2p communication and timers call these.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    # Shim 5: CUDA streams/events used by the MoE dispatchers (see _NullStream).
    torch.cuda.Stream = _NullStream
    torch.cuda.current_stream = lambda *a, **k: _NULL_STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
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
