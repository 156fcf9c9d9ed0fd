"""The device of every collective's tensors, decided per process group, and a checker for it.

NCCL moves accelerator tensors only, gloo CPU tensors. On a GPU job the default process group and
Megatron's groups are NCCL, so a CPU tensor reduced over one of them fails there ("No backend type
associated with device type cpu") while every CPU run, all gloo, passes. :func:`comm_device` is
the one rule: the CPU for a gloo group, the accelerator for any other. Each tensor collective of
ours builds its tensors on ``comm_device(group)`` and brings results back to the CPU where the
caller wants host values; :func:`cpu_group` makes a gloo group for CPU tensors and Python objects
on any job. Object collectives (``broadcast_object_list``, ``all_gather_object``) place their
buffers on their group's device themselves, so they work over either backend.

The checker makes the rule testable without a GPU: with ``MEGATRON_ALP_CHECK_COLLECTIVE_DEVICES=1``
on a CPU job, the CPU shims track which tensors a GPU job would hold on its GPU
(:func:`megatron_alp.runtime.platform.on_accelerator`), groups created with ``backend="gloo"`` are
recorded as gloo (every other group is NCCL on a GPU job), and every tensor collective of
``torch.distributed`` raises :class:`CollectiveDeviceError` for a tensor whose device would not
suit its group's backend on a GPU job.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import traceback
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megatron_alp.runtime import platform
from megatron_alp.runtime.platform import device as accelerator
from megatron_alp.runtime.platform import has_gpu, on_accelerator

# Groups that are gloo on any job: made by cpu_group and, under the checker, every group created
# with backend="gloo" (Megatron's gloo groups among them).
_GLOO_GROUPS: weakref.WeakSet = weakref.WeakSet()
_INSTALLED = False


def cpu_group(**new_group_kwargs) -> dist.ProcessGroup:
    """A gloo group (``dist.new_group`` keywords but ``backend``) for CPU tensors and Python objects,
    on any job: its collectives never touch the GPU."""
    group = dist.new_group(backend="gloo", **new_group_kwargs)
    _GLOO_GROUPS.add(group)
    return group


def comm_device(group=None) -> torch.device:
    """The device a collective over ``group`` (None: the default group) takes its tensors on: the
    CPU for a gloo group, else the accelerator (the GPU; the CPU on a CPU job)."""
    if group in _GLOO_GROUPS or (has_gpu() and dist.is_initialized() and dist.get_backend(group) == "gloo"):
        return torch.device("cpu")
    return accelerator()


# ------------------------------------------------------------------------------- the checker


class CollectiveDeviceError(RuntimeError):
    """A collective got a tensor whose device its group's backend would refuse on a GPU job."""


_TENSOR_COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter",
    "send", "recv", "isend", "irecv",
)
_OBJECT_COLLECTIVES = (
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
)
_TORCH_DISTRIBUTED = str(Path(dist.__file__).parent)
# Frames between a caller and the check: this module, and torch's __torch_function__ dispatch
# through the shims' mode (a collective function captured before the checker was installed).
_NOT_CALLERS = {__file__, platform.__file__, torch.overrides.__file__}
_state = threading.local()


def install_checker() -> None:
    """Record gloo groups and check every tensor collective of torch.distributed, once per process;
    :func:`~megatron_alp.runtime.parallel.init_distributed` calls it when the CPU shims track GPU
    tensors (:func:`megatron_alp.runtime.platform.check_requested`). ``batch_isend_irecv`` runs
    each op through the checked ``isend``/``irecv``."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    _patch("new_group", _recording(distributed_c10d.new_group))
    for name in _TENSOR_COLLECTIVES:
        _patch(name, _checked(name, getattr(distributed_c10d, name)))
    for name in _OBJECT_COLLECTIVES:
        _patch(name, _object_collective(getattr(distributed_c10d, name)))


def _patch(name: str, fn) -> None:
    """Replace ``name`` in torch.distributed and in distributed_c10d, whose own code looks its
    functions up there (P2POp accepts only the module's ``isend``/``irecv``)."""
    setattr(distributed_c10d, name, fn)
    setattr(dist, name, fn)


def _recording(new_group):
    signature = inspect.signature(new_group)

    @functools.wraps(new_group)
    def recording_new_group(*args, **kwargs):
        group = new_group(*args, **kwargs)
        if signature.bind(*args, **kwargs).arguments.get("backend") == "gloo" and isinstance(group, dist.ProcessGroup):
            _GLOO_GROUPS.add(group)
        return group

    return recording_new_group


@contextlib.contextmanager
def _inside_collective():
    """Collectives run inside another (through torch's ``__torch_function__`` dispatch, or an
    object collective's transfer of its pickled bytes) are not checked again."""
    outer = getattr(_state, "inside", False)
    _state.inside = True
    try:
        yield
    finally:
        _state.inside = outer


def _object_collective(fn):
    """Object collectives put their pickled bytes on their group's device themselves."""

    @functools.wraps(fn)
    def object_collective(*args, **kwargs):
        with _inside_collective():
            return fn(*args, **kwargs)

    return object_collective


def _checked(name: str, fn):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        if getattr(_state, "inside", False):
            return fn(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs).arguments
        for value in arguments.values():
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    check_tensor(name, arguments.get("group"), t)
        with _inside_collective():
            return fn(*args, **kwargs)

    return checked


def check_tensor(collective: str, group, t: torch.Tensor) -> None:
    """Raise :class:`CollectiveDeviceError` unless a GPU job would hold ``t`` on the device
    :func:`comm_device` gives for ``group``."""
    gloo = comm_device(group).type == "cpu"
    on_gpu = on_accelerator(t)
    if on_gpu == gloo:
        raise CollectiveDeviceError(
            f"{collective} at {_caller()}: a tensor (shape {tuple(t.shape)}, {t.dtype}) that a GPU job holds on "
            f"the {'GPU' if on_gpu else 'CPU'}, over a group whose backend there is {'gloo' if gloo else 'NCCL'}; "
            f"build the collective's tensors on megatron_alp.runtime.comm.comm_device(group)"
        )


def _caller() -> str:
    """file:line of the innermost frame outside torch.distributed and the checker."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename not in _NOT_CALLERS and not frame.filename.startswith(_TORCH_DISTRIBUTED):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "?"
