"""Weights to an engine in other processes by a collective broadcast (``rollout.sync_method: broadcast``).

For engines that share neither memory nor a GPU with the trainer (replicas on their own GPUs or
CPU cores, as in NeMo-RL's and verl's non-colocated modes). The replica leader (the trainer
process that started the engine) and the engine's workers form a process group of their own:
the leader is rank 0, engine worker ``i`` rank ``1 + i``. Each bucket of whole layers
(:func:`~megatron_alp.rollout.weight_sync.layer_buckets`) travels as one flat uint8 buffer
broadcast from the leader; its metadata (names, dtypes, shapes, offsets:
:func:`~megatron_alp.rollout.weight_sync.bucket_layout`) goes with the control call that tells
the workers to receive it. NCCL carries CUDA tensors, gloo CPU tensors.

The group: both ends construct torch's ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` directly on a
``TCPStore`` the leader opens on a free port of its host (the engine's processes are its
children, on the same host). Such a group is never registered with torch.distributed, so the
trainer's default group (Megatron's, under torchrun) and vLLM's own in its workers stay as they
are, and a broken group is dropped with its object. vLLM's ``StatelessProcessGroup`` +
``PyNcclCommunicator`` (NeMo-RL's choice) would not do here: the former exchanges Python objects
through the store only (no gloo tensor broadcast for CPU engines), the latter is CUDA-only and
its operations have neither a timeout nor an abort. torch's groups give both backends behind one
API, per-operation timeouts and (NCCL) an abort, without vLLM in the trainer's code.

Coordination: a control call to the workers (vLLM's ``collective_rpc``) returns only when the
workers are done, and the workers wait in the broadcast until the leader sends, so each step runs
the control call and the leader's part on two threads and waits for both, with a deadline and a
check that the engine is still alive. A dead engine (its connections close), a failed control
call or the deadline raises :class:`BroadcastError` at once; the group is then unusable and is
closed, and the engine's owner restarts the engine, whose new workers join a new group.
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_alp.rollout.weight_sync import bucket_layout, bucket_views, pack_bucket

# How often the leader, while waiting for a step, checks that the engine is alive.
_POLL_S = 0.05


class BroadcastError(RuntimeError):
    """A broadcast step failed (engine died, a side raised, deadline passed); the group is closed."""


def _backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _new_group(backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def _broadcast(group, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` from rank 0, returning when it is complete on this rank."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def _buffer(current: Optional[torch.Tensor], nbytes: int, device: torch.device) -> torch.Tensor:
    """``current`` when it is on ``device`` and holds ``nbytes``, else a new uint8 buffer with room to
    grow (buckets end on layer boundaries, so their sizes vary)."""
    if current is not None and current.device == device and current.numel() >= nbytes:
        return current
    return torch.empty(max(int(nbytes * 1.25), 1 << 16), dtype=torch.uint8, device=device)


def _handshake(group, spec: dict, device: torch.device) -> None:
    """One small broadcast through the new group: it connects NCCL's communicator (lazily built at
    the first operation) inside the join step, and proves both ends joined the same group."""
    token = torch.tensor([spec["port"], spec["size"]], dtype=torch.int64, device=device)
    if group.rank() != 0:
        token.zero_()
    _broadcast(group, token)
    if token.tolist() != [spec["port"], spec["size"]]:
        raise BroadcastError(f"weight broadcast group on port {spec['port']}: handshake received {token.tolist()}")


class BroadcastSender:
    """The replica leader's end (rank 0) of the group of one engine.

    ``workers``: the engine's worker processes (its tensor-parallel size); ``timeout_s``: the limit
    of each step (joining, one bucket); ``alive``: whether the engine's processes still run. The
    group is built at the first :meth:`send`, with the backend of the bucket's device. CPU buckets
    are packed into one buffer kept between buckets and syncs; a CUDA buffer lives until
    :meth:`release_device` (after a sync the GPU belongs to training)."""

    def __init__(self, workers: int, timeout_s: float, alive: Callable[[], bool], host: str = "127.0.0.1"):
        self.workers = workers
        self.timeout_s = timeout_s
        self.alive = alive
        self.host = host
        self.backend: Optional[str] = None
        self._store = None
        self._group = None
        self._device: Optional[torch.device] = None
        self._flat: Optional[torch.Tensor] = None
        self._abandoned: list[threading.Thread] = []  # this end's part of failed steps, maybe still blocked

    def send(self, bucket: Sequence[tuple[str, torch.Tensor]], join: Callable[[dict], Any],
             receive: Callable[[tuple], Any]) -> int:
        """Broadcast one bucket; returns its bytes. ``receive(header)`` is the control call that makes
        every worker take a bucket (``header``: its metadata and size); ``join(spec)`` the one that
        makes them join a group (made when there is none yet or the bucket needs the other backend)."""
        device = bucket[0][1].device
        if self._group is None or self.backend != _backend_for(device):
            self._connect(device, join)
        metas, total = bucket_layout(bucket)
        self._flat = flat = _buffer(self._flat, total, device)
        group = self._group

        def leader():
            pack_bucket(flat, bucket, metas)
            _broadcast(group, flat[:max(total, 1)])

        self._step(f"broadcasting a {total / 2**20:.1f} MiB bucket of {len(bucket)} tensors",
                   lambda: receive((metas, total)), leader)
        return total

    def _connect(self, device: torch.device, join: Callable[[dict], Any]) -> None:
        self.close()
        backend = _backend_for(device)
        # The group's own limit is twice the step's: this end gives up (and aborts NCCL) first, before
        # NCCL's watchdog would time the operation out and end this process (the trainer).
        timeout = timedelta(seconds=2 * self.timeout_s)
        store = dist.TCPStore(self.host, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        spec = {"host": self.host, "port": store.port, "size": self.workers + 1, "backend": backend,
                "timeout_s": self.timeout_s}
        self._store, self._device, self.backend = store, device, backend
        made = []  # the leader's group, handed over only when both ends joined

        def leader():
            made.append(_new_group(backend, store, 0, spec["size"], timeout))
            _handshake(made[0], spec, device)

        try:
            self._step(f"joining a {backend} weight broadcast group on port {store.port}", lambda: join(spec), leader)
        except BroadcastError:
            if made and backend == "nccl":
                made[0].abort()
            raise
        self._group = made[0]

    def _step(self, what: str, engine: Callable[[], Any], leader: Callable[[], None]) -> None:
        """Run the engine's control call and the leader's part at once; close the group and raise
        :class:`BroadcastError` when either fails, the engine dies or ``timeout_s`` passes."""
        done: queue.Queue = queue.Queue()
        device = self._device

        def run(side: str, work: Callable[[], Any]) -> None:
            try:
                if device is not None and device.type == "cuda":
                    with torch.cuda.device(device):  # a new thread starts on GPU 0
                        work()
                else:
                    work()
                done.put((side, None))
            except BaseException as err:  # noqa: BLE001  (reported to the waiting thread)
                done.put((side, err))

        threads = {side: threading.Thread(target=run, args=(side, work), name=f"megatron-alp-broadcast-{side}",
                                          daemon=True) for side, work in (("engine", engine), ("leader", leader))}
        for thread in threads.values():
            thread.start()
        deadline = time.monotonic() + self.timeout_s
        pending = {"engine", "leader"}
        try:
            while pending:
                try:
                    side, err = done.get(timeout=_POLL_S)
                except queue.Empty:
                    if not self.alive():
                        raise BroadcastError(f"{what}: the engine's process died") from None
                    if time.monotonic() > deadline:
                        raise BroadcastError(f"{what}: not done after {self.timeout_s:g} s "
                                             f"(waiting for the {' and the '.join(sorted(pending))})") from None
                    continue
                if err is not None:
                    dead = " (the engine's process died)" if self._died() else ""
                    raise BroadcastError(f"{what}: the {side} side failed{dead}: {type(err).__name__}: {err}") from err
                pending.discard(side)
        except BroadcastError:
            # The other side may still wait in the group: it gets the group's own timeout (gloo),
            # an aborted communicator (NCCL) or the engine's restart (see close).
            if "leader" in pending:
                self._abandoned.append(threads["leader"])
            self.close()
            raise

    def _died(self, within_s: float = 1.0) -> bool:
        """Whether the engine's processes end within ``within_s``: a failed step is often the first to
        hear of a death (its connection reset) before the process is reported ended."""
        deadline = time.monotonic() + within_s
        while self.alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def release_device(self) -> None:
        """Free a CUDA bucket buffer (between syncs the GPU belongs to training)."""
        if self._flat is not None and self._flat.is_cuda:
            self._flat = None

    def close(self, grace_s: float = 0.0) -> None:
        """Leave the group (its workers are gone or will be restarted). ``grace_s``: how long to wait
        for this end's part of a failed step, which ends once the engine's processes are gone (their
        connections close) -- a thread still blocked in gloo when the interpreter exits aborts it."""
        group, self._group = self._group, None
        if group is not None and self.backend == "nccl":
            group.abort()  # NCCL's watchdog would otherwise time a broken broadcast out and end this process
        self._store = self._device = self.backend = None
        self._flat = None
        deadline = time.monotonic() + grace_s
        for thread in self._abandoned:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._abandoned = [t for t in self._abandoned if t.is_alive()]


class BroadcastReceiver:
    """One engine worker's end of the group: rank ``1 + rank`` of the leader's ``spec``."""

    def __init__(self, spec: dict, rank: int):
        size = int(spec["size"])
        if not 0 <= rank < size - 1:
            raise BroadcastError(f"engine worker rank {rank} does not fit a weight broadcast group of {size} "
                                 f"(the leader expects {size - 1} workers: rollout.tensor_parallel_size)")
        timeout = timedelta(seconds=float(spec["timeout_s"]))
        self.device = (torch.device("cuda", torch.cuda.current_device()) if spec["backend"] == "nccl"
                       else torch.device("cpu"))
        self._store = dist.TCPStore(spec["host"], int(spec["port"]), is_master=False, timeout=timeout)
        self._group = _new_group(spec["backend"], self._store, rank + 1, size, timeout)
        _handshake(self._group, spec, self.device)
        self._flat: Optional[torch.Tensor] = None

    def receive(self, header: tuple, load: Callable[[Any], None]) -> int:
        """Receive one bucket and call ``load`` on its tensors, views of the receive buffer (``load``
        must not keep them). Returns the bytes received."""
        metas, total = header
        self._flat = flat = _buffer(self._flat, total, self.device)
        _broadcast(self._group, flat[:max(total, 1)])
        load(bucket_views(flat, metas))
        return total
