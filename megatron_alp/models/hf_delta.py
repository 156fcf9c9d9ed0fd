"""Exact delta export of a model's HF weights: after one dense anchor, only the elements whose bits changed.

Between two RL steps only about 1-3% of the bf16 weight elements change bit for bit (issue 40), yet
:func:`~megatron_alp.models.hf_weights.iter_hf_weights` streams the whole model at every sync.
:class:`DeltaExport` is its stateful counterpart, one per model per process, created on every rank:

- an *anchor* stream is ``iter_hf_weights`` itself; meanwhile each rank snapshots the shard it sends
  (its own shard only, never a full model on one rank) and each receiver keeps a host mirror of the
  full Megatron-layout tensors it received;
- a *delta* stream compares each shard's bits with its snapshot and sends the changed (flat index,
  value) pairs per tensor, or the dense shard where pairs would not be smaller; the pairs of a TP
  group are all-gathered and delivered per bucket like ``gather_full`` delivers dense buckets; the
  receiver applies them to its mirror shard by shard and yields the tensors that changed, HF-named.
  Every shard carries an integer checksum of its new bits: a receiver whose rebuilt shard disagrees
  raises :class:`DeltaMismatch` once the collective is over, and the next stream is an anchor.
"""

from __future__ import annotations

import math
import time
from typing import Iterable, Iterator, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron_alp.models.hf_weights import (
    ExportPlan,
    check_receivers,
    export_plan,
    gather_full,
    send_to_receivers,
)
from megatron_alp.models.sharding import merge, shard

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ROW = 4  # header fields per tensor and part: mode, changed elements, two checksum words
_ABSENT, _SPARSE, _DENSE = 0, 1, 2  # modes: a part this rank does not send (replicated, TP rank > 0)
_CHECKSUM_CHUNK = 1 << 22  # elements widened to int64 at a time


class DeltaMismatch(RuntimeError):
    """A receiver's rebuilt tensor disagrees with its owners' checksum: its mirror (and so the engine
    fed from it) has drifted. Raised after the stream's collectives; the next stream is an anchor."""


class _Part(NamedTuple):
    """One TP shard's record in a delta payload."""

    mode: int
    changed: int
    checksum: list[int]
    index: Optional[torch.Tensor]  # flat positions of a sparse part
    values: Optional[torch.Tensor]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The flat bit patterns of ``t`` as signed integers of its element size (so -0.0 and NaN
    payloads compare exactly)."""
    return t.reshape(-1).view(_BITS[t.element_size()])


def checksum(t: torch.Tensor) -> list[int]:
    """Sums of the bit patterns and of bit pattern x (position + 1), in int64 wrapping arithmetic:
    exact, so identical on any device and in any summation order. Widens a chunk at a time."""
    bits = _bits(t)
    total = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), _CHECKSUM_CHUNK):
        b = bits[start: start + _CHECKSUM_CHUNK].long()
        total[0] += b.sum()
        total[1] += (b * torch.arange(start + 1, start + 1 + b.numel(), device=t.device)).sum()
    return total.tolist()


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def _padded(n: int) -> int:
    return -(-n // 8) * 8


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes padded to a multiple of 8, so every field of a payload starts aligned."""
    raw = t.reshape(-1).view(torch.uint8)
    pad = _padded(raw.numel()) - raw.numel()
    return torch.cat([raw, raw.new_zeros(pad)]) if pad else raw


