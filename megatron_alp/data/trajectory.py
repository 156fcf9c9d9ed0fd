"""What the trainer learns from: one response to one prompt, as the rollout side produced it.

The rollout engines (:mod:`megatron_alp.rollout`) and multi-turn episodes (:mod:`megatron_alp.tir`)
produce trajectories; the training engine (:mod:`megatron_alp.training.rl_batch`) turns them into
tensors. Neither side needs the other: both know this type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class Trajectory:
    """What the trainer learns from: one response (single- or multi-turn) to one prompt.

    ``response_ids`` holds every token after the prompt (model tokens and, in multi-turn
    episodes, tool outputs); ``loss_mask`` is 1 on the tokens the policy is trained on and 0 on
    tool outputs and void turns; ``rollout_logprobs`` is aligned with ``response_ids`` (0.0 where
    the mask is 0). ``routed_experts`` (MoE, when the engine returns routing) holds the experts the
    engine sent token ``t`` of prompt + response to at each layer, ``[tokens, layers, k]``, for the
    tokens it fed through the model (all but the last, or fewer)."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    loss_mask: list[int]
    response_text: str
    finish_reason: str
    num_turns: int = 1
    info: dict = field(default_factory=dict)
    routed_experts: Optional[np.ndarray] = None
    # The weight version (trainer iterations) that generated it; with partial rollouts the oldest of
    # its spans (info["version_spans"]). Set by the trainer's rollout layer.
    policy_version: Optional[int] = None

    def __post_init__(self):
        n = len(self.response_ids)
        if len(self.rollout_logprobs) != n or len(self.loss_mask) != n:
            raise ValueError(
                f"trajectory misaligned: {n} response tokens, {len(self.rollout_logprobs)} logprobs, "
                f"{len(self.loss_mask)} mask entries"
            )
        check_routing(self.routed_experts, len(self.prompt_ids) + n)

    @classmethod
    def from_completion(cls, c) -> "Trajectory":
        """The single-turn trajectory of an engine's :class:`~megatron_alp.rollout.base.Completion`."""
        return cls(
            prompt_ids=list(c.prompt_ids),
            response_ids=list(c.response_ids),
            rollout_logprobs=list(c.logprobs),
            loss_mask=[1] * len(c.response_ids),
            response_text=c.text,
            finish_reason=c.finish_reason,
            info={"version_spans": list(c.version_spans)} if c.version_spans else {},
            routed_experts=c.routed_experts,
        )


def check_routing(routed: Optional[np.ndarray], tokens: int) -> None:
    """Engine routing must be ``[t, layers, k]`` integers for at most the sequence's ``tokens``."""
    if routed is None:
        return
    if routed.ndim != 3 or routed.dtype.kind not in "iu":
        raise ValueError(f"routed experts: expected an integer array [tokens, layers, k], got "
                         f"{routed.dtype} {tuple(routed.shape)}")
    if len(routed) > tokens:
        raise ValueError(f"routed experts cover {len(routed)} tokens of a {tokens}-token sequence")
