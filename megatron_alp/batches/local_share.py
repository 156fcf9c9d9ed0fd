"""This rank's share of an iteration's batch: the rows it trains, with their engine routing.

Every rank builds the whole batch of the iteration (tokens, logprobs, advantages: a few bytes a
token) and splits it over the data-parallel ranks. Only then does it fetch the engine routing (MoE,
R3: hundreds of bytes a token) of its own rows from the replica leaders that generated them, and the
layer probe's rows when the probe is due (:mod:`~megatron_alp.rollout.held_routing`), so no rank
holds or receives the routing of rows it does not train.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state as ps

from megatron_alp.algorithms.dynamic_sampling import Groups
from megatron_alp.config import Config
from megatron_alp.training.calibration import probe_sequences
from megatron_alp.training.rl_batch import RLBatch, data_parallel_split, engine_routing, training_batch


@dataclass
class LocalShare:
    batch: RLBatch  # the whole iteration, without engine routing
    truncated: torch.Tensor  # bool [N]: the responses cut by the length limit
    local: RLBatch  # this data-parallel rank's rows, with their engine routing
    sizes: list[int]  # of the local rows, how many each mini-batch takes
    probe: Optional[RLBatch]  # the layer probe's rows, with their engine routing, when it is due
    balance: dict  # batch/dp_imbalance metrics


def local_share(cfg: Config, groups: Groups, rollout, pad_id: int, hidden_size: int, probe: bool) -> LocalShare:
    """Collective: the iteration's batch of ``groups`` and this rank's share of it. ``rollout``: the
    :class:`~megatron_alp.rollout.distributed.DistributedRollout` that holds the engine routing;
    ``probe``: the layer probe runs this iteration (its first rows are wanted on every rank)."""
    trajectories = groups.trajectories
    batch, truncated = training_batch(cfg, trajectories, groups.rewards, pad_id, routing=False)
    local, rows, sizes, balance = data_parallel_split(batch, cfg.trainer, hidden_size,
                                                      ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())
    probed = list(range(len(probe_sequences([range(n) for n in batch.lengths.tolist()])))) if probe else []
    if any(t.routed_experts is not None for t in trajectories):  # the same on every rank
        rollout.fetch_routing([trajectories[i] for i in sorted(set(rows) | set(probed))])
    local.rollout_routing = engine_routing([trajectories[i] for i in rows], local.tokens.shape[1])
    probe_batch = None
    if probe:
        probe_batch = batch.select(torch.tensor(probed, dtype=torch.long))
        probe_batch.rollout_routing = engine_routing([trajectories[i] for i in probed], probe_batch.tokens.shape[1])
    return LocalShare(batch, truncated, local, sizes, probe_batch, balance)
