"""Rewards of sampled trajectories: the configured reward (``reward.name``) of each final response
against its prompt's ground truth, plus DAPO's overlong punishment (``reward.overlong_buffer``).

:func:`score` is the formula, on whichever process holds the reward; :class:`Scorer` is the
trainer's collective form: global rank 0 scores and every rank receives the rewards.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from megatron_alp.config import Config
from megatron_alp.rewards import RewardFn
from megatron_alp.rewards.overlong import overlong_penalty


def overlong_penalties(cfg: Config, trajectories) -> list[float]:
    """The (non-positive) overlong punishment of every trajectory; zeros when it is off."""
    r, limit = cfg.reward, cfg.rollout.sampling.max_response_length
    return [overlong_penalty(len(t.response_ids), limit, r.overlong_buffer, r.overlong_penalty) for t in trajectories]


def score(cfg: Config, reward_fn: RewardFn, trajectories, prompts) -> list[float]:
    """One reward per trajectory; trajectories come ``rollout.sampling.n`` per prompt, in prompt order."""
    n = cfg.rollout.sampling.n
    truths = [prompts[i // n].ground_truth for i in range(len(trajectories))]
    scores = reward_fn([t.response_text for t in trajectories], truths)
    if cfg.reward.overlong_buffer:
        scores = [s + p for s, p in zip(scores, overlong_penalties(cfg, trajectories))]
    return scores


class Scorer:
    """Rewards on every rank: rank 0 holds the reward (its worker processes) and scores; the
    others receive the result. Collective."""

    def __init__(self, cfg: Config, reward_fn: RewardFn | None):
        self.cfg = cfg
        self.reward_fn = reward_fn  # on global rank 0 only

    def __call__(self, trajectories, prompts, broadcast: Callable[[Any], Any]) -> torch.Tensor:
        """``[len(trajectories)]`` float32 rewards on the CPU, the same on every rank. ``broadcast``:
        rank 0's object on every rank over a CPU (gloo) group, the rollout's
        (:meth:`~megatron_alp.rollout.distributed.DistributedRollout.broadcast`): the other ranks wait
        there while rank 0 scores, which may take minutes, and an NCCL collective would hold them
        under its watchdog's timeout."""
        scores = score(self.cfg, self.reward_fn, trajectories, prompts) if self.reward_fn is not None else None
        return torch.tensor(broadcast(scores), dtype=torch.float32)
