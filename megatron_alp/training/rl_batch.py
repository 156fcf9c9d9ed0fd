"""Trajectories -> padded, target-aligned tensors, split over optimizer steps and data-parallel ranks.

Position ``t`` of every per-token tensor describes the prediction of token ``t + 1`` from the
logits at ``t``: ``targets[:, t] = tokens[:, t + 1]``, and ``loss_mask``, ``rollout_logprobs``,
``old_logprobs``... refer to that target token. A response token ``j`` of a trajectory with a
prompt of length ``P`` therefore lives at index ``P - 1 + j``.

Routing tensors (MoE) are input-aligned like ``tokens``: ``rollout_routing[i, t, l]`` are the
experts layer ``l`` sent token ``t`` to, whose hidden state produces the logits at ``t``. They are
``[N, L, layers, k]`` in a compact dtype (:func:`~megatron_alp.models.routing.routing_dtype`),
:func:`~megatron_alp.models.routing.no_expert` where no routing is given (padding, the last token
the engine never fed back).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_alp.algorithms.advantages import group_advantages
from megatron_alp.algorithms.balance import imbalance, partition, sequence_cost
from megatron_alp.config import Config, ConfigError, TrainerConfig
from megatron_alp.data.trajectory import Trajectory
from megatron_alp.models.routing import no_expert, routing_dtype

ROUTING_FIELDS = ("rollout_routing", "old_routing")


@dataclass
class RLBatch:
    tokens: torch.Tensor  # [N, L] int64, right-padded
    targets: torch.Tensor  # [N, L] int64, tokens shifted left by one
    loss_mask: torch.Tensor  # [N, L] float32
    rollout_logprobs: torch.Tensor  # [N, L] float32
    advantages: torch.Tensor  # [N] float32
    lengths: torch.Tensor  # [N] int64, prompt + response tokens
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    rollout_routing: Optional[torch.Tensor] = None  # MoE: [N, L, layers, k] the engine's experts (R3)
    old_routing: Optional[torch.Tensor] = None  # MoE: [N, L, layers, k] the old-policy pass's own experts (R2)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, index) -> "RLBatch":
        """Rows ``index`` (a slice or index tensor), trimmed to their longest sequence."""
        rows = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        picked = {k: (v[index] if v is not None else None) for k, v in rows.items()}
        width = int(picked["lengths"].max().item()) if len(picked["lengths"]) else 1
        return RLBatch(**{k: (v[:, :width] if v is not None and v.dim() >= 2 else v) for k, v in picked.items()})

    def pad_to_multiple(self, multiple: int, pad_id: int) -> "RLBatch":
        """Right-pad the sequence dimension to a multiple (sequence parallelism shards it)."""
        extra = (-self.tokens.shape[1]) % multiple
        if not extra:
            return self
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and v.dim() >= 2:
                fill = pad_id if v.dtype == torch.long else no_expert(v.dtype) if f.name in ROUTING_FIELDS else 0
                v = torch.cat([v, v.new_full((v.shape[0], extra, *v.shape[2:]), fill)], dim=1)
            out[f.name] = v
        return RLBatch(**out)

    def to(self, device) -> "RLBatch":
        return RLBatch(**{
            f.name: (getattr(self, f.name).to(device) if getattr(self, f.name) is not None else None)
            for f in dataclasses.fields(self)
        })


def build_rl_batch(trajectories: list[Trajectory], advantages: torch.Tensor, pad_id: int, routing: bool = True
                   ) -> RLBatch:
    """Pack trajectories into one right-padded, target-aligned batch; with ``routing``, their engine
    routing too (:func:`engine_routing`)."""
    n = len(trajectories)
    lengths = torch.tensor([len(t.prompt_ids) + len(t.response_ids) for t in trajectories], dtype=torch.long)
    width = int(lengths.max().item()) if n else 1
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros(n, width)
    rollout = torch.zeros(n, width)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        if p == 0:
            raise ValueError(f"trajectory {i} has an empty prompt")
        tokens[i, :p] = torch.tensor(t.prompt_ids)
        if r:
            tokens[i, p: p + r] = torch.tensor(t.response_ids)
            mask[i, p - 1: p - 1 + r] = torch.tensor(t.loss_mask, dtype=torch.float32)
            rollout[i, p - 1: p - 1 + r] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1), value=pad_id)
    rollout = rollout * mask
    return RLBatch(tokens, targets, mask, rollout, advantages.float().reshape(n), lengths,
                   rollout_routing=engine_routing(trajectories, width) if routing else None)


def engine_routing(trajectories: list[Trajectory], width: int) -> Optional[torch.Tensor]:
    """The engine's routing of every trajectory, ``[N, width, layers, k]`` (None when the engine
    returned none); positions past each trajectory's routing hold :func:`no_expert`."""
    given = [t.routed_experts is not None for t in trajectories]
    if not any(given):
        return None
    held = [i for i, t in enumerate(trajectories) if given[i] and not isinstance(t.routed_experts, np.ndarray)]
    if held:
        raise ValueError(f"trajectory {held[0]}: its engine routing is still held by the rollout side "
                         f"({trajectories[held[0]].routed_experts!r}): fetch it first (DistributedRollout.fetch_routing)")
    if not all(given):
        raise ValueError(f"trajectory {given.index(False)} carries no engine routing while others do "
                         "(rollout.return_routed_experts)")
    shapes = {t.routed_experts.shape[1:] for t in trajectories}
    if len(shapes) != 1:
        raise ValueError(f"trajectories carry engine routing of different [layers, k] shapes: {sorted(shapes)}")
    largest = max((int(t.routed_experts.max()) for t in trajectories if t.routed_experts.size), default=0)
    dtype = routing_dtype(largest + 1)
    out = torch.full((len(trajectories), width, *shapes.pop()), no_expert(dtype), dtype=dtype)
    for i, t in enumerate(trajectories):
        out[i, : len(t.routed_experts)] = torch.from_numpy(t.routed_experts.astype("int64")).to(dtype)
    return out


