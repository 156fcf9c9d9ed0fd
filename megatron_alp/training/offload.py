"""Colocated GPU memory: Megatron's training state leaves the GPU while the rollout engine generates.

The engine and the trainer share each GPU. vLLM needs ``gpu_memory_utilization x total`` free when
it wakes up, and Megatron's parameters, gradient buffers and optimizer state (for a bf16 model:
2 + 4 + 12 bytes per parameter, fewer with the distributed optimizer) would otherwise stay
resident through every rollout. :class:`TrainingStateOffloader` frees each kind where a phase
does not need it and brings it back for the phase that does (the trainer's phase table,
megatron_alp/trainer/phases.py: the weights for the logprob passes and the weight sync, all three
for the update):

- weights and optimizer state (Adam moments, fp32 master weights) are copied to CPU memory
  (pinned on GPUs, allocated once and reused) and their GPU storage is released;
- gradient buffers are released without a copy: every optimizer step starts by zeroing them, so
  they are reallocated as zeros.

The phase table names kinds (:data:`KINDS`); ``weights`` stands for the policy's weights and the
reference model's, ``policy`` for the policy's alone (:data:`PARTS`), so a phase can leave the
reference away (the checkpoint save).

Storage is released with ``untyped_storage().resize_(0)`` (as Megatron's own buffer offload does),
so every view (``param.data`` inside DDP's buffers, ``param.main_grad``, the optimizer's shards)
stays the same object and is valid again after :meth:`reload`. Nothing may read a released kind
in between. Each kind is optional (``rollout.offload_weights``, ``offload_grads``,
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
# what each name of the phase table moves: the offloader's parts, in the order it moves them
PARTS = {"weights": ("policy", "reference"), "policy": ("policy",), "grads": ("grads",), "optimizer": ("optimizer",)}
PART_ORDER = ("policy", "reference", "grads", "optimizer")


def parts_of(kinds: Iterable[str]) -> tuple[str, ...]:
    """The parts (policy, reference, grads, optimizer) that the phase table's names ``kinds`` stand for."""
    wanted = {part for kind in kinds for part in PARTS[kind]}
    return tuple(part for part in PART_ORDER if part in wanted)


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None  # the CPU copy (None for gradients: they come back as zeros)


