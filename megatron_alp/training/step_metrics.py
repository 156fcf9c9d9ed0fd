"""Per-step training metrics from the policy-loss pass, reduced over data-parallel ranks.

Every micro-batch contributes sums (losses, token counts, sufficient statistics of the mismatch
measures and of Pearson's r) and raw log-ratios (for quantiles). :meth:`StepMetrics.reduce`
all-reduces the sums in fp64 and all-gathers the log-ratios over the data-parallel group only:
after the vocab-parallel reduction every tensor-parallel rank holds the same logprobs, so
reducing over TP would count each token several times.

Ratios: ``ratio/*`` are quantiles of the token ratio pi_train / pi_rollout where pi_train is the
forward the loss used (perturbed for ALP), so they compare across methods; ``ratio_loss/*`` are
quantiles of the ratio the objective itself used (per sequence for sequence-level losses).

Mismatch (``mismatch/*``) compares the *unperturbed* training policy with the rollout engine on
the rollout's tokens: it uses ``old_logprobs`` when the micro-batch has them (the old-policy pass,
run before this iteration's updates) and the current logprobs otherwise. With r = pi_train /
pi_rollout on tokens sampled from the rollout policy: ``kl_k1 = mean(-log r)`` and
``kl_k3 = mean(r - 1 - log r)`` estimate KL(pi_rollout || pi_train), ``chi2 = mean((r - 1)^2)``,
and ``pearson_r`` correlates the two token probabilities. Sigma statistics come from
:func:`megatron_alp.training.perturbation.gather_sigma_stats`.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_alp.algorithms.policy_loss import LossInputs
from megatron_alp.runtime.comm import comm_device

QUANTILES = {"p2": 0.02, "p5": 0.05, "p50": 0.5, "p95": 0.95, "p98": 0.98, "min": 0.0, "max": 1.0}
LOSS_QUANTILES = {"p2": 0.02, "p98": 0.98}
_LOSS_KEYS = ("loss/policy", "loss/kl", "loss/entropy_bonus", "loss/total")
_COUNT_KEYS = ("count/clip_low", "count/clip_high", "count/clip_dual", "count/masked")
_SUMS = _LOSS_KEYS + _COUNT_KEYS + (
    "tokens", "kl_ref_sum", "kl_ref_tokens", "entropy_sum", "entropy_tokens",
    "k1_sum", "k3_sum", "chi2_sum", "sx", "sy", "sxx", "syy", "sxy",
)


class StepMetrics:
    """Statistics of one optimizer step, accumulated over its micro-batches."""

    def __init__(self):
        self._sums: Optional[torch.Tensor] = None
        self._ratio: list[torch.Tensor] = []
        self._ratio_loss: list[torch.Tensor] = []

    @torch.no_grad()
    def add(self, inputs: LossInputs, loss_metrics: dict[str, torch.Tensor]) -> None:
        """Record one micro-batch: its inputs and the statistics :func:`policy_loss` returned."""
        mask = inputs.mask > 0
        current = inputs.logprobs.detach().float()[mask]
        rollout = inputs.rollout_logprobs.float()[mask]
        self._ratio.append(current - rollout)
        self._ratio_loss.append(loss_metrics["values/ratio_loss"].detach().float().reshape(-1))

        train = current if inputs.old_logprobs is None else inputs.old_logprobs.float()[mask]
        log_r = train.double() - rollout.double()
        r = log_r.exp()
        p_train, p_rollout = train.double().exp(), rollout.double().exp()
        n = mask.sum().double()
        zero = log_r.new_zeros(())
        values = {k: loss_metrics[k].double() for k in _LOSS_KEYS + _COUNT_KEYS}
        values.update({
            "tokens": n,
            "kl_ref_sum": loss_metrics["sum/kl_ref"].double() if "sum/kl_ref" in loss_metrics else zero,
            "kl_ref_tokens": n if "sum/kl_ref" in loss_metrics else zero,
            "entropy_sum": (inputs.entropy.detach().double()[mask].sum() if inputs.entropy is not None else zero),
            "entropy_tokens": n if inputs.entropy is not None else zero,
            "k1_sum": (-log_r).sum(),
            "k3_sum": (r - 1.0 - log_r).sum(),
            "chi2_sum": (r - 1.0).square().sum(),
            "sx": p_train.sum(),
            "sy": p_rollout.sum(),
            "sxx": p_train.square().sum(),
            "syy": p_rollout.square().sum(),
            "sxy": (p_train * p_rollout).sum(),
        })
        packed = torch.stack([values[k].reshape(()).to(log_r.device) for k in _SUMS])
        self._sums = packed if self._sums is None else self._sums + packed

    def reduce(self, dp_group=None) -> dict[str, float]:
        """Metrics of the step over all data-parallel ranks (a collective on ``dp_group``: every
        rank of the group must call it; None: this rank's micro-batches only). Undefined values
        (no loss tokens) are NaN."""
        device = comm_device(dp_group)
        distributed = dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1
        if self._sums is None:
            sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=device)
        else:
            sums = self._sums.to(device, copy=True)
        if distributed:
            dist.all_reduce(sums, group=dp_group)
        s = dict(zip(_SUMS, sums.tolist()))
        ratio = _gather(_cat(self._ratio, device), dp_group if distributed else None)
        ratio_loss = _gather(_cat(self._ratio_loss, device), dp_group if distributed else None)

        out = {k: s[k] for k in _LOSS_KEYS}
        out.update({f"ratio/{k}": v for k, v in zip(QUANTILES, _ratio_quantiles(ratio, QUANTILES.values()))})
        out.update({f"ratio_loss/{k}": v for k, v in zip(LOSS_QUANTILES, _ratio_quantiles(ratio_loss, LOSS_QUANTILES.values()))})
        tokens = n = s["tokens"]
        out["clip/low_frac"] = _div(s["count/clip_low"], tokens)
        out["clip/high_frac"] = _div(s["count/clip_high"], tokens)
        out["clip/dual_frac"] = _div(s["count/clip_dual"], tokens)
        out["mask/frac"] = _div(s["count/masked"], tokens)
        out["mismatch/kl_k1"] = _div(s["k1_sum"], n)
        out["mismatch/kl_k3"] = _div(s["k3_sum"], n)
        out["mismatch/chi2"] = _div(s["chi2_sum"], n)
        out["mismatch/pearson_r"] = _pearson(n, s["sx"], s["sy"], s["sxx"], s["syy"], s["sxy"])
        out["entropy/mean"] = _div(s["entropy_sum"], s["entropy_tokens"])
        out["kl_ref/mean"] = _div(s["kl_ref_sum"], s["kl_ref_tokens"])
        return out


def token_prob_pairs(inputs: LossInputs, max_pairs: int = 20000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train, rollout) probabilities of the loss tokens for scatter plots, at most ``max_pairs``
    (a seeded uniform subsample). "train" is ``old_logprobs`` when present, as in ``mismatch/*``."""
    mask = inputs.mask > 0
    train = inputs.logprobs if inputs.old_logprobs is None else inputs.old_logprobs
    train = train.detach().float()[mask].exp().cpu()
    rollout = inputs.rollout_logprobs.float()[mask].exp().cpu()
    if len(train) > max_pairs:
        keep = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))[:max_pairs]
        keep = keep.sort().values
        train, rollout = train[keep], rollout[keep]
    return train.numpy(), rollout.numpy()


