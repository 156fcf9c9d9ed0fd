"""How a weight sync reaches a vLLM engine's workers: one class per way, declared once.

``rollout.sync_method`` names the way (:attr:`WeightTransport.method`); ``memory`` is taken by
whichever of its two classes fits where the engine runs. Every transport consumes the bucketed
stream of (HF name, full tensor) pairs lazily and ends in the workers' ``reload_weights``, which
re-runs each layer's post-load processing (quantized engines re-quantize):

- :class:`InProcess` (``memory``, engine in this process): the driver worker's
  ``reload_weights(weights_iterator=...)`` takes the stream directly.
- :class:`SharedBuckets` (``memory``, engine in its subprocess): each bucket of whole layers is
  packed into a shared-memory segment (CPU) or a CUDA IPC buffer (GPU) that the workers map and
  load from (:meth:`~megatron_alp.rollout.vllm.worker.WorkerExtension.load_weight_bucket`).
- :class:`Broadcast` (``broadcast``, engines on devices of their own): each bucket is broadcast
  from this process to the workers in a process group of their own
  (:mod:`megatron_alp.rollout.weight_broadcast`).

Both bucketed transports load a whole sync in one reload session of the workers
(:func:`reload_session`), not one per bucket.
- :class:`Folder` (``folder``): a safetensors checkpoint in ``rollout.sync_dir`` that the workers
  reload; it outlives an engine restart, which starts from it.
"""

from __future__ import annotations

import abc
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar, Iterable, Optional

import torch

from megatron_alp.config import RolloutConfig
from megatron_alp.rollout.weight_broadcast import BroadcastSender
from megatron_alp.rollout.weight_sync import BucketWriter, SyncFolder, layer_buckets

Weights = Iterable[tuple[str, torch.Tensor]]


@contextmanager
def reload_session(process):
    """The workers' reload session around one sync's buckets
    (:meth:`~megatron_alp.rollout.vllm.worker.WorkerExtension.begin_weight_reload`). A bucket that
    fails leaves it open: the engine is then broken and restarted before its next use."""
    process.rpc("begin_weight_reload")
    yield
    process.rpc("end_weight_reload")


class WeightTransport(abc.ABC):
    """One way weights reach the workers of a :class:`~megatron_alp.rollout.vllm.engine.VLLMEngine`."""

    method: ClassVar[str]  # the rollout.sync_method it serves
    in_process: ClassVar[Optional[bool]] = None  # True / False: only for an engine in / out of this process
    survives_restart: ClassVar[bool] = False  # whether a restarted engine starts from the synced weights

    def __init__(self, cfg: RolloutConfig, model_dir: Path):
        self.cfg, self.model_dir = cfg, model_dir

    @abc.abstractmethod
    def send(self, process, weights: Weights) -> None:
        """Load ``weights`` into the workers of ``process`` (the engine's running
        :class:`~megatron_alp.rollout.vllm.process.EngineProcess`)."""

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

    def send(self, process, weights: Weights) -> None:
        process.in_process_worker().reload_weights(weights_iterator=weights)


class SharedBuckets(WeightTransport):
    method, in_process = "memory", False

    def __init__(self, cfg: RolloutConfig, model_dir: Path):
        super().__init__(cfg, model_dir)
        self._writer: Optional[BucketWriter] = None

    def send(self, process, weights: Weights) -> None:
        if self._writer is None:
            self._writer = BucketWriter()
        try:
            with reload_session(process):
                for bucket in layer_buckets(weights, self.cfg.sync_bucket_mb << 20):
                    process.rpc("load_weight_bucket", args=(self._writer.pack(bucket),))
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

    def send(self, process, weights: Weights) -> None:
        folder = self.folders.write(weights)
        process.rpc("reload_weights", kwargs={"weights_path": str(folder)})
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

    def send(self, process, weights: Weights) -> None:
        if self._sender is None:
            self._sender = BroadcastSender(workers=self.cfg.tensor_parallel_size,
                                           timeout_s=self.cfg.request_timeout_s, alive=process.alive)
        try:
            with reload_session(process):
                for bucket in layer_buckets(weights, self.cfg.sync_bucket_mb << 20):
                    self._sender.send(bucket, join=lambda spec: process.rpc("join_weight_broadcast", args=(spec,)),
                                      receive=lambda header: process.rpc("receive_weight_bucket", args=(header,)))
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
    raise ValueError(f"rollout.sync_method={method}: no vLLM transport for an engine "
                     f"{'in' if in_process else 'out of'} the trainer's process")
