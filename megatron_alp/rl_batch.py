"""Trajectories -> padded, target-aligned tensors, split over data-parallel ranks and micro-batches.

Position ``t`` of every per-token tensor describes the prediction of token ``t + 1`` from the
logits at ``t``: ``targets[:, t] = tokens[:, t + 1]``, and ``loss_mask``, ``rollout_logprobs``,
``old_logprobs``... refer to that target token. A response token ``j`` of a trajectory with a
prompt of length ``P`` therefore lives at index ``P - 1 + j``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

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


def dp_shard(batch: RLBatch, dp_rank: int, dp_size: int, mini_batches: int = 1) -> RLBatch:
    """This data-parallel rank's rows: its contiguous share of each of the ``mini_batches`` equal
    mini-batches, in order, so that :func:`mini_batches` of the shard gives this rank's part of
    every optimizer step and each step trains on the same rows whatever the data-parallel size
    (sizes checked by the trainer)."""
    per_mini = len(batch) // mini_batches
    per = per_mini // dp_size
    starts = [m * per_mini + dp_rank * per for m in range(mini_batches)]
    return batch.select(torch.cat([torch.arange(s, s + per) for s in starts]))


def mini_batches(batch: RLBatch, count: int) -> list[RLBatch]:
    """Split into ``count`` equal mini-batches (one optimizer step each), in order."""
    per = len(batch) // count
    return [batch.select(slice(i * per, (i + 1) * per)) for i in range(count)]


def micro_batches(batch: RLBatch, size: int, pad_multiple: int, pad_id: int) -> list[RLBatch]:
    """Micro-batches of ``size`` rows, grouped by length so each is padded as little as possible."""
    order = torch.argsort(batch.lengths, descending=True, stable=True)
    return [
        batch.select(order[i: i + size]).pad_to_multiple(pad_multiple, pad_id)
        for i in range(0, len(batch), size)
    ]
