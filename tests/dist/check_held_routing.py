"""Engine routing held on the rank that generated it (megatron_alp.rollout.held_routing), on 2 gloo ranks.

Usage: torchrun --nproc_per_node 2 check_held_routing.py RESULT.json

Each rank plays a replica leader: it makes the routing of its 6 responses (uint8 [tokens, layers, k],
as vLLM returns it, drawn from a seed of (rank, response)), holds it and gathers the results on every
rank as DistributedRollout.collect does. Each rank then fetches the rows of its own data-parallel
share (responses of both leaders; one cut short as a multi-turn episode cuts a turn's routing), and
then a row whose holder has no handle left. The test recomputes every array from its seed.
"""

import gc
import json
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch.distributed as dist

from megatron_alp.rollout.held_routing import STORE, HeldRouting, fetch, hold

LAYERS, K = 48, 8  # Qwen3-30B-A3B's


@dataclass
class Item:
    name: str
    routed_experts: Any


def routing(leader: int, i: int) -> np.ndarray:
    rng = np.random.default_rng([leader, i])
    return rng.integers(0, 128, size=(5 + 3 * i + leader, LAYERS, K), dtype=np.uint8)


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result: dict = {"rank": rank}
    mine = [[Item(f"{rank}/{i}", routing(rank, i))] for i in range(6)]
    whole = len(pickle.dumps(mine))
    hold(mine, rank)
    result["held_here"] = len(STORE)
    gathered: list[Optional[list]] = [None, None]
    dist.all_gather_object(gathered, mine)
    result["gathered_bytes"], result["whole_bytes"] = len(pickle.dumps(gathered[1 - rank])), whole
    del mine
    gc.collect()
    items = [g[0] for leader in gathered for g in leader]  # 12 responses, leader 0's first
    result["all_held"] = all(isinstance(t.routed_experts, HeldRouting) for t in items)
    result["store_after_gather"] = len(STORE)
    # a multi-turn cut of a row this rank trains: rank 0's is held by rank 1, rank 1's by itself (whose
    # uncut handle is then gone: the cut one keeps the array)
    cut = 8 if rank == 0 else 7
    items[cut].routed_experts = items[cut].routed_experts[:4]
    gc.collect()
    share = [i for i in range(12) if i % 2 == rank]  # this rank's rows: of both leaders
    fetch([items[i] for i in share], None)
    result["fetched_equal"] = {}
    for i in share:
        leader, j = divmod(i, 6)
        expected = routing(leader, j)[: 4 if i == cut else None]
        got = items[i].routed_experts
        result["fetched_equal"][i] = isinstance(got, np.ndarray) and got.dtype == np.uint8 and np.array_equal(got, expected)
    result["others_still_held"] = all(isinstance(items[i].routed_experts, HeldRouting) for i in range(12)
                                      if i not in share)
    # a row of the other leader's that the other rank trains: its holder fetched it for itself, so no
    # handle is left there and a late ask is refused
    late = 9 if rank == 0 else 2
    try:
        fetch([items[late]], None)
        result["refused"] = None
    except RuntimeError as err:
        result["refused"] = str(err)
    del items, gathered
    gc.collect()
    result["store_at_end"] = len(STORE)
    with open(out_path.replace(".json", f".{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
