"""Dynamic sampling (DAPO): train only on GRPO groups with some but not all answers correct.

DAPO keeps a group when ``0 < #correct < n`` (:func:`keep_groups`, filter ``correct``, the default):
a group whose answers are all right or all wrong teaches nothing about the task, and one whose
rewards differ only through shaping (the overlong punishment of correct answers) would train on
the shaping alone. Correctness is the verifier's outcome before any punishment
(:class:`~megatron_alp.batches.scoring.Scores`). Filter ``reward`` keeps a group when its final
rewards are not all equal, i.e. exactly the groups with a non-zero advantage. Under ``correct`` a
kept group can still have equal rewards (a correct answer punished down to a wrong one's reward):
it trains with zero advantage and ``batch/zero_variance_groups`` counts it.

Dropped groups are replaced by sampling more prompts until the batch holds its number of groups
again. :func:`fill_batch` is that loop, independent of how rollouts are produced: the caller
passes the first round and ``more(num_prompts, round)``, which draws, generates and scores that
many new prompts (the synchronous trainer: the next prompts of its sampler, with per-sample seeds
of (seed, iteration, round); an asynchronous pipeline: whatever it produces).

An extra round asks for the missing groups divided by the keep rate seen so far, times a margin:
a round costs the latency of its longest response whatever its size, so a few extra samples are
cheaper than another round. The request is capped at ``max_prompts``. Counts depend only on the
scores, which every rank holds, so every rank asks for the same numbers. When ``max_rounds``
extra rounds leave the batch short, it is completed with dropped groups (the earliest generated
first): the run goes on, and ``dynamic_sampling/filled_groups`` counts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

import torch


@dataclass
class Groups:
    """Scored GRPO groups: one prompt per group, its ``n`` trajectories consecutive, one reward and
    one correctness flag each."""

    prompts: list  # data.Prompt, one per group
    trajectories: list  # rollout.base.Trajectory, n per prompt, grouped in prompt order
    rewards: torch.Tensor  # [len(trajectories)] float32, CPU: the final reward, punishments included
    correct: torch.Tensor  # [len(trajectories)] bool, CPU: the verifier's outcome, before any punishment

    def __post_init__(self):
        for name in ("rewards", "correct"):
            value = getattr(self, name)
            if value.dim() != 1 or len(value) != len(self.trajectories):
                raise ValueError(f"Groups: {len(self.trajectories)} trajectories but {name} of shape "
                                 f"{tuple(value.shape)} (expected one per trajectory)")
        whole = len(self.trajectories) % len(self.prompts) == 0 if self.prompts else not self.trajectories
        if not whole:
            raise ValueError(f"Groups: {len(self.trajectories)} trajectories are not a whole number of "
                             f"groups for {len(self.prompts)} prompts")

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def n(self) -> int:
        """Trajectories per group (0 when empty)."""
        return len(self.trajectories) // len(self.prompts) if self.prompts else 0

    def select(self, groups: Sequence[int]) -> "Groups":
        """The groups ``groups`` (indices), in that order."""
        n, rows = max(self.n, 1), list(groups)
        return Groups([self.prompts[g] for g in groups],
                      [t for g in groups for t in self.trajectories[g * n:(g + 1) * n]],
                      self.rewards.view(-1, n)[rows].reshape(-1), self.correct.view(-1, n)[rows].reshape(-1))

    @staticmethod
    def concat(parts: Sequence["Groups"]) -> "Groups":
        return Groups([p for g in parts for p in g.prompts], [t for g in parts for t in g.trajectories],
                      torch.cat([g.rewards.float().cpu() for g in parts]),
                      torch.cat([g.correct.bool().cpu() for g in parts]))


def zero_variance(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """``[num_groups]`` bool: the groups of ``n`` consecutive rewards that are all equal (exactly,
    as :func:`~megatron_alp.algorithms.advantages.group_advantages` zeroes them)."""
    groups = rewards.view(-1, n)
    return (groups == groups[:, :1]).all(-1)


Filter = Literal["correct", "reward"]


def keep_groups(groups: Groups, n: int, by: Filter) -> torch.Tensor:
    """``[num_groups]`` bool: the groups dynamic sampling keeps. ``correct``: ``0 < #correct < n``
    (DAPO); ``reward``: the final rewards are not all equal."""
    if by == "reward":
        return ~zero_variance(groups.rewards, n)
    if by == "correct":
        right = groups.correct.view(-1, n).sum(-1)
        return (right > 0) & (right < n)
    raise ValueError(f"dynamic sampling filter {by!r}: expected 'correct' or 'reward'")


def round_size(missing: int, kept: int, generated: int, margin: float, max_prompts: int) -> int:
    """Prompts an extra round asks for: ``missing / keep_rate * margin`` with the keep rate seen so
    far (``kept / generated`` groups; with none kept yet, as if the next one would be), between
    ``missing`` and ``max_prompts``."""
    rate = max(kept, 1) / max(generated, 1)
    return max(missing, min(max_prompts, math.ceil(margin * missing / rate)))


def fill_batch(first: Groups, more: Callable[[int, int], Groups], wanted: int, n: int, max_rounds: int,
               margin: float = 1.25, max_prompts: Optional[int] = None, by: Filter = "correct") -> tuple[Groups, dict]:
    """``wanted`` groups: the first ``wanted`` groups :func:`keep_groups` keeps (filter ``by``), in
    generation order, drawing extra rounds ``more(num_prompts, round)`` (round = 1, 2, ...) while
    fewer were found, at most ``max_rounds`` of them, each of at most ``max_prompts`` prompts
    (default 4 x ``wanted``). A batch still short then is completed with the earliest dropped
    groups. Returns the batch (groups in generation order) and ``dynamic_sampling/*`` statistics."""
    if wanted < 1 or n < 1 or max_rounds < 0 or margin < 1:
        raise ValueError(f"fill_batch: expected wanted >= 1, n >= 1, max_rounds >= 0, margin >= 1 "
                         f"(got {wanted}, {n}, {max_rounds}, {margin})")
    max_prompts = 4 * wanted if max_prompts is None else max_prompts
    if max_prompts < wanted:
        raise ValueError(f"fill_batch: max_prompts={max_prompts} is below the {wanted} groups wanted")
    rounds = [_checked(first, n, None, 0)]
    passed = [keep_groups(first, n, by)]
    kept, generated = int(passed[0].sum()), len(first)
    while kept < wanted and len(rounds) <= max_rounds:
        ask = round_size(wanted - kept, kept, generated, margin, max_prompts)
        extra = _checked(more(ask, len(rounds)), n, ask, len(rounds))
        rounds.append(extra)
        passed.append(keep_groups(extra, n, by))
        kept, generated = kept + int(passed[-1].sum()), generated + len(extra)
    if generated < wanted:
        raise ValueError(f"fill_batch: {generated} groups generated for {wanted} wanted and no extra round "
                         f"allowed (max_rounds={max_rounds})")
    flags = torch.cat(passed).tolist()
    keep = [g for g, ok in enumerate(flags) if ok][:wanted]
    filler = [g for g, ok in enumerate(flags) if not ok][:wanted - len(keep)]
    everything = Groups.concat(rounds)
    stats = {
        "dynamic_sampling/rounds": float(len(rounds) - 1),
        "dynamic_sampling/generated_groups": float(generated),
        "dynamic_sampling/kept_frac": kept / generated,
        "dynamic_sampling/filled_groups": float(len(filler)),
        "dynamic_sampling/reward_mean": everything.rewards.mean().item(),
    }
    return everything.select(sorted(keep + filler)), stats


def _checked(groups: Groups, n: int, asked: Optional[int], round_: int) -> Groups:
    if groups.prompts and groups.n != n:
        raise ValueError(f"dynamic sampling round {round_}: groups of {groups.n} trajectories, expected n={n}")
    if asked is not None and len(groups) != asked:
        raise ValueError(f"dynamic sampling round {round_}: asked for {asked} prompts, got {len(groups)} groups")
    return groups