def _encode(value: torch.Tensor, snapshot: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
    """One shard's header row and data against its snapshot, which it updates in place: the changed
    (index, value) pairs, or the dense shard where pairs would not be smaller."""
    value = value.to(snapshot.device).reshape(-1)
    flat = snapshot.view(-1)
    index = (_bits(value) != _bits(flat)).nonzero().squeeze(1)
    n, size = index.numel(), value.element_size()
    if n * (_element_bytes(_index_dtype(value.numel())) + size) >= value.numel() * size:
        flat.copy_(value)
        return [_DENSE, n, *checksum(flat)], [_as_bytes(flat)]
    changed = value[index]
    flat[index] = changed
    return [_SPARSE, n, *checksum(flat)], [_as_bytes(index.to(_index_dtype(value.numel()))), _as_bytes(changed)]


def _decode(piece: torch.Tensor, parts: list[tuple[int, torch.dtype]]) -> list[_Part]:
    """The records of one rank's piece: ``parts`` gives each tensor's shard numel and dtype."""
    header = piece[: len(parts) * _ROW * 8].view(torch.int64).view(-1, _ROW).tolist()
    offset, out = len(parts) * _ROW * 8, []

    def take(n: int, dtype: torch.dtype) -> torch.Tensor:
        nonlocal offset
        nbytes = n * _element_bytes(dtype)
        t = piece[offset: offset + nbytes].view(dtype)
        offset += _padded(nbytes)
        return t

    for (mode, changed, *sums), (numel, dtype) in zip(header, parts):
        index = take(changed, _index_dtype(numel)) if mode == _SPARSE else None
        values = None if mode == _ABSENT else take(numel if mode == _DENSE else changed, dtype)
        out.append(_Part(mode, changed, sums, index, values))
    return out


def _gather_pieces(piece: torch.Tensor, group, size: int) -> torch.Tensor:
    """The TP group's pieces of one bucket in rank order, as one payload led by their sizes (int64
    each); pieces differ in size, so the sizes are all-gathered first."""
    count = torch.tensor([piece.numel()], dtype=torch.int64, device=piece.device)
    if size == 1:
        return torch.cat([count.view(torch.uint8), piece])
    counts = [torch.empty_like(count) for _ in range(size)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c) for c in counts]
    padded = torch.cat([piece, piece.new_zeros(max(sizes) - piece.numel())])
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([torch.cat(counts).view(torch.uint8), *(p[:s] for p, s in zip(parts, sizes))])


def _deliver(payload: Optional[torch.Tensor], rank: int, sources: dict[int, int], device) -> torch.Tensor:
    """One bucket's payload to the receivers that own none of it (``sources``: receiver -> owner):
    its size, then its bytes, point to point. Returns the payload this rank holds after."""
    count = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64, device=device)
    send_to_receivers(count, rank, sources)
    if payload is None:
        payload = torch.empty(int(count), dtype=torch.uint8, device=device)
    send_to_receivers(payload, rank, sources)
    return payload


def _parts(plan: ExportPlan, name: str) -> int:
    """How many TP shards of ``name`` travel: one per rank of its group, one if replicated."""
    partition_dim, size = plan.splits[name]
    return 1 if partition_dim is None else size


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def delta_memory(model) -> dict[str, int]:
    """Bytes a :class:`DeltaExport` of ``model`` holds, for the memory plan: ``snapshot``, this rank's
    shards (on its snapshot device, the model's by default), and ``mirror``, the whole model in the
    send dtypes (host memory of each receiver). Collective the first time a model is exported."""
    from megatron.core.utils import unwrap_model

    plan, _, _ = export_plan(unwrap_model(model))
    snapshot = sum(p.param.numel() * p.param.element_size() for name, p in plan.local.items()
                   if p.tp_rank < _parts(plan, name))
    mirror = sum(math.prod(shape) * _element_bytes(dtype) for _, _, _, shape, dtype in plan.entries)
    return {"snapshot": snapshot, "mirror": mirror}


