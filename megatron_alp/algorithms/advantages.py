"""GRPO group-normalised advantages: one scalar per response, shared by all its tokens."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """``A_i = (r_i - mean(group)) / (std(group) + eps)`` (or without the division).

    ``rewards`` ``[num_prompts * group_size]`` lists each prompt's responses consecutively. The std
    is the unbiased sample std, as in GRPO. A group whose rewards are all equal, or a group of one,
    carries no learning signal and gets exactly zero advantages. Returns fp32 ``[num_prompts * n]``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a 1-D tensor [num_prompts * group_size], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 (got {group_size})")
    if rewards.numel() % group_size:
        raise ValueError(f"rewards: {rewards.numel()} values are not a whole number of groups of {group_size}")
    if not eps > 0:
        raise ValueError(f"advantage.eps must be > 0 (got {eps})")
    r = rewards.float()
    if not torch.isfinite(r).all():
        raise ValueError("rewards: contain NaN or inf")
    if group_size == 1:
        return torch.zeros_like(r)
    groups = r.view(-1, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    if norm_by_std:
        centred = centred / (groups.std(-1, keepdim=True) + eps)
    tied = (groups == groups[:, :1]).all(-1, keepdim=True)  # exact: the mean may round
    return torch.where(tied, 0.0, centred).reshape(-1)
