"""The engine-trainer mismatch of one set of sampled tokens, from the two sides' logprobs: what the
weight-sync check, ``megatron-alp mismatch`` and the verify probe report as |log r|."""

from __future__ import annotations

from typing import Sequence

import torch


def _flat(values) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().double().reshape(-1).cpu()
    out: list[float] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.extend(float(x) for x in v)
        else:
            out.append(float(v))
    return torch.tensor(out, dtype=torch.float64)


def mismatch_stats(engine_logprobs: Sequence | torch.Tensor, trainer_logprobs: Sequence | torch.Tensor) -> dict:
    """Mismatch between the rollout engine and the trainer on the same sampled tokens.

    Both arguments hold one logprob per token (flat, or nested per sequence, same layout). With
    ``r = trainer - engine`` (the log importance ratio): ``max`` and ``p98`` of ``|r|``, its mean,
    and ``k3 = mean(exp(r) - 1 - r)``, the non-negative estimate of KL(rollout || train) from
    tokens sampled by the engine."""
    e, t = _flat(engine_logprobs), _flat(trainer_logprobs)
    if e.shape != t.shape:
        raise ValueError(f"engine and trainer logprobs differ in length: {e.numel()} vs {t.numel()} tokens")
    if e.numel() == 0:
        raise ValueError("no tokens to compare")
    if not (torch.isfinite(e).all() and torch.isfinite(t).all()):
        raise ValueError("non-finite logprobs: the engine or the trainer produced NaN/inf")
    r = t - e
    a = r.abs()
    return {
        "max": a.max().item(),
        "p98": torch.quantile(a, 0.98).item(),
        "mean": a.mean().item(),
        "k3": (torch.expm1(r) - r).mean().item(),
        "tokens": int(r.numel()),
    }


def format_mismatch(label: str, stats: dict) -> str:
    return (f"{label:<28} max|log r| {stats['max']:.3e}  p98|log r| {stats['p98']:.3e}  "
            f"mean|log r| {stats['mean']:.3e}  k3 KL {stats['k3']:.3e}  ({stats['tokens']} tokens)")