@dataclass
class TrainingStateOffloader:
    """Frees the chosen kinds of Megatron state from the accelerator between :meth:`offload` and
    :meth:`reload`, each part on its own (a phase may need the weights back but not the optimizer).
    ``models``: the DDP-wrapped model chunks; ``optimizer``: Megatron's optimizer; ``kinds``: those
    that may leave (of :data:`KINDS`); ``reference``: the frozen reference model's chunks, which
    leave and come back with the ``weights``."""

    models: list
    optimizer: object
    kinds: tuple[str, ...] = KINDS
    reference: list = field(default_factory=list)
    _held: dict[str, list[_Held]] = field(default_factory=dict)  # part -> its released storages
    _host: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # part -> reusable CPU buffers, in order

    def __post_init__(self):
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"offload kinds {sorted(unknown)} unknown; expected some of {KINDS}")

    @property
    def offloaded(self) -> tuple[str, ...]:
        """The parts whose storage is released now."""
        return tuple(p for p in PART_ORDER if p in self._held)

    def offload(self, kinds: Optional[Iterable[str]] = None) -> dict[str, float]:
        """Copy weights/optimizer state to the host and release their (and the gradients') storage:
        ``kinds`` of the offloadable ones (default: all), the parts not already released."""
        allowed = parts_of(self.kinds)
        todo = [p for p in parts_of(self.kinds if kinds is None else kinds) if p in allowed and p not in self._held]
        t0 = time.perf_counter()
        moved = freed = 0
        _synchronize()
        for part, storages in self._storages(todo).items():
            held = self._held.setdefault(part, [])
            for index, storage in enumerate(storages):
                item = _Held(storage, storage.nbytes())
                if part != "grads":
                    item.host = self._host_buffer(part, index, item.nbytes)
                    item.host.copy_(_bytes(storage), non_blocking=True)
                    moved += item.nbytes
                held.append(item)
        _synchronize()
        for part in todo:
            for item in self._held.get(part, ()):
                item.storage.resize_(0)
                freed += item.nbytes
        if has_gpu():
            torch.cuda.empty_cache()
        return {"offload/bytes_moved": float(moved), "offload/bytes_freed": float(freed),
                "offload/seconds": time.perf_counter() - t0}

    def reload(self, kinds: Optional[Iterable[str]] = None) -> dict[str, float]:
        """Reallocate the released storages of ``kinds`` (default: all) and copy the host state back
        (gradients as zeros)."""
        t0 = time.perf_counter()
        moved = 0
        for part in [p for p in parts_of(KINDS if kinds is None else kinds) if p in self._held]:
            for held in self._held.pop(part):
                held.storage.resize_(held.nbytes)
                view = _bytes(held.storage)
                if held.host is None:
                    view.zero_()
                else:
                    view.copy_(held.host, non_blocking=True)
                    moved += held.nbytes
        _synchronize()
        return {"reload/bytes_moved": float(moved), "reload/seconds": time.perf_counter() - t0}

    def resident_bytes(self) -> dict[str, int]:
        """Bytes each kind holds on its device now, read from the storages themselves (the weights:
        the policy's and the reference's)."""
        out = dict.fromkeys(KINDS, 0)
        for part, storages in self._storages(PART_ORDER, live_only=False).items():
            out["weights" if part in PARTS["weights"] else part] += sum(s.nbytes() for s in storages)
        return out

    # ---------------------------------------------------------------------------- what to move

    def _storages(self, parts: Iterable[str], live_only: bool = True) -> dict[str, list[torch.UntypedStorage]]:
        """Each storage of ``parts`` once (views of one buffer share a storage), in a stable order;
        a storage used by two parts (an fp32 model's optimizer updates the parameters themselves)
        counts as the first: policy, reference, gradients, optimizer. ``live_only``: skip released ones."""
        seen: set[int] = set()
        out: dict[str, list[torch.UntypedStorage]] = {}
        for part, tensors in (("policy", self._weights(self.models)), ("reference", self._weights(self.reference)),
                              ("grads", self._grads()), ("optimizer", self._optimizer_state())):
            for t in tensors:
                storage = t.untyped_storage()
                key = storage._cdata  # the storage itself: a released one has no data pointer to tell it apart
                if key in seen:
                    continue
                seen.add(key)
                if part in parts and (storage.nbytes() or not live_only):
                    out.setdefault(part, []).append(storage)
        return out

    @staticmethod
    def _weights(chunks: list) -> Iterable[torch.Tensor]:
        for chunk in chunks:
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

    def _host_buffer(self, part: str, index: int, nbytes: int) -> torch.Tensor:
        """The ``index``-th copied storage of ``part``'s CPU buffer: pinned memory is slow to
        allocate, and the same storages come in the same order every time, so each buffer is reused."""
        buffers = self._host.setdefault(part, [])
        if index == len(buffers):
            buffers.append(torch.empty(0, dtype=torch.uint8))
        if buffers[index].numel() != nbytes:
            buffers[index] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=has_gpu())
        return buffers[index]


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 view of the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _synchronize() -> None:
    if has_gpu():
        torch.cuda.synchronize()


def offloader_for(cfg: RolloutConfig, chunks: list, optimizer, reference: Optional[list] = None,
                  on_cpu: bool = False) -> Optional[TrainingStateOffloader]:
    """The offloader of a colocated GPU run (``rollout.offload_*`` kinds of the model ``chunks``, the
    ``reference`` chunks and the optimizer), or None where nothing leaves the GPU (the CPU, separate
    placement, engines that do not sleep, every kind off). ``on_cpu``: run the same moves on the CPU
    (they free nothing useful there, but prove the phases move what the table says; ``trainer.phase_ledger``)."""
    kinds = tuple(kind for kind, on in zip(KINDS, (cfg.offload_weights, cfg.offload_grads, cfg.offload_optimizer))
                  if on)
    if (has_gpu() or on_cpu) and cfg.free_memory_during_training and kinds and cfg.placement == "colocated":
        return TrainingStateOffloader(chunks, optimizer, kinds, reference or [])
    return None
