"""iter_hf_weights with receivers: only they get the tensors, the same bits as the everyone gather.

Usage: torchrun --nproc_per_node 2 check_hf_gather.py RESULT.json

For TP=2 and PP=2 (tiny Qwen3, tied embeddings) and EP=2 (tiny Qwen3-MoE), with receivers [0]
and then [1]: the receiver yields the names, order, dtypes and bits of the gather to every rank
(receivers=None); the other rank yields nothing; and each rank's received bytes (counted at the
torch.distributed calls) are those of the everyone gather on the receiver and nothing but the
TP all-gather share elsewhere. Results per layout and receiver go to RESULT.json.
"""

import contextlib
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from common import build, reinit
from megatron_alp.models.hf_weights import iter_hf_weights

LAYOUTS = {"tp2": ("qwen3", 2, 1, 1), "pp2": ("qwen3", 1, 2, 1), "ep2": ("qwen3_moe", 1, 1, 2)}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def received_bytes():
    """Counts what this rank receives: the other ranks' parts of an all-gather, a broadcast from
    another rank, a point-to-point receive. Yields a one-element list holding the count."""
    count, inside = [0], []
    all_gather, broadcast, irecv = dist.all_gather, dist.broadcast, dist.irecv

    def counting_all_gather(parts, tensor, *args, **kwargs):
        count[0] += sum(map(nbytes, parts)) - nbytes(tensor)
        return all_gather(parts, tensor, *args, **kwargs)

    def counting_broadcast(tensor, src=None, *args, **kwargs):
        count[0] += 0 if src == dist.get_rank() else nbytes(tensor)
        return broadcast(tensor, src, *args, **kwargs)

    def counting_irecv(tensor, *args, **kwargs):
        # the CPU shims' torch-function mode calls irecv again, through this very wrapper: count once
        outer = not inside
        if outer:
            count[0] += nbytes(tensor)
            inside.append(True)
        try:
            return irecv(tensor, *args, **kwargs)
        finally:
            if outer:
                inside.clear()

    def install(*fns) -> None:  # P2POp accepts only distributed_c10d's own irecv
        dist.all_gather, dist.broadcast, dist.irecv = fns
        distributed_c10d.irecv = fns[2]

    install(counting_all_gather, counting_broadcast, counting_irecv)
    try:
        yield count
    finally:
        install(all_gather, broadcast, irecv)


def gather(model, receivers):
    with received_bytes() as count:
        # small buckets: many per stage and expert slice, each delivered on its own
        out = [(n, t.clone()) for n, t in iter_hf_weights(model, bucket_bytes=16 << 10, receivers=receivers)]
    return out, count[0]


def main():
    results = {}
    for layout, (family, tp, pp, ep) in LAYOUTS.items():
        model = build(family, reinit(tp, pp, ep=ep))
        rank = dist.get_rank()
        for p in model.parameters():  # distinct values on every rank, so a wrong source shows
            p.data.normal_(generator=torch.Generator().manual_seed(1000 * rank + p.numel()))
        everyone, everyone_bytes = gather(model, None)
        assert everyone, f"{layout}: the gather to every rank yielded nothing"
        for receiver in (0, 1):
            got, got_bytes = gather(model, [receiver])
            if rank == receiver:
                assert [n for n, _ in got] == [n for n, _ in everyone], f"{layout}: other names or order"
                for (name, t), (_, ref) in zip(got, everyone):
                    assert t.dtype == ref.dtype and torch.equal(t, ref), f"{layout}: {name} differs"
                assert got_bytes == everyone_bytes, (layout, receiver, got_bytes, everyone_bytes)
            else:
                assert got == [], f"{layout}: rank {rank} is no receiver but got {[n for n, _ in got][:3]}"
                tp_share = everyone_bytes if tp > 1 else 0  # at TP=2 all it receives is its all-gather share
                assert got_bytes == tp_share, (layout, receiver, got_bytes, tp_share)
            results[f"{layout}_to{receiver}_rank{rank}"] = {
                "tensors": len(got), "bytes": sum(nbytes(t) for _, t in got), "received": got_bytes,
                "everyone_tensors": len(everyone), "everyone_received": everyone_bytes}
    merged = [None] * dist.get_world_size()
    dist.all_gather_object(merged, results)
    if rank == 0:
        json.dump({k: v for r in merged for k, v in r.items()}, open(sys.argv[1], "w"), indent=1)
    print("OK", flush=True)


main()
