"""Trainer -> rollout-engine weight transfer, and the check that engine and trainer agree.

The trainer's side is :func:`megatron_alp.models.hf_weights.iter_hf_weights`: a collective that
gathers TP/PP/EP shards in bounded buckets and yields ``(HF name, full tensor)`` on the ranks that
receive them (the replica leaders, in the weight sync).
This module adapts that stream for the engines:

- :class:`WeightStream` drops ALP sigmas (Megatron-only state; the exporter already skips them,
  this is the engine's own guard), counts tensors and bytes, and can be drained, so every rank of
  the collective reaches its end even when the engine stopped consuming early (an error).
- :func:`write_hf_checkpoint` turns a stream into a safetensors folder (the HF export's writer,
  :func:`megatron_alp.models.hf_weights.write_hf_folder`), sharded at the bucket size so memory
  stays bounded, appearing only when complete: engines in another process (vLLM's engine-core
  subprocess, the SGLang server) reload from it.
- In-memory handover to an engine in another process: :func:`layer_buckets` cuts the stream into
  buckets that never split a decoder layer (vLLM re-processes a layer, e.g. re-quantizes it, once
  all its tensors arrived in one reload call), :func:`bucket_layout` places a bucket's tensors in
  one flat byte buffer, :class:`BucketWriter` puts that buffer in shared memory (CPU) or one CUDA
  buffer (GPU) and returns a small picklable handle, and :func:`load_bucket` maps that handle in
  the engine's worker without copying. The broadcast transport
  (:mod:`megatron_alp.rollout.weight_broadcast`) sends the same buffers through a process group.
- :func:`mismatch_stats` compares engine and trainer logprobs of the same tokens: max and P98 of
  |log ratio| and the k3 estimate of KL(rollout || train), the quantities the paper tracks.
"""

from __future__ import annotations

import math
import mmap
import os
import pickle
import re
import shutil
from multiprocessing import shared_memory
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch

from megatron_alp.models.hf_weights import HFCheckpoint, write_hf_folder
from megatron_alp.models.weight_mapping import is_sigma
from megatron_alp.runtime.process import alive

# Copied next to the weights so the folder is a loadable model directory (engine restarts).
_CONFIG_FILES = ("config.json", "generation_config.json")


class WeightStream:
    """An ``(HF name, tensor)`` iterator without ALP sigmas, with byte and tensor counts."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]):
        self._source = iter(weights)
        self._gen = self._filtered()
        self.tensors = 0
        self.bytes = 0
        self.skipped: list[str] = []

    def _filtered(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._source:
            if is_sigma(name):
                self.skipped.append(name)
                continue
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._gen

    def drain(self) -> None:
        """Consume what is left (a collective source needs every rank to reach its end)."""
        for _ in self._gen:
            pass


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_of(name: str) -> int:
    """Decoder layer index of an HF tensor name; -1 for the embedding, final norm and head."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else -1


def layer_buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                  ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group the stream into lists of about ``bucket_bytes`` that end only where the decoder layer
    changes (a layer bigger than the bucket is one bucket of its own)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        if bucket and size >= bucket_bytes and _layer_of(name) != _layer_of(bucket[-1][0]):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    if bucket:
        yield bucket


_ALIGN = 64  # byte alignment of each tensor inside a bucket buffer


def bucket_layout(tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[tuple], int]:
    """Where each tensor of a bucket goes in one flat byte buffer: ``(name, dtype, shape, offset,
    nbytes)`` per tensor (offsets aligned to 64 bytes) and the buffer's size. The metadata is all
    an engine needs to read the tensors back from the buffer (:func:`bucket_views`)."""
    metas, offset = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return metas, offset


def pack_bucket(flat: torch.Tensor, tensors: Sequence[tuple[str, torch.Tensor]], metas: Sequence[tuple]) -> None:
    """Copy the tensors into the uint8 buffer ``flat`` at the places :func:`bucket_layout` gave them."""
    for (_, t), (*_, offset, nbytes) in zip(tensors, metas):
        if nbytes:
            flat[offset:offset + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))


