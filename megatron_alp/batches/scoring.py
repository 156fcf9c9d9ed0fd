"""Scores of sampled trajectories: the configured reward (``reward.name``) of each final response
against its prompt's ground truth, plus DAPO's overlong punishment (``reward.overlong_buffer``),
and whether the response is correct.

A response is correct when the reward function gives it full credit (:data:`FULL_CREDIT`, 1.0)
before any punishment: for ``math_verify`` (0/1), when the verifier accepts its last boxed answer.
A multi-turn TIR episode is judged by its final response text like any other, and the overlong
punishment never changes correctness. Dynamic sampling filters groups on it
(:mod:`megatron_alp.algorithms.dynamic_sampling`), so that shaping cannot make a group of all-correct
answers look informative.

:func:`score` is the formula, on whichever process holds the reward; :class:`Scorer` is the
trainer's collective form: global rank 0 scores and every rank receives the scores.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from megatron_alp.config import Config
from megatron_alp.rewards import RewardFn
from megatron_alp.rewards.overlong import overlong_penalty

FULL_CREDIT = 1.0


class Scores(NamedTuple):
    """Per trajectory: the final reward the advantages use, and whether the answer is correct."""

    rewards: list[float]
    correct: list[bool]


def overlong_penalties(cfg: Config, trajectories) -> list[float]:
    """The (non-positive) overlong punishment of every trajectory; zeros when it is off."""
    r, limit = cfg.reward, cfg.rollout.sampling.max_response_length
    return [overlong_penalty(len(t.response_ids), limit, r.overlong_buffer, r.overlong_penalty) for t in trajectories]


def score(cfg: Config, reward_fn: RewardFn, trajectories, prompts) -> Scores:
    """One reward and correctness per trajectory; trajectories come ``rollout.sampling.n`` per
    prompt, in prompt order."""
    n = cfg.rollout.sampling.n
    truths = [prompts[i // n].ground_truth for i in range(len(trajectories))]
    task = reward_fn([t.response_text for t in trajectories], truths)
    correct = [s >= FULL_CREDIT for s in task]
    if cfg.reward.overlong_buffer:
        return Scores([s + p for s, p in zip(task, overlong_penalties(cfg, trajectories))], correct)
    return Scores(list(task), correct)


class Scorer:
    """Scores on every rank: rank 0 holds the reward (its worker processes) and scores; the
    others receive the result. Collective."""

    def __init__(self, cfg: Config, reward_fn: RewardFn | None):
        self.cfg = cfg
        self.reward_fn = reward_fn  # on global rank 0 only

    def __call__(self, trajectories, prompts, broadcast: Callable[[Any], Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[len(trajectories)]`` float32 rewards and bool correctness on the CPU, the same on every
        rank. ``broadcast``: rank 0's object on every rank over a CPU (gloo) group, the rollout's
        (:meth:`~megatron_alp.rollout.distributed.DistributedRollout.broadcast`): the other ranks wait
        there while rank 0 scores, which may take minutes, and an NCCL collective would hold them
        under its watchdog's timeout."""
        scores = score(self.cfg, self.reward_fn, trajectories, prompts) if self.reward_fn is not None else None
        rewards, correct = broadcast(scores)
        return torch.tensor(rewards, dtype=torch.float32), torch.tensor(correct, dtype=torch.bool)
