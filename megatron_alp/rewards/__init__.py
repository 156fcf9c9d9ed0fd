"""Rewards by registry name (config `reward.name`).

A reward is a :class:`RewardFn`: called on a batch of final response texts and their ground
truths, it returns one float per response, never raising for anything the model wrote; 1.0 (full
credit) or more marks a correct answer (:mod:`megatron_alp.batches.scoring`). Add one
with :func:`register_reward`; a factory receives the :class:`~megatron_alp.config.RewardConfig`.
Rewards that run untrusted or possibly slow code (parsers, checkers) should score in a
:class:`~megatron_alp.rewards.worker_pool.ScoringPool`, which bounds the time of every sample.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from megatron_alp.config import RewardConfig


class RewardFn(abc.ABC):
    """Batched reward: ``reward(responses, ground_truths) -> scores``."""

    @abc.abstractmethod
    def __call__(self, responses: list[str], ground_truths: list[str]) -> list[float]:
        """One score per response; bad model output scores 0.0 and never raises."""

    def close(self) -> None:
        """Release worker processes, if any."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


REWARDS: dict[str, Callable[["RewardConfig"], RewardFn]] = {}


def register_reward(name: str):
    """Decorator adding a reward factory (a class or function taking a RewardConfig) under ``name``."""

    def deco(factory):
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = factory
        return factory

    return deco


def build_reward(cfg: "RewardConfig") -> RewardFn:
    """The reward named by ``cfg.name``."""
    if cfg.name not in REWARDS:
        raise ValueError(f"reward.name={cfg.name!r} is not a registered reward; choose one of {sorted(REWARDS)}")
    return REWARDS[cfg.name](cfg)


def check_batch(responses: list, ground_truths: list) -> None:
    if len(responses) != len(ground_truths):
        raise ValueError(f"reward called with {len(responses)} responses but {len(ground_truths)} ground truths")


from megatron_alp.rewards import math_verify as _math_verify  # noqa: E402,F401  (registers built-ins)