def bucket_views(flat: torch.Tensor, metas: Sequence[tuple]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a packed bucket as views of the uint8 buffer ``flat`` (no copy)."""
    for name, dtype, shape, offset, nbytes in metas:
        yield name, flat[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape)


class BucketWriter:
    """The trainer side of an in-memory handover: :meth:`pack` copies a bucket into one buffer the
    engine's processes can map and returns its handle (bytes). CPU tensors go to a POSIX shared
    memory segment, kept, reused and grown as needed (a fresh segment costs more to fill than the
    copy itself); CUDA tensors to one device buffer shared by CUDA IPC, valid until the next
    :meth:`pack`, :meth:`release_device` or :meth:`close`. One bucket at a time: the caller waits
    until the engine has loaded a bucket before packing the next."""

    def __init__(self, prefix: str = "megatron-alp"):
        self.prefix = f"{prefix}-{os.getpid()}"
        remove_orphaned_segments(prefix)
        self._shm: shared_memory.SharedMemory | None = None
        self._cuda: torch.Tensor | None = None
        self._count = 0

    def pack(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> bytes:
        metas, total = bucket_layout(tensors)
        if tensors and tensors[0][1].is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            self._cuda = flat = torch.empty(max(total, 1), dtype=torch.uint8, device=tensors[0][1].device)
            pack_bucket(flat, tensors, metas)
            torch.cuda.current_stream(flat.device).synchronize()
            return pickle.dumps(("cuda", reduce_tensor(flat), metas))
        shm = self._segment(total)
        if total:
            flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=total)
            pack_bucket(flat, tensors, metas)
            del flat
        return pickle.dumps(("shm", shm.name, metas))

    def _segment(self, size: int) -> shared_memory.SharedMemory:
        if self._shm is not None and self._shm.size >= size:
            return self._shm
        self._release_shm()
        self._count += 1
        # Room to grow: buckets vary in size (they end on layer boundaries).
        self._shm = shared_memory.SharedMemory(name=f"{self.prefix}-{self._count}", create=True,
                                               size=max(int(size * 1.25), 1 << 16))
        return self._shm

    def _release_shm(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None

    def release_device(self) -> None:
        """Free the CUDA buffer (between syncs the GPU belongs to training)."""
        self._cuda = None

    def close(self) -> None:
        self._release_shm()
        self._cuda = None


def remove_orphaned_segments(prefix: str, root: str = "/dev/shm") -> list[str]:
    """Unlink the bucket segments (``<prefix>-<pid>-<n>``) of writers whose process is gone: a
    trainer killed by SIGKILL never unlinks its segment, which would hold up to
    ``rollout.sync_bucket_mb`` of memory until the machine reboots. Returns the names removed."""
    pattern = re.compile(re.escape(prefix) + r"-(\d+)-\d+")
    removed = []
    try:
        names = os.listdir(root)
    except OSError:  # no /dev/shm on this platform: nothing to clean
        return removed
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(root, name))
            removed.append(name)
        except OSError:  # removed meanwhile, or not ours to remove
            pass
    return removed


def _map_shm(name: str) -> mmap.mmap:
    """Map an existing POSIX shared-memory segment (Linux: a file in /dev/shm) without going through
    ``SharedMemory``, whose resource tracker (shared with the trainer process that started this
    engine) would otherwise drop the trainer's own registration of the segment."""
    fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def open_cuda_bucket(rebuild: Callable, args: Sequence, device: int) -> torch.Tensor:
    """The trainer's CUDA bucket in an engine worker on GPU ``device`` of its replica (torch's
    ``rebuild_cuda_tensor`` and its arguments, from the pickled handle). The buffer lives on the
    replica's first GPU (the leader's, device 0 here): opened from the worker's own device, the
    worker reads it over peer access; opened on device 0, each of the other tensor-parallel workers
    would make a CUDA context of its own on the leader's GPU (hundreds of MiB each, counted
    nowhere), so that is only the way when peer access is refused."""
    args = list(args)  # args[6]: storage_device
    if device != 0:
        args[6] = device
        try:
            return rebuild(*args)
        except RuntimeError:  # no peer access between the two GPUs
            pass
    args[6] = 0
    return rebuild(*args)


def load_bucket(handle: bytes, load: Callable[[Iterator[tuple[str, torch.Tensor]]], None], device: int = 0) -> int:
    """The engine side: call ``load`` on the bucket's tensors, viewed in place (no copy); returns
    the bytes loaded. ``load`` must not keep the tensors (they alias the trainer's buffer).
    ``device``: the worker's GPU (:func:`open_cuda_bucket`)."""
    kind, ref, metas = pickle.loads(handle)
    if kind == "cuda":
        flat = open_cuda_bucket(*ref, device)
        load(bucket_views(flat, metas))
        torch.cuda.synchronize()
        del flat
    else:
        segment = _map_shm(ref)
        try:
            base = torch.frombuffer(segment, dtype=torch.uint8)
            load(bucket_views(base, metas))
            del base
        finally:
            segment.close()
    return sum(m[4] for m in metas)


def write_hf_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, *, bucket_bytes: int, config_dir: str | Path
) -> Path:
    """Write ``weights`` as an HF safetensors folder at ``out_dir`` (shards of about
    ``bucket_bytes``), with the config files of ``config_dir``. Atomic: the folder appears
    complete under its name or not at all. Returns ``out_dir``."""

    def add_config(tmp: Path) -> None:
        for cfg in _CONFIG_FILES:
            if (Path(config_dir) / cfg).is_file():
                shutil.copyfile(Path(config_dir) / cfg, tmp / cfg)

    return write_hf_folder(weights, out_dir, max_shard_bytes=bucket_bytes, add_files=add_config)