def exclude_from_loss(batch: RLBatch, rows: torch.Tensor) -> None:
    """Take the responses ``rows`` (bool ``[N]``) out of the loss, in place: their loss tokens are
    masked, so they leave the token and sequence counts of the normalisation as if deleted
    (``loss.mask_truncated``). Their rewards have already shaped their group's advantages."""
    batch.loss_mask[rows] = 0.0
    batch.rollout_logprobs[rows] = 0.0


def dp_assignment(rows: int, dp_size: int, mini_batches: int = 1,
                  costs: Optional[Sequence[float]] = None) -> list[list[list[int]]]:
    """Row indices of each data-parallel rank in each of ``mini_batches`` equal mini-batches (in
    order): ``out[m][r]``. Each optimizer step trains on the same rows whatever the data-parallel size
    (sizes checked by the trainer). Without ``costs`` a rank takes a contiguous equal share of each
    mini-batch; with ``costs`` (one per row, e.g. :func:`~megatron_alp.algorithms.balance.sequence_cost`) the
    rows are split by greedy LPT on cost, the same split on every rank, and counts may differ."""
    per_mini = rows // mini_batches
    out = []
    for m in range(mini_batches):
        start = m * per_mini
        if costs is None:
            per = per_mini // dp_size
            out.append([list(range(start + r * per, start + (r + 1) * per)) for r in range(dp_size)])
        else:
            split = partition([costs[i] for i in range(start, start + per_mini)], dp_size)
            out.append([[start + i for i in part] for part in split])
    return out


def dp_shard(batch: RLBatch, assignment: list[list[list[int]]], dp_rank: int) -> tuple[RLBatch, list[int]]:
    """This rank's rows of every mini-batch of :func:`dp_assignment`, in order, and how many of
    them belong to each mini-batch (for :func:`mini_batches`)."""
    rows = [part[dp_rank] for part in assignment]
    return batch.select(torch.tensor([i for r in rows for i in r], dtype=torch.long)), [len(r) for r in rows]


def mini_batches(batch: RLBatch, sizes: Sequence[int]) -> list[RLBatch]:
    """Consecutive mini-batches of ``sizes`` rows (one optimizer step each)."""
    bounds = [0, *itertools.accumulate(sizes)]
    return [batch.select(slice(a, b)) for a, b in zip(bounds, bounds[1:])]


def training_batch(cfg: Config, trajectories: list[Trajectory], rewards: torch.Tensor, pad_id: int,
                   routing: bool = True) -> tuple[RLBatch, torch.Tensor]:
    """The RL batch of scored trajectories (``rollout.sampling.n`` per prompt) as the config asks:
    GRPO advantages (``advantage``), and with ``loss.mask_truncated`` the responses cut by the length
    limit out of the loss. Returns the batch and which responses were truncated (bool ``[N]``).
    ``routing``: with the engine routing (:func:`build_rl_batch`)."""
    advantages = group_advantages(rewards, cfg.rollout.sampling.n, cfg.advantage.norm_by_std, cfg.advantage.eps)
    batch = build_rl_batch(trajectories, advantages, pad_id, routing)
    truncated = torch.tensor([t.finish_reason == "length" for t in trajectories])
    if cfg.loss.mask_truncated:
        exclude_from_loss(batch, truncated)
    return batch, truncated


def check_batch_layout(trainer: TrainerConfig, n: int, dp_size: int) -> None:
    """An iteration's responses must split into equal mini-batches of equal data-parallel shares."""
    total = trainer.prompts_per_iteration * n
    if total % (dp_size * trainer.updates_per_iteration):
        raise ConfigError(
            f"trainer.prompts_per_iteration * rollout.sampling.n = {total} responses must split evenly "
            f"into data-parallel size {dp_size} x trainer.updates_per_iteration {trainer.updates_per_iteration}"
        )


def data_parallel_split(batch: RLBatch, trainer: TrainerConfig, hidden_size: int, dp_size: int, dp_rank: int
                        ) -> tuple[RLBatch, list[int], list[int], dict]:
    """This data-parallel rank's rows, their indices in ``batch`` and their mini-batch sizes, and the
    imbalance of the split (max / mean estimated cost per rank, worst mini-batch) with and without
    balancing (``trainer.balance_data_parallel``)."""
    costs = [sequence_cost(n, hidden_size) for n in batch.lengths.tolist()]
    split = {balanced: dp_assignment(len(batch), dp_size, trainer.updates_per_iteration, costs if balanced else None)
             for balanced in {False, trainer.balance_data_parallel}}
    worst = {b: max(imbalance([sum(costs[i] for i in rows) for rows in part]) for part in a)
             for b, a in split.items()}
    local, sizes = dp_shard(batch, split[trainer.balance_data_parallel], dp_rank)
    rows = [i for part in split[trainer.balance_data_parallel] for i in part[dp_rank]]
    return local, rows, sizes, {"batch/dp_imbalance": worst[trainer.balance_data_parallel],
                          "batch/dp_imbalance_unbalanced": worst[False]}
