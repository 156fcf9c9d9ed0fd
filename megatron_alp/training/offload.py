"""Colocated GPU memory: Megatron's training state leaves the GPU while the rollout engine generates.

The engine and the trainer share each GPU. vLLM needs ``gpu_memory_utilization x total`` free when
it wakes up, and Megatron's parameters, gradient buffers and optimizer state (for a bf16 model:
2 + 4 + 12 bytes per parameter, fewer with the distributed optimizer) would otherwise stay
resident through every rollout. :class:`TrainingStateOffloader` frees them for the rollout and
brings them back before the logprob passes:

- weights and optimizer state (Adam moments, fp32 master weights) are copied to CPU memory
  (pinned on GPUs, allocated once and reused) and their GPU storage is released;
- gradient buffers are released without a copy: every optimizer step starts by zeroing them, so
  they are reallocated as zeros.

Storage is released with ``untyped_storage().resize_(0)`` (as Megatron's own buffer offload does),
so every view (``param.data`` inside DDP's buffers, ``param.main_grad``, the optimizer's shards)
stays the same object and is valid again after :meth:`reload`. Nothing may read the model in
between. Each kind is optional (``rollout.offload_weights``, ``offload_grads``,
``offload_optimizer``); the allocator cache is emptied after the offload so the engine gets the
memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from megatron_alp.config import RolloutConfig
from megatron_alp.runtime.platform import has_gpu

KINDS = ("weights", "grads", "optimizer")


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    kind: str
    host: torch.Tensor | None = None  # the CPU copy (None for gradients: they come back as zeros)


@dataclass
class TrainingStateOffloader:
    """Frees the chosen kinds of Megatron state from the accelerator between :meth:`offload` and
    :meth:`reload`. ``models``: the DDP-wrapped model chunks; ``optimizer``: Megatron's optimizer."""

    models: list
    optimizer: object
    kinds: tuple[str, ...] = KINDS
    _held: list[_Held] = field(default_factory=list)
    _host: list[torch.Tensor] = field(default_factory=list)  # reusable CPU buffers, in storage order

    def __post_init__(self):
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"offload kinds {sorted(unknown)} unknown; expected some of {KINDS}")

    @property
    def offloaded(self) -> bool:
        return bool(self._held)

    def offload(self) -> dict[str, float]:
        """Copy weights/optimizer state to the host and release their (and the gradients') storage."""
        if self._held:
            raise RuntimeError("training state is already offloaded")
        t0 = time.perf_counter()
        moved = 0
        _synchronize()
        for storage, kind in self._storages():
            held = _Held(storage, storage.nbytes(), kind)
            if kind != "grads":
                held.host = self._host_buffer(sum(h.host is not None for h in self._held), held.nbytes)
                held.host.copy_(_bytes(storage), non_blocking=True)
                moved += held.nbytes
            self._held.append(held)
        _synchronize()
        freed = 0
        for held in self._held:
            held.storage.resize_(0)
            freed += held.nbytes
        if has_gpu():
            torch.cuda.empty_cache()
        return {"offload/bytes_moved": float(moved), "offload/bytes_freed": float(freed),
                "offload/seconds": time.perf_counter() - t0}

    def reload(self) -> dict[str, float]:
        """Reallocate every released storage and copy the host state back (gradients as zeros)."""
        t0 = time.perf_counter()
        moved = 0
        for held in self._held:
            held.storage.resize_(held.nbytes)
            view = _bytes(held.storage)
            if held.host is None:
                view.zero_()
            else:
                view.copy_(held.host, non_blocking=True)
                moved += held.nbytes
        _synchronize()
        self._held.clear()
        return {"reload/bytes_moved": float(moved), "reload/seconds": time.perf_counter() - t0}

    # ---------------------------------------------------------------------------- what to move

    def _storages(self) -> Iterable[tuple[torch.UntypedStorage, str]]:
        """Each live storage of the chosen kinds once (views of one buffer share a storage); a
        storage used by two kinds (an fp32 model's optimizer updates the parameters themselves)
        counts as the first: weights, then gradients, then optimizer."""
        seen: set[int] = set()
        for kind, tensors in (("weights", self._weights()), ("grads", self._grads()),
                              ("optimizer", self._optimizer_state())):
            for t in tensors:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in seen or storage.nbytes() == 0:
                    continue
                seen.add(key)
                if kind in self.kinds:
                    yield storage, kind

    def _weights(self) -> Iterable[torch.Tensor]:
        for chunk in self.models:
            yield from chunk.parameters()
            yield from torch.nn.Module.buffers(chunk)  # Megatron's DDP shadows `buffers` with its grad buffers

    def _grads(self) -> Iterable[torch.Tensor]:
        for chunk in self.models:
            ddp_buffers = chunk.buffers if isinstance(chunk.buffers, list) else []
            for buffer in ddp_buffers + getattr(chunk, "expert_parallel_buffers", []):
                if buffer.grad_data is not None:
                    yield buffer.grad_data
            for p in chunk.parameters():
                for grad in (getattr(p, "main_grad", None), p.grad):
                    if grad is not None:
                        yield grad

    def _optimizer_state(self) -> Iterable[torch.Tensor]:
        for sub in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(sub, "optimizer", sub)
            for group in inner.param_groups:
                yield from group["params"]  # fp32 master weights (the model's own for fp32 models)
            for state in inner.state.values():
                yield from (v for v in state.values() if torch.is_tensor(v) and v.numel() > 1)

    def _host_buffer(self, index: int, nbytes: int) -> torch.Tensor:
        """The ``index``-th copied storage's CPU buffer: pinned memory is slow to allocate, and the
        same storages come in the same order every iteration, so each buffer is reused."""
        if index == len(self._host):
            self._host.append(torch.empty(0, dtype=torch.uint8))
        if self._host[index].numel() != nbytes:
            self._host[index] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=has_gpu())
        return self._host[index]


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 view of the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _synchronize() -> None:
    if has_gpu():
        torch.cuda.synchronize()


def offloader_for(cfg: RolloutConfig, chunks: list, optimizer) -> Optional[TrainingStateOffloader]:
    """The offloader of a colocated GPU run (``rollout.offload_*`` kinds of the model ``chunks`` and
    the optimizer), or None where nothing leaves the GPU (the CPU, separate placement, engines that
    do not sleep, every kind off)."""
    kinds = tuple(kind for kind, on in zip(KINDS, (cfg.offload_weights, cfg.offload_grads, cfg.offload_optimizer))
                  if on)
    if has_gpu() and cfg.free_memory_during_training and kinds and cfg.placement == "colocated":
        return TrainingStateOffloader(chunks, optimizer, kinds)
    return None
