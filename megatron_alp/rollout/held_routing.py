"""Engine routing kept on the rank that generated it until a rank that trains it asks for it.

Routing replay R3 needs the experts the engine chose for every token: ``[tokens, layers, k]`` per
response, about 400 bytes a token on a 48-layer top-8 model, several GiB an iteration at 30B.
Gathering it with the rest of a batch to every rank would cost data-parallel-size times the traffic
and host memory that training needs, since each rank trains only its share. So on a multi-rank job
a replica leader keeps each response's routing in its process's store and ships a
:class:`HeldRouting` in its place: a small picklable handle that slices like the array's first
dimension (a multi-turn episode cuts a turn's routing to its context) and passes the shape checks
of :func:`~megatron_alp.data.trajectory.check_routing`. :func:`fetch` (collective) delivers to each
rank exactly the routing of the rows it names.

The store forgets an entry when the last handle to it in the holder's process is gone. Every rank
keeps the same trajectories (the rollout gathers the same results everywhere), so the holder's own
copies live exactly as long as any rank may still ask for them.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Optional

import numpy as np
import torch.distributed as dist


class _Store:
    """This process's held arrays, each with the number of live handles to it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.arrays: dict[int, np.ndarray] = {}
        self.handles: dict[int, int] = {}
        self.keys = itertools.count()

    def put(self, array: np.ndarray) -> int:
        with self.lock:
            key = next(self.keys)
            self.arrays[key], self.handles[key] = array, 0
            return key

    def retain(self, key: int) -> bool:
        """Count one more handle to ``key``; False (nothing counted) when it is no longer held."""
        with self.lock:
            if key not in self.handles:
                return False
            self.handles[key] += 1
            return True

    def release(self, key: int) -> None:
        with self.lock:
            self.handles[key] -= 1
            if not self.handles[key]:
                del self.handles[key], self.arrays[key]

    def get(self, key: int) -> Optional[np.ndarray]:
        with self.lock:
            return self.arrays.get(key)

    def __len__(self) -> int:
        with self.lock:
            return len(self.arrays)


STORE = _Store()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class HeldRouting:
    """The first ``length`` tokens of the routing array ``key`` that rank ``holder`` holds; shape and
    dtype as the array's. A handle alive in the holder's process keeps the array there."""

    ndim = 3

    def __init__(self, holder: int, key: int, length: int, tail: tuple[int, int], dtype: str):
        self.holder, self.key, self.length, self.tail, self.dtype = holder, key, length, tuple(tail), np.dtype(dtype)
        if holder == _rank() and STORE.retain(key):
            weakref.finalize(self, STORE.release, key)

    def __reduce__(self):
        return HeldRouting, (self.holder, self.key, self.length, self.tail, self.dtype.str)

    def __len__(self) -> int:
        return self.length

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.length, *self.tail)

    def __getitem__(self, index: slice) -> "HeldRouting":
        if not (isinstance(index, slice) and index.start is None and index.step is None):
            raise TypeError(f"held engine routing slices only as [:n], not {index!r}: fetch it first")
        stop = self.length if index.stop is None else max(0, min(index.stop, self.length))
        return HeldRouting(self.holder, self.key, stop, self.tail, self.dtype.str)

    def __repr__(self) -> str:
        return f"HeldRouting(rank {self.holder}, key {self.key}, {self.shape} {self.dtype})"


def hold(results: list, rank: int) -> None:
    """Replace, in place, the routing arrays of ``results`` (groups of items with a ``routed_experts``
    attribute: completions or trajectories) by handles that rank ``rank`` (this process) holds."""
    for group in results:
        for item in group:
            routed = getattr(item, "routed_experts", None)
            if isinstance(routed, np.ndarray):
                key = STORE.put(routed)
                item.routed_experts = HeldRouting(rank, key, len(routed), routed.shape[1:], routed.dtype.str)


def fetch(items: list, group: Any) -> None:
    """Collective over ``group`` (a group of every rank; each calls it with the items whose routing it needs):
    replace the held routing of ``items`` (objects with a ``routed_experts`` attribute) by the arrays,
    sent by their holders to this rank only. Arrays already local stay as they are."""
    wanted = [(i, item.routed_experts) for i, item in enumerate(items) if isinstance(item.routed_experts, HeldRouting)]
    asks: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(asks, sorted({(h.holder, h.key) for _, h in wanted}), group=group)
    me = _rank()
    received: dict[tuple[int, int], np.ndarray] = {}
    for holder in sorted({h for ask in asks for h, _ in ask}):
        parts = None
        if holder == me:
            parts = [{(h, key): STORE.get(key) for h, key in ask if h == holder} for ask in asks]
        out: list[Any] = [None]
        dist.scatter_object_list(out, parts, src=holder, group=group)
        received.update(out[0])
    gone = [h for _, h in wanted if received[h.holder, h.key] is None]
    if gone:
        raise RuntimeError(f"{gone[0]!r} is no longer held by rank {gone[0].holder}: a handle to it must stay "
                           "alive in the holder's process until every rank fetched it")
    for i, h in wanted:
        items[i].routed_experts = received[h.holder, h.key][: h.length]