def default_sync_root(configured: str | None) -> Path:
    """The folder weight checkpoints for out-of-process engines go to: ``rollout.sync_dir``, else
    /dev/shm (memory-backed, no disk traffic) when writable, else the temp folder."""
    import tempfile

    if configured:
        root = Path(configured)
    elif os.access("/dev/shm", os.W_OK):
        root = Path("/dev/shm")
    else:
        root = Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="megatron-alp-weights-", dir=root))


class SyncFolder:
    """The weight folders an engine in another process reloads from (``rollout.sync_method: folder``
    and SGLang): each sync is written once, whole, as ``weights-<n>`` under ``root`` (created on first
    use in ``rollout.sync_dir``, :func:`default_sync_root`); the engine loads it, and :meth:`commit`
    makes it :attr:`current` (what a restarted engine starts from) and removes the one before."""

    def __init__(self, sync_dir: str | None, model_dir: str | Path, bucket_bytes: int):
        self.sync_dir, self.model_dir, self.bucket_bytes = sync_dir, Path(model_dir), bucket_bytes
        self._root: Path | None = None
        self.current: Path | None = None

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = default_sync_root(self.sync_dir)
        return self._root

    def write(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Path:
        """The next version's folder (atomic), not yet current: ``weights``, and every tensor of the
        current folder they leave out (a delta sync sends the changed tensors only), so a folder is
        always the whole model."""
        version = int(self.current.name.rsplit("-", 1)[1]) + 1 if self.current else 1
        return write_hf_checkpoint(self._whole(weights), self.root / f"weights-{version:06d}",
                                   bucket_bytes=self.bucket_bytes, config_dir=self.model_dir)

    def _whole(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        sent = set()
        for name, tensor in weights:
            sent.add(name)
            yield name, tensor
        if self.current is not None:
            before = HFCheckpoint(self.current)
            for name in before.names():
                if name not in sent:
                    yield name, before.read(name)
            before.close()

    def commit(self, folder: Path) -> None:
        """The engine loaded ``folder``: it is current, the previous one goes."""
        old, self.current = self.current, folder
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = self.current = None


def default_verify_tolerance(engine_dtype: str, quantization: str, kv_cache_dtype: str,
                             trainer_dtype: torch.dtype) -> float:
    """Mean |log ratio| a correct sync stays under on the probe: float32 on both sides agrees to
    rounding; lower precision or quantization on either side is allowed a few percent."""
    exact = engine_dtype == "float32" and quantization == "none" and kv_cache_dtype == "auto"
    return 1e-3 if exact and trainer_dtype == torch.float32 else 0.05


def is_finite(values: Sequence[float]) -> bool:
    return all(math.isfinite(v) for v in values)
