"""The `loss` section: the policy objective. Its keys are flat (``loss.icepop_low``), but each
loss's own knobs are declared together under the registered losses that read them, so that adding
a loss to algorithms/policy_loss.py shows where its knobs go (config sits below algorithms and
cannot import the registry)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from megatron_alp.config.base import _Section


class LossConfig(_Section):
    """The policy objective (paper section 2 and the appendix table of importance ratios)."""

    name: str = Field(
        "alp_token",
        description="Policy loss by registry name (megatron_alp/algorithms/policy_loss.py; the table below "
        "describes each): ALP (ratio perturbed-train / rollout) or one of the paper's baselines.",
        json_schema_extra={"registry": "loss"},
    )

    # The clipped surrogate of every loss; an unset range takes the registered loss's own `clip`
    # (cispo's IS weight takes clip_low and clip_high, never the dual clip).
    clip_low: Optional[float] = Field(
        None, gt=0.0, le=1.0,
        description="Lower clip: ratio >= 1 - clip_low (1: no lower clip). null: the loss's default (0.2 token "
        "level, 0.5 sequence level; `cispo` 1, MiniMax-M1's unbounded lower IS weight).",
    )
    clip_high: Optional[float] = Field(
        None, gt=0.0,
        description="Upper clip: ratio <= 1 + clip_high. null: the loss's default (0.28 token level, 3.0 sequence level).",
    )
    dual_clip_c: Optional[float] = Field(
        10.0, description="Dual-clip bound c (> 1) for negative advantages; null disables it."
    )

    # Each loss's own knobs, grouped under the registered losses (algorithms/policy_loss.py) that
    # read them; every other loss ignores them.
    # read by: alp_seq, seq_bypass, seq_mis; gspo always takes the geometric mean
    seq_ratio: Literal["product", "geometric_mean"] = Field(
        "product",
        description="How sequence-level ratios aggregate token log-ratios: `product` (sum of logs, "
        "the paper's Seq-ALP) or `geometric_mean` (GSPO's length-normalised form).",
    )
    # read by: token_mis, seq_mis
    mis_threshold: float = Field(
        2.0, gt=0.0,
        description="C for Token-/Seq-MIS: each sequence's objective is weighted by rho' = prod_t "
        "pi_old / pi_rollout and masked where rho' > C.",
    )
    mis_two_sided: bool = Field(
        False,
        description="Token-/Seq-MIS: also mask sequences with rho' < 1/C (the lower bound the paper "
        "authors' code applies); off: only rho' > C is masked, as the paper's formula says.",
    )
    # read by: token_tis
    tis_threshold: float = Field(2.0, gt=0.0, description="C for Token-TIS: truncate the weight at C.")
    # read by: icepop
    icepop_low: float = Field(
        0.5, gt=0.0, le=1.0,
        description="alpha for `icepop`: a token whose k = pi_old / pi_rollout is below it is masked (Ring-1T: 0.5).",
    )
    icepop_high: float = Field(
        5.0, ge=1.0,
        description="beta for `icepop`: a token whose k = pi_old / pi_rollout is above it is masked (Ring-1T: 5).",
    )

    # Every loss again: the bound on log ratios, the reduction, DAPO's overlong filter, the KL
    # penalty to the reference and the entropy bonus.
    log_ratio_clamp: float = Field(
        20.0, gt=0.0, description="Clamp |log ratio| before exp() for numerical safety."
    )
    aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = Field(
        "token-mean",
        description="How per-token losses reduce to the batch loss. The normalisers count loss tokens, and "
        "sequences with at least one loss token, over the whole mini-batch.",
    )
    mask_truncated: bool = Field(
        False,
        description="Overlong filtering (DAPO): take responses cut by the length limit (finish reason "
        "`length`) out of the loss entirely, their tokens out of the normalisers too; their rewards still "
        "count in their group's advantages. Logged: `response/masked_truncated_frac`.",
    )
    kl_coef: float = Field(0.001, ge=0.0, description="Coefficient of the KL penalty to the reference.")
    kl_type: Literal["k1", "k3"] = Field(
        "k3", description="KL estimator: `k1` (log ratio) or `k3` (low-variance, always >= 0)."
    )
    kl_clamp: float = Field(
        10.0, gt=0.0,
        description="Bound on the per-token KL estimate, [-kl_clamp, kl_clamp] (as verl): k3 grows like "
        "exp(log-ratio), so without it one token far from the reference dominates the gradient; a token "
        "beyond the bound contributes no KL gradient.",
    )
    entropy_coef: float = Field(0.001, ge=0.0, description="Entropy bonus coefficient.")

    @field_validator("dual_clip_c")
    @classmethod
    def _check_c(cls, v):
        if v is not None and v <= 1.0:
            raise ValueError(f"dual clip c must be > 1 (got {v})")
        return v