def _cat(chunks: list[torch.Tensor], device) -> torch.Tensor:
    return torch.cat([c.to(device) for c in chunks]) if chunks else torch.zeros(0, device=device)


def _gather(values: torch.Tensor, group) -> torch.Tensor:
    """All values of all ranks (variable lengths) on every rank."""
    if group is None:
        return values
    world = dist.get_world_size(group)
    size = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(x.item()) for x in sizes]
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:k] for p, k in zip(parts, sizes)])


def _ratio_quantiles(log_values: torch.Tensor, qs) -> list[float]:
    """Quantiles of ``exp(log_values)`` with linear interpolation (as ``torch.quantile``), exact
    for any count; computed from sorted log-values so that no ratio overflows in fp32."""
    qs = list(qs)
    n = log_values.numel()
    if n == 0:
        return [math.nan] * len(qs)
    ordered = log_values.double().sort().values
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        a, b = math.exp(min(ordered[lo].item(), 700.0)), math.exp(min(ordered[hi].item(), 700.0))
        out.append(a + (pos - lo) * (b - a))
    return out


def _div(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def _pearson(n, sx, sy, sxx, syy, sxy) -> float:
    var_x, var_y = n * sxx - sx * sx, n * syy - sy * sy
    if n < 2 or var_x <= 0 or var_y <= 0:
        return math.nan
    return (n * sxy - sx * sy) / math.sqrt(var_x * var_y)
