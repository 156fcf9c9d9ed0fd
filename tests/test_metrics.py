"""StepMetrics against direct numpy computations over all loss tokens of a step, and the
token-probability pairs for the scatter plots. (The DP=2 reduction is checked by torchrun in
test_policy_loss.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_alp.algorithms.policy_loss import LossInputs, policy_loss
from megatron_alp.config import LossConfig
from megatron_alp.training.step_metrics import StepMetrics, token_prob_pairs


def make_step(B=10, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    rollout = lp + 0.4 * torch.randn(B, T, generator=g)
    rollout[0, 3] = lp[0, 3] - 3.0  # ratio e^3 = 20 > c on a negative-advantage row: dual clip
    old = lp + 0.3 * torch.randn(B, T, generator=g)
    ref = lp + 0.2 * torch.randn(B, T, generator=g)
    ent = torch.rand(B, T, generator=g) * 2
    adv = torch.randn(B, generator=g)
    adv[0] = -1.0
    mask = torch.ones(B, T)
    for i in range(B):
        mask[i, : i % 4] = 0
        mask[i, T - (i % 3):] = 0
    mask[5] = 0  # an empty response
    return dict(logprobs=lp, rollout_logprobs=rollout, old_logprobs=old, ref_logprobs=ref, entropy=ent,
                advantages=adv, mask=mask)


def accumulate(cfg, d, micro=3, **drop):
    d = {**d, **drop}
    tokens, seqs = float(d["mask"].sum()), float(d["mask"].shape[0])
    metrics = StepMetrics()
    total = 0.0
    for start in range(0, d["mask"].shape[0], micro):
        rows = slice(start, start + micro)
        inputs = LossInputs(**{k: (v[rows] if v is not None else None) for k, v in d.items()},
                            global_tokens=tokens, global_seqs=seqs)
        loss, stats = policy_loss(cfg, inputs)
        metrics.add(inputs, stats)
        total += loss.item()
    return metrics.reduce(None), total


def q(values, p):
    return float(np.quantile(values, p, method="linear"))


def test_step_metrics_equal_direct_computation():
    cfg = LossConfig(name="alp_token", clip_low=0.2, clip_high=0.28, kl_coef=0.01, kl_type="k3", entropy_coef=0.01)
    d = make_step()
    out, total = accumulate(cfg, d)
    m = d["mask"] > 0
    r = torch.exp(d["logprobs"] - d["rollout_logprobs"])
    ratios = r[m].double().numpy()
    for key, p in {"p2": 0.02, "p5": 0.05, "p50": 0.5, "p95": 0.95, "p98": 0.98, "min": 0.0, "max": 1.0}.items():
        assert out[f"ratio/{key}"] == pytest.approx(q(ratios, p), rel=1e-5)
    assert out["ratio_loss/p2"] == pytest.approx(q(ratios, 0.02), rel=1e-5)  # token ALP: the same ratio
    assert out["ratio_loss/p98"] == pytest.approx(q(ratios, 0.98), rel=1e-5)

    A = d["advantages"].unsqueeze(-1).expand_as(r)
    n = m.sum().item()
    low = ((A < 0) & (r < 0.8) & m).sum().item()
    high = ((A > 0) & (r > 1.28) & m).sum().item()
    dual = ((A < 0) & (r > 10.0) & m).sum().item()
    assert dual > 0 and low > 0 and high > 0
    assert out["clip/low_frac"] == pytest.approx(low / n)
    assert out["clip/high_frac"] == pytest.approx(high / n)
    assert out["clip/dual_frac"] == pytest.approx(dual / n)
    assert out["mask/frac"] == 0.0

    # mismatch: the old (unperturbed) policy vs the rollout engine
    log_r = (d["old_logprobs"] - d["rollout_logprobs"])[m].double()
    rr = log_r.exp()
    assert out["mismatch/kl_k1"] == pytest.approx((-log_r).mean().item(), rel=1e-6)
    assert out["mismatch/kl_k3"] == pytest.approx((rr - 1 - log_r).mean().item(), rel=1e-6)
    assert out["mismatch/chi2"] == pytest.approx(((rr - 1) ** 2).mean().item(), rel=1e-6)
    p_train, p_roll = d["old_logprobs"][m].double().exp().numpy(), d["rollout_logprobs"][m].double().exp().numpy()
    assert out["mismatch/pearson_r"] == pytest.approx(np.corrcoef(p_train, p_roll)[0, 1], rel=1e-9)
    assert out["entropy/mean"] == pytest.approx(d["entropy"][m].double().mean().item(), rel=1e-6)
    dref = (d["ref_logprobs"] - d["logprobs"])[m].double()
    assert out["kl_ref/mean"] == pytest.approx((dref.exp() - dref - 1).mean().item(), rel=1e-5)

    full, _ = policy_loss(cfg, LossInputs(**d))
    assert out["loss/total"] == pytest.approx(full.item(), rel=1e-5)
    assert total == pytest.approx(full.item(), rel=1e-5)
    assert out["loss/total"] == pytest.approx(out["loss/policy"] + out["loss/kl"] - out["loss/entropy_bonus"], rel=1e-6)


def test_mismatch_uses_current_logprobs_without_old_and_seq_ratio_quantiles():
    cfg = LossConfig(name="alp_seq", clip_low=0.5, clip_high=3.0, kl_coef=0.0, entropy_coef=0.0)
    d = make_step(seed=1)
    out, _ = accumulate(cfg, d, old_logprobs=None, ref_logprobs=None, entropy=None)
    m = d["mask"] > 0
    log_r = (d["logprobs"] - d["rollout_logprobs"])[m].double()
    assert out["mismatch/kl_k1"] == pytest.approx((-log_r).mean().item(), rel=1e-6)
    seq = torch.where(m, d["logprobs"] - d["rollout_logprobs"], 0.0).sum(-1)[m.any(-1)].double().exp().numpy()
    assert len(seq) == 9  # the empty response has no sequence ratio
    assert out["ratio_loss/p2"] == pytest.approx(q(seq, 0.02), rel=1e-5)
    assert out["ratio_loss/p98"] == pytest.approx(q(seq, 0.98), rel=1e-5)
    assert math.isnan(out["entropy/mean"]) and math.isnan(out["kl_ref/mean"])
    assert out["loss/kl"] == 0.0 and out["loss/entropy_bonus"] == 0.0


def test_mis_mask_fraction_counts_tokens_of_dropped_sequences():
    cfg = LossConfig(name="token_mis", mis_threshold=2.0, kl_coef=0.0, entropy_coef=0.0)
    d = make_step(seed=2)
    d["old_logprobs"][2] = d["rollout_logprobs"][2] + 0.5  # product of e^0.5 per token > 2
    out, _ = accumulate(cfg, d)
    m = d["mask"] > 0
    seq = torch.where(m, d["old_logprobs"] - d["rollout_logprobs"], 0.0).sum(-1)
    dropped = (seq > math.log(2.0)).unsqueeze(-1) & m
    assert dropped[2].any()
    assert out["mask/frac"] == pytest.approx(dropped.sum().item() / m.sum().item())


def test_no_loss_tokens_gives_nan_not_errors():
    cfg = LossConfig(name="grpo", kl_coef=0.0, entropy_coef=0.0)
    d = make_step(seed=3)
    d["mask"].zero_()
    out, total = accumulate(cfg, d)
    assert total == 0.0 and out["loss/policy"] == 0.0
    assert math.isnan(out["ratio/p50"]) and math.isnan(out["clip/low_frac"]) and math.isnan(out["mismatch/pearson_r"])
    empty = StepMetrics().reduce(None)
    assert math.isnan(empty["ratio/max"]) and empty["loss/total"] == 0.0


def test_huge_ratios_do_not_overflow_quantiles():
    cfg = LossConfig(name="alp_token", kl_coef=0.0, entropy_coef=0.0)
    d = make_step(seed=4)
    d["rollout_logprobs"][1, 5] = -200.0  # ratio e^(~200): overflows fp32, not fp64
    out, _ = accumulate(cfg, d)
    assert out["ratio/max"] > 1e80 and math.isfinite(out["ratio/max"])
    assert math.isfinite(out["ratio/p50"])


def test_token_prob_pairs():
    d = make_step(seed=5)
    inputs = LossInputs(**d)
    train, rollout = token_prob_pairs(inputs, max_pairs=10_000)
    m = d["mask"] > 0
    assert len(train) == len(rollout) == m.sum().item()
    assert np.allclose(train, d["old_logprobs"][m].exp().numpy())  # old (unperturbed) policy when present
    assert np.allclose(rollout, d["rollout_logprobs"][m].exp().numpy())
    small_t, small_r = token_prob_pairs(inputs, max_pairs=17, seed=1)
    assert len(small_t) == 17
    pairs = set(zip(train.tolist(), rollout.tolist()))
    assert all(p in pairs for p in zip(small_t.tolist(), small_r.tolist())), "subsample broke the pairing"
    no_old = LossInputs(**{**d, "old_logprobs": None})
    cur, _ = token_prob_pairs(no_old)
    assert np.allclose(cur, d["logprobs"][m].exp().numpy())
