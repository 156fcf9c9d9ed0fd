"""How a weight sync reaches an engine's processes: one class per way, declared once, for any engine.

``rollout.sync_method`` names the way (:attr:`WeightTransport.method`); ``memory`` is taken by
whichever of its two classes fits where the engine runs. A transport does the sending side and
calls the engine's :class:`Receiver`, the receiving ends an engine keeps (vLLM's
:class:`~megatron_alp.rollout.vllm.process.EngineProcess` and its workers' extension; the SGLang
server's reload endpoint); which ways an engine takes is its ``sync_methods``. Every transport
consumes the bucketed stream of (HF name, full tensor) pairs lazily; the engine re-runs each layer's
post-load processing (quantized engines re-quantize):

- :class:`InProcess` (``memory``, engine in this process): the stream goes to the engine directly.
- :class:`SharedBuckets` (``memory``, engine in its subprocess): each bucket of whole layers is
  packed into a shared-memory segment (CPU) or a CUDA IPC buffer (GPU) that the engine's workers map
  and load from.
- :class:`Broadcast` (``broadcast``, engines on devices of their own): each bucket is broadcast
  from this process to the workers in a process group of their own
  (:mod:`megatron_alp.rollout.weight_broadcast`).

Both bucketed transports load a whole sync in one reload session of the workers
(:func:`reload_session`), not one per bucket.
- :class:`Folder` (``folder``): a safetensors checkpoint in ``rollout.sync_dir``
  (:class:`~megatron_alp.rollout.weight_sync.SyncFolder`) that the engine reloads; it outlives an
  engine restart, which starts from it.
"""

from __future__ import annotations

import abc
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar, Iterable, Optional, Protocol

import torch

from megatron_alp.config import RolloutConfig
from megatron_alp.rollout.weight_broadcast import BroadcastSender
from megatron_alp.rollout.weight_sync import BucketWriter, SyncFolder, layer_buckets

Weights = Iterable[tuple[str, torch.Tensor]]


class Receiver(Protocol):
    """The receiving ends of an engine's weights, each for the transports that use it (an engine
    implements those of its ``sync_methods``)."""

    def alive(self) -> bool:
        """False once the engine's processes have ended (a broadcast stops waiting for them)."""

    def load(self, weights: "Weights") -> None:
        """:class:`InProcess`: load the stream in this process."""

    def begin_reload(self) -> None:
        """Open one reload session for the buckets of a sync (:func:`reload_session`)."""

    def end_reload(self) -> None:
        """Close it: layers no bucket reached keep their weights."""

    def load_bucket(self, handle: bytes) -> None:
        """:class:`SharedBuckets`: load the bucket behind ``handle`` (a shared-memory or CUDA IPC buffer)."""

    def join_broadcast(self, spec: dict) -> None:
        """:class:`Broadcast`: join the sender's group (a new one after every engine start)."""

    def receive_bucket(self, header: tuple) -> None:
        """:class:`Broadcast`: receive one bucket and load it."""

    def reload_folder(self, path: str) -> None:
        """:class:`Folder`: load the weights of a safetensors folder."""


@contextmanager
def reload_session(receiver: Receiver):
    """The receiver's reload session around one sync's buckets. A bucket that fails leaves it open:
    the engine is then broken and restarted before its next use."""
    receiver.begin_reload()
    yield
    receiver.end_reload()


class WeightTransport(abc.ABC):
    """One way weights reach an engine's processes."""

    method: ClassVar[str]  # the rollout.sync_method it serves
    in_process: ClassVar[Optional[bool]] = None  # True / False: only for an engine in / out of this process
    survives_restart: ClassVar[bool] = False  # whether a restarted engine starts from the synced weights

    def __init__(self, cfg: RolloutConfig, model_dir: Path):
        self.cfg, self.model_dir = cfg, model_dir

    @abc.abstractmethod
    def send(self, receiver: Receiver, weights: Weights) -> None:
        """Load ``weights`` into the engine through its ``receiver``."""

    def engine_released(self) -> None:
        """The engine's processes are gone: end what was tied to them."""

    def close(self) -> None:
        """The engine shuts down for good: free what the transport holds (memory, folders)."""

    @property
    def start_dir(self) -> Optional[Path]:
        """The weights an engine (re)starts from, when the transport keeps them on disk."""
        return None

    @property
    def name(self) -> str:
        """The path's name in ``sync/*`` statistics (``in_process``, ``memory``, ...)."""
        return self.method


class InProcess(WeightTransport):
    method, in_process = "memory", True

    @property
    def name(self) -> str:
        return "in_process"

    def send(self, receiver: Receiver, weights: Weights) -> None:
        receiver.load(weights)


class SharedBuckets(WeightTransport):
    method, in_process = "memory", False

    def __init__(self, cfg: RolloutConfig, model_dir: Path):
        super().__init__(cfg, model_dir)
        self._writer: Optional[BucketWriter] = None

    def send(self, receiver: Receiver, weights: Weights) -> None:
        if self._writer is None:
            self._writer = BucketWriter()
        try:
            with reload_session(receiver):
                for bucket in layer_buckets(weights, self.cfg.sync_bucket_mb << 20):
                    receiver.load_bucket(self._writer.pack(bucket))
        finally:
            self._writer.release_device()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class Folder(WeightTransport):
    method = "folder"
    survives_restart = True

    def __init__(self, cfg: RolloutConfig, model_dir: Path):
        super().__init__(cfg, model_dir)
        self.folders = SyncFolder(cfg.sync_dir, model_dir, cfg.sync_bucket_mb << 20)

    def send(self, receiver: Receiver, weights: Weights) -> None:
        folder = self.folders.write(weights)
        try:
            receiver.reload_folder(str(folder))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # the engine keeps (or restarts from) the current one
            raise
        self.folders.commit(folder)

    @property
    def start_dir(self) -> Optional[Path]:
        return self.folders.current

    def close(self) -> None:
        self.folders.close()


class Broadcast(WeightTransport):
    method, in_process = "broadcast", False

    def __init__(self, cfg: RolloutConfig, model_dir: Path):
        super().__init__(cfg, model_dir)
        self._sender: Optional[BroadcastSender] = None  # the broadcast group of the running engine's workers

    def send(self, receiver: Receiver, weights: Weights) -> None:
        if self._sender is None:
            self._sender = BroadcastSender(workers=self.cfg.tensor_parallel_size,
                                           timeout_s=self.cfg.request_timeout_s, alive=receiver.alive)
        try:
            with reload_session(receiver):
                for bucket in layer_buckets(weights, self.cfg.sync_bucket_mb << 20):
                    self._sender.send(bucket, join=receiver.join_broadcast, receive=receiver.receive_bucket)
        finally:
            if self._sender is not None:
                self._sender.release_device()

    def engine_released(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:  # its workers are gone: a broadcast left over from a failure ends now
            sender.close(grace_s=10.0)


# Preferred first: the first class of a method is its default, and the first method the engine's.
TRANSPORTS: tuple[type[WeightTransport], ...] = (InProcess, SharedBuckets, Folder, Broadcast)
SYNC_METHODS: tuple[str, ...] = tuple(dict.fromkeys(t.method for t in TRANSPORTS))


def transport_for(cfg: RolloutConfig, method: str, model_dir: Path, in_process: bool) -> WeightTransport:
    """The transport of ``method`` for an engine in (or out of) this process."""
    for cls in TRANSPORTS:
        if cls.method == method and cls.in_process in (None, in_process):
            return cls(cfg, model_dir)
    raise ValueError(f"rollout.sync_method={method}: no transport for an engine "
                     f"{'in' if in_process else 'out of'} the trainer's process")
