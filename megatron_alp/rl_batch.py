"""Trajectories -> padded, target-aligned tensors, split over optimizer steps and data-parallel ranks.

Position ``t`` of every per-token tensor describes the prediction of token ``t + 1`` from the
logits at ``t``: ``targets[:, t] = tokens[:, t + 1]``, and ``loss_mask``, ``rollout_logprobs``,
``old_logprobs``... refer to that target token. A response token ``j`` of a trajectory with a
prompt of length ``P`` therefore lives at index ``P - 1 + j``.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_alp.balance import partition
from megatron_alp.rollout.base import Trajectory


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

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, index) -> "RLBatch":
        """Rows ``index`` (a slice or index tensor), trimmed to their longest sequence."""
        rows = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        picked = {k: (v[index] if v is not None else None) for k, v in rows.items()}
        width = int(picked["lengths"].max().item()) if len(picked["lengths"]) else 1
        return RLBatch(**{k: (v[:, :width] if v is not None and v.dim() == 2 else v) for k, v in picked.items()})

    def pad_to_multiple(self, multiple: int, pad_id: int) -> "RLBatch":
        """Right-pad the sequence dimension to a multiple (sequence parallelism shards it)."""
        extra = (-self.tokens.shape[1]) % multiple
        if not extra:
            return self
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and v.dim() == 2:
                fill = pad_id if v.dtype == torch.long else 0
                v = torch.nn.functional.pad(v, (0, extra), value=fill)
            out[f.name] = v
        return RLBatch(**out)

    def to(self, device) -> "RLBatch":
        return RLBatch(**{
            f.name: (getattr(self, f.name).to(device) if getattr(self, f.name) is not None else None)
            for f in dataclasses.fields(self)
        })


def build_rl_batch(trajectories: list[Trajectory], advantages: torch.Tensor, pad_id: int) -> RLBatch:
    """Pack trajectories into one right-padded, target-aligned batch."""
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
    return RLBatch(tokens, targets, mask, rollout, advantages.float().reshape(n), lengths)


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
    mini-batch; with ``costs`` (one per row, e.g. :func:`~megatron_alp.balance.sequence_cost`) the
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