class DeltaExport:
    """The weights of one model streamed exactly, as deltas against what the receivers hold.

    One per model per process, on every rank. :meth:`stream` is a collective like
    :func:`~megatron_alp.models.hf_weights.iter_hf_weights` (same arguments; every rank iterates it
    to the end). The first stream, one with ``anchor=True``, the first after :meth:`reset` on any
    rank, after a stream some rank left unfinished, for another model, or with a receiver that did
    not receive the previous stream, is an *anchor*: dense, exactly ``iter_hf_weights``. Any other
    is a *delta*: each receiver yields ``(hf_name, full tensor)`` only for the Megatron tensors that
    changed since the previous stream (all HF tensors of a fused one), bit-exact; feeding them over
    the previous stream's tensors gives the current model.

    After each stream ``stats`` holds, on every rank: ``anchor`` (bool); ``bytes``, the payload this
    rank received as a receiver (dense tensors in an anchor; pairs, headers and dense fallbacks in a
    delta; 0 elsewhere); ``changed`` and ``elements``, the model's changed and total elements (an
    anchor counts all as changed); ``seconds``, this rank's time comparing and encoding its shards
    (snapshotting them in an anchor). ALP sigmas and LoRA factors never travel: an adapted layer's
    merged ``W + s B A`` is what is compared.

    ``dtype``: floating tensors are compared and sent in it (the engine's, when it only casts what it
    gets: a float32 trainer's changes below bf16's precision are then no change); None: their own.
    ``snapshot_device`` (default: the model's) holds the snapshots; the mirrors live in host memory.
    See :func:`delta_memory` for their sizes.
    """

    def __init__(self, dtype: Optional[torch.dtype] = None, snapshot_device: Optional[torch.device | str] = None):
        self.dtype, self.snapshot_device = dtype, snapshot_device
        self.stats: dict = {}
        self.mirror: dict[str, torch.Tensor] = {}  # receivers: full Megatron-layout tensors by name
        self._snapshot: Optional[dict[str, torch.Tensor]] = None
        self._plan: Optional[ExportPlan] = None
        self._receivers: set[int] = set()
        self._finished = True

    def _sent(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as it is compared and sent: in :attr:`dtype` when it is floating."""
        return t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t

    def _sent_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def reset(self) -> None:
        """Make the next stream an anchor, on every rank (after an engine restart, a mismatch, a layout
        change); called on one rank it is enough."""
        self._snapshot, self.mirror = None, {}

    def stream(self, model, bucket_bytes: int = 512 << 20, receivers: Optional[Iterable[int]] = None,
               anchor: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full tensor)`` on every rank of ``receivers`` (None: every rank): the whole
        model in an anchor, the changed tensors in a delta (see the class). Raises
        :class:`DeltaMismatch` on a receiver whose rebuilt tensor fails its checksum, after the end."""
        from megatron.core.utils import unwrap_model

        model = unwrap_model(model)
        plan, mapping, matches = export_plan(model)
        wanted = check_receivers(receivers)
        everyone = list(range(dist.get_world_size())) if wanted is None else wanted
        device = next(model.parameters()).device
        dense = self._anchor_due(plan, everyone, anchor, device)
        self._finished, self._plan, self._receivers = False, plan, set(everyone)
        self.stats = {"anchor": dense, "bytes": 0, "changed": 0, "seconds": 0.0,
                      "elements": sum(math.prod(e[3]) for e in plan.entries)}
        if dense:
            for name, full in self._anchor(model, plan, bucket_bytes, wanted):
                yield from mapping.to_hf(matches[name], full)
        else:
            yield from self._delta(plan, mapping, matches, bucket_bytes, everyone, device)
        self._finished = True

    def _anchor_due(self, plan: ExportPlan, everyone: list[int], anchor: bool, device) -> bool:
        """Whether any rank needs an anchor (one all-reduce, so a :meth:`reset` on one rank suffices)."""
        due = (anchor or self._snapshot is None or not self._finished or plan is not self._plan
               or not set(everyone) <= self._receivers)
        flag = torch.tensor([int(due)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _anchor(self, model, plan: ExportPlan, bucket_bytes: int, wanted: Optional[list[int]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """The dense stream, snapshotting this rank's shards and mirroring what a receiver gets."""
        started = time.perf_counter()
        with torch.no_grad():
            self._snapshot = {name: self._sent(p.value()).to(self.snapshot_device or p.param.device, copy=True)
                              for name, p in plan.local.items() if p.tp_rank < _parts(plan, name)}
        self.stats["seconds"] = time.perf_counter() - started
        self.stats["changed"] = self.stats["elements"]
        self.mirror = {}
        for name, full in gather_full(model, plan, bucket_bytes, wanted):
            full = self._sent(full)
            self.mirror[name] = full.to("cpu", copy=True)
            self.stats["bytes"] += full.numel() * full.element_size()
            yield name, full

    def _delta(self, plan: ExportPlan, mapping, matches, bucket_bytes: int, wanted: list[int], device
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """Per bucket: owners encode and all-gather over TP, receivers that own none get the payload
        point to point; receivers apply it and yield the changed tensors (none after a mismatch)."""
        rank = dist.get_rank()
        if rank not in wanted:
            self.mirror = {}
        failed: Optional[str] = None
        with torch.no_grad():
            for bucket in plan.buckets(bucket_bytes):
                _, stage, ep_owner, _, _ = bucket[0]
                owner = plan.owns(rank, stage, ep_owner)
                sources = plan.sources(stage, ep_owner, wanted)
                if not owner and rank not in sources:
                    continue
                payload = _deliver(self._encode_bucket(plan, bucket) if owner else None, rank, sources, device)
                if rank not in wanted:
                    continue
                self.stats["bytes"] += payload.numel()
                for name, full in self._apply(plan, bucket, payload, failed is None):
                    if full is None:
                        failed = failed or name
                    elif failed is None:
                        yield from mapping.to_hf(matches[name], full)
        self._share_changed(device)
        if failed is not None:
            self.reset()
            raise DeltaMismatch(f"{failed}: the receiver's rebuilt tensor fails its checksum (rank {rank}); "
                                "the next stream is a full sync")

    def _encode_bucket(self, plan: ExportPlan, bucket: list) -> torch.Tensor:
        """This owner's piece of a bucket, all-gathered over its TP group into the bucket's payload."""
        started = time.perf_counter()
        rows, data = [], []
        for name, *_ in bucket:
            snapshot = self._snapshot.get(name)
            if snapshot is None:
                rows.append([_ABSENT, 0, 0, 0])
                continue
            row, chunks = _encode(self._sent(plan.local[name].value()), snapshot)
            rows.append(row)
            data += [c.to(plan.local[name].param.device) for c in chunks]
        first = plan.local[bucket[0][0]]
        header = torch.tensor(rows, dtype=torch.int64, device=first.param.device)
        piece = torch.cat([header.view(-1).view(torch.uint8), *data])
        self.stats["seconds"] += time.perf_counter() - started
        return _gather_pieces(piece, first.group, first.tp_size)

    def _apply(self, plan: ExportPlan, bucket: list, payload: torch.Tensor, rebuild: bool
               ) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
        """Count a bucket's changes and, while ``rebuild``, apply them to the mirror: yields ``(name,
        new full tensor)`` for each changed tensor, ``(name, None)`` for one that fails its checksum."""
        size = plan.splits[bucket[0][0]][1]
        sizes = payload[: 8 * size].view(torch.int64).tolist()
        offsets = [8 * size + sum(sizes[:r]) for r in range(size)]
        shapes = [(math.prod(shape) // _parts(plan, name), self._sent_dtype(dtype)) for name, _, _, shape, dtype in bucket]
        pieces = [_decode(payload[o: o + s], shapes) for o, s in zip(offsets, sizes)]
        for i, (name, *_) in enumerate(bucket):
            records = [pieces[r][i] for r in range(_parts(plan, name))]
            changed = sum(p.changed for p in records)
            self.stats["changed"] += changed
            if changed and rebuild:
                yield name, _rebuilt(name, self.mirror[name], records, plan.splits[name][0], payload.device)

    def _share_changed(self, device) -> None:
        """Every rank's ``changed``: the receivers' count (each of them counts the whole model)."""
        count = torch.tensor([self.stats["changed"]], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        self.stats["changed"] = int(count)


def _rebuilt(name: str, mirror: torch.Tensor, records: list[_Part], partition_dim: Optional[int], device
             ) -> Optional[torch.Tensor]:
    """``mirror`` with each TP shard's changes applied, checked against its checksum and written back
    to the mirror: the new full tensor on ``device``, or None (the mirror left as it was) on a mismatch."""
    full = mirror.to(device, copy=True)
    shards = [shard(full, name, partition_dim, r, len(records), gated=True) for r in range(len(records))]
    for piece, record in zip(shards, records):
        flat = piece.view(-1)
        if record.mode == _DENSE:
            flat.copy_(record.values)
        elif record.changed:
            flat[record.index.long()] = record.values
        if checksum(piece) != record.checksum:
            return None
    new = merge(shards, name, partition_dim, gated=True)
    mirror.copy_(new)
    return new
