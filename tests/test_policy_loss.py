"""Policy losses against a straightforward per-token transcription of the paper's formulas, edge
cases, normalisation over micro-batches, and TP=2 / DP=2 agreement (torchrun, gloo)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import dist_job, read_results
from pydantic import ValidationError

from megatron_alp.algorithms.policy_loss import (
    POLICY_LOSSES,
    LossInputs,
    Ratio,
    get_policy_loss,
    needs_old_logprobs,
    needs_ref_logprobs,
    policy_loss,
    register_policy_loss,
    token_log_ratio,
)
from megatron_alp.config import ConfigError, LossConfig
from megatron_alp.resolve import config_from_dict, load_config

# The paper's objectives (section 2 and the appendix table of importance ratios), written out here.
LOSS_NAMES = ("alp_token", "alp_seq", "grpo", "gspo", "token_mis", "seq_mis", "token_tis", "seq_bypass")
CORRECTIONS = ("cispo", "icepop")  # training-inference corrections beyond the paper, tested below
SEQ_LEVEL = {"alp_seq", "seq_bypass", "seq_mis", "gspo"}
PERTURBED = {"alp_token", "alp_seq"}
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


# ------------------------------------------------------------- the paper, written out per token


def reference_loss(cfg: LossConfig, lp, rollout, old, ref, ent, adv, mask, n_tokens, n_seqs):
    """Loop over sequences and tokens, one formula at a time (float64 scalars, autograd)."""
    B, T = mask.shape
    clamp = cfg.log_ratio_clamp

    def ratio_of(x):
        return torch.exp(torch.clamp(x, -clamp, clamp))

    numerator = lp
    denominator = rollout if cfg.name in ("alp_token", "alp_seq", "seq_bypass") else old
    geometric = cfg.name == "gspo" or cfg.seq_ratio == "geometric_mean"
    per_seq = {"policy": [], "kl": [], "ent": []}
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t] > 0]
        A = adv[i]
        seq_ratio = None
        if cfg.name in SEQ_LEVEL and toks:
            s = sum(numerator[i, t] - denominator[i, t] for t in toks)
            seq_ratio = ratio_of(s / len(toks) if geometric else s)
        keep = 1.0
        if cfg.name in ("token_mis", "seq_mis") and toks:
            # correcting ratio rho'_i = prod_t pi_old / pi_rollout, masked where rho'_i > C (and < 1/C two-sided)
            rho_prime = math.exp(sum(float(old[i, t] - rollout[i, t]) for t in toks))
            dropped = rho_prime > cfg.mis_threshold or (cfg.mis_two_sided and rho_prime < 1 / cfg.mis_threshold)
            keep = 0.0 if dropped else rho_prime
        terms, kls, ents = [], [], []
        for t in toks:
            r = seq_ratio if seq_ratio is not None else ratio_of(numerator[i, t] - denominator[i, t])
            term = torch.maximum(-A * r, -A * torch.clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high))
            if cfg.dual_clip_c is not None and A < 0:
                term = torch.minimum(term, -A * cfg.dual_clip_c)
            weight = keep
            if cfg.name == "token_tis":
                weight = min(math.exp(float(old[i, t] - rollout[i, t])), cfg.tis_threshold)
            terms.append(weight * term)
            d = torch.clamp(ref[i, t] - lp[i, t], -clamp, clamp)
            kls.append(torch.clamp(-d if cfg.kl_type == "k1" else torch.exp(d) - d - 1, -cfg.kl_clamp, cfg.kl_clamp))
            ents.append(ent[i, t])
        for key, vals in (("policy", terms), ("kl", kls), ("ent", ents)):
            total = sum(vals) if vals else lp.new_zeros(())
            if cfg.aggregation == "seq-mean-token-mean":
                total = total / max(len(vals), 1)
            per_seq[key].append(total)

    def agg(key):
        s = sum(per_seq[key])
        return s / (n_tokens if cfg.aggregation == "token-mean" else n_seqs)

    return agg("policy") + cfg.kl_coef * agg("kl") - cfg.entropy_coef * agg("ent")


def make_batch(B: int, T: int, seed: int, padding: bool = True):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    heavy = (torch.rand(B, T, generator=g) < 0.1) * torch.randn(B, T, generator=g, dtype=torch.float64) * 3
    rollout = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64) + heavy
    old = lp + 0.25 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = lp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    if padding:
        for i in range(B):
            start = int(torch.randint(0, max(T // 3, 1), (1,), generator=g))
            end = T - int(torch.randint(0, max(T // 3, 1), (1,), generator=g))
            mask[i, :start] = 0
            mask[i, end:] = 0
            lp[i, end:] = -1e9  # padding holds garbage the loss must ignore
            rollout[i, :start] = 0.0
    return dict(lp=lp, rollout=rollout, old=old, ref=ref, ent=ent, adv=adv, mask=mask)


def crafted_batch():
    """Rows built to hit every branch under every loss: low clip (A < 0, small ratio), high clip
    (A > 0, large ratio), dual clip (A < 0, ratio > 10), and a sequence the MIS mask drops."""
    lp = torch.full((4, 5), -1.0, dtype=torch.float64)
    delta = torch.tensor([-1.0, 1.5, 3.0, 0.0], dtype=torch.float64).unsqueeze(-1).expand(4, 5)
    old = lp - delta
    rollout = old.clone()
    rollout[3] = old[3] - 1.0  # pi_old / pi_rollout = e per token: dropped by MIS, truncated by TIS
    mask = torch.ones(4, 5, dtype=torch.float64)
    mask[1, 4] = 0
    return dict(lp=lp, rollout=rollout, old=old, ref=lp - 0.1, ent=torch.full((4, 5), 0.5, dtype=torch.float64),
                adv=torch.tensor([-1.0, 1.0, -1.0, 0.5], dtype=torch.float64), mask=mask)


def fused_and_reference(cfg: LossConfig, d: dict):
    lp1 = d["lp"].clone().requires_grad_()
    ent1 = d["ent"].clone().requires_grad_()
    n_tokens, n_seqs = float(d["mask"].sum()), float(d["mask"].shape[0])
    inputs = LossInputs(logprobs=lp1, rollout_logprobs=d["rollout"], advantages=d["adv"], mask=d["mask"],
                        old_logprobs=d["old"], ref_logprobs=d["ref"], entropy=ent1)
    loss, stats = policy_loss(cfg, inputs)
    loss.backward()
    lp2 = d["lp"].clone().requires_grad_()
    ent2 = d["ent"].clone().requires_grad_()
    ref_loss = reference_loss(cfg, lp2, d["rollout"], d["old"], d["ref"], ent2, d["adv"], d["mask"], n_tokens, n_seqs)
    ref_loss.backward()
    return (loss, lp1.grad, ent1.grad, stats), (ref_loss, lp2.grad, ent2.grad)


def cfg_for(name: str, **kw) -> LossConfig:
    seq = name in SEQ_LEVEL
    base = dict(name=name, clip_low=0.5 if seq else 0.2, clip_high=3.0 if seq else 0.28, kl_coef=0.05, entropy_coef=0.02)
    if name == "gspo":  # a length-normalised ratio stays near 1: GSPO clips tightly
        base.update(clip_low=0.03, clip_high=0.04)
    return LossConfig(**{**base, **kw})


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_loss_matches_paper_formula(name, aggregation):
    seen = {"low": 0.0, "high": 0.0, "dual": 0.0, "masked": 0.0}
    batches = [make_batch(*shape, seed=seed) for shape, seed in (((3, 5), 0), ((6, 9), 1), ((4, 16), 2))]
    for d in batches + [crafted_batch()]:
        for kw in ({}, {"seq_ratio": "geometric_mean", "kl_type": "k1"}, {"dual_clip_c": None},
                   {"mis_two_sided": True, "kl_clamp": 0.05}):
            cfg = cfg_for(name, aggregation=aggregation, **kw)
            (loss, g_lp, g_ent, stats), (ref, r_lp, r_ent) = fused_and_reference(cfg, d)
            assert torch.isclose(loss, ref, rtol=1e-9, atol=1e-12), f"{cfg}: loss {loss} != {ref}"
            assert torch.allclose(g_lp, r_lp, rtol=1e-9, atol=1e-12), f"{cfg}: logprob gradient differs"
            assert torch.allclose(g_ent, r_ent, rtol=1e-9, atol=1e-12), f"{cfg}: entropy gradient differs"
            assert (g_lp[d["mask"] == 0] == 0).all(), "padding received gradient"
            for k in seen:
                seen[k] += float(stats[f"count/clip_{k}"] if k != "masked" else stats["count/masked"])
    # every branch of the loss was exercised
    assert seen["low"] > 0 and seen["high"] > 0 and seen["dual"] > 0
    if name in ("token_mis", "seq_mis"):
        assert seen["masked"] > 0
    else:
        assert seen["masked"] == 0


def test_negative_and_positive_advantages_push_opposite_ways():
    d = make_batch(4, 6, seed=5, padding=False)
    d["lp"] = d["rollout"].clone()  # ratio 1: inside the clip range, gradient is -A / n_tokens
    d["adv"] = torch.tensor([1.0, -1.0, 2.0, -0.5], dtype=torch.float64)
    cfg = cfg_for("alp_token", kl_coef=0.0, entropy_coef=0.0)
    (_, g, _, _), _ = fused_and_reference(cfg, d)
    expected = -d["adv"].unsqueeze(-1).expand(4, 6) / 24
    assert torch.allclose(g, expected)


def test_seq_loss_uses_one_ratio_for_all_tokens_of_a_sequence():
    d = make_batch(3, 7, seed=3)
    cfg = cfg_for("alp_seq", kl_coef=0.0, entropy_coef=0.0, aggregation="seq-mean-token-mean")
    (_, g, _, stats), _ = fused_and_reference(cfg, d)
    for i in range(3):
        row = g[i][d["mask"][i] > 0]
        assert torch.allclose(row, row[0].expand_as(row)), "tokens of one sequence got different gradients"
    assert stats["values/ratio_loss"].shape == (3,)


def test_tis_weight_is_truncated_and_detached():
    d = make_batch(2, 4, seed=4, padding=False)
    d["old"] = d["rollout"] + torch.tensor([[3.0, 0.1, -1.0, 0.0], [0.0, 2.0, 0.5, -3.0]], dtype=torch.float64)
    d["lp"] = d["old"].clone()
    cfg = cfg_for("token_tis", kl_coef=0.0, entropy_coef=0.0)
    (_, g, _, _), _ = fused_and_reference(cfg, d)
    weight = torch.exp(d["old"] - d["rollout"]).clamp(max=cfg.tis_threshold)
    expected = -d["adv"].unsqueeze(-1) * weight / 8
    assert torch.allclose(g, expected)


# ---------------------------------------------------------------------- normalisation, splits


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batch_losses_sum_to_mini_batch_loss(aggregation):
    d = make_batch(8, 10, seed=6)
    cfg = cfg_for("seq_mis", aggregation=aggregation)
    full = dict(logprobs=d["lp"], rollout_logprobs=d["rollout"], advantages=d["adv"], mask=d["mask"],
                old_logprobs=d["old"], ref_logprobs=d["ref"], entropy=d["ent"])
    whole, _ = policy_loss(cfg, LossInputs(**full))
    parts = 0.0
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        sub = {k: v[rows] for k, v in full.items()}
        loss, _ = policy_loss(cfg, LossInputs(**sub, global_tokens=float(d["mask"].sum()), global_seqs=8.0))
        parts = parts + loss
    assert torch.isclose(parts, whole, rtol=1e-12)


# -------------------------------------------------------------------------------- edge cases


def _inputs(d, **over):
    kw = dict(logprobs=d["lp"], rollout_logprobs=d["rollout"], advantages=d["adv"], mask=d["mask"],
              old_logprobs=d["old"], ref_logprobs=d["ref"], entropy=d["ent"])
    kw.update(over)
    return LossInputs(**kw)


@pytest.mark.parametrize("name", LOSS_NAMES + CORRECTIONS)
def test_empty_response_contributes_nothing(name):
    d = make_batch(4, 8, seed=7)
    d["mask"][1] = 0  # an empty response
    cfg = cfg_for(name, aggregation="seq-mean-token-mean")
    lp = d["lp"].clone().requires_grad_()
    loss, _ = policy_loss(cfg, _inputs(d, logprobs=lp, global_seqs=4.0))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert (lp.grad[1] == 0).all()
    rest = [0, 2, 3]
    sub = {k: v[rest] for k, v in d.items()}
    loss_rest, _ = policy_loss(cfg, _inputs(sub, global_seqs=4.0))
    assert torch.isclose(loss.detach(), loss_rest, rtol=1e-12)


@pytest.mark.parametrize("name", LOSS_NAMES + CORRECTIONS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_all_masked_batch_is_zero_without_nan(name, aggregation):
    d = make_batch(3, 5, seed=8)
    d["mask"].zero_()
    lp = d["lp"].clone().requires_grad_()
    loss, stats = policy_loss(cfg_for(name, aggregation=aggregation), _inputs(d, logprobs=lp, global_tokens=0.0))
    loss.backward()
    assert loss.item() == 0.0
    assert (lp.grad == 0).all()
    assert stats["values/ratio_loss"].numel() == 0


@pytest.mark.parametrize("name", LOSS_NAMES + CORRECTIONS)
def test_identical_rewards_give_zero_policy_gradient(name):
    from megatron_alp.algorithms.advantages import group_advantages

    d = make_batch(4, 6, seed=9)
    d["adv"] = group_advantages(torch.full((4,), 0.7), group_size=4).double()
    lp = d["lp"].clone().requires_grad_()
    loss, stats = policy_loss(cfg_for(name, kl_coef=0.0, entropy_coef=0.0), _inputs(d, logprobs=lp))
    loss.backward()
    assert loss.item() == 0.0 and stats["loss/policy"].item() == 0.0
    assert torch.isfinite(lp.grad).all() and (lp.grad == 0).all()


@pytest.mark.parametrize("name", LOSS_NAMES + CORRECTIONS)
def test_extreme_log_ratios_stay_finite(name):
    d = make_batch(4, 6, seed=10, padding=False)
    d["rollout"][0, :3] = -1e4  # pi_train / pi_rollout = e^(+1e4)
    d["rollout"][1, :2] = float("-inf")
    d["lp"][2, :3] = -1e4  # e^(-1e4)
    d["old"][3, :] = d["lp"][3, :] + 500.0
    d["ref"][0, :] = -1e4
    d["adv"] = torch.tensor([1.0, -2.0, 1.5, -1.0], dtype=torch.float64)
    lp = d["lp"].clone().requires_grad_()
    ent = d["ent"].clone().requires_grad_()
    loss, stats = policy_loss(cfg_for(name), _inputs(d, logprobs=lp, entropy=ent))
    loss.backward()
    assert torch.isfinite(loss), f"{name}: loss {loss}"
    assert torch.isfinite(lp.grad).all() and torch.isfinite(ent.grad).all()
    assert all(torch.isfinite(v).all() for k, v in stats.items() if k != "values/ratio_loss")


def test_fp32_inputs_with_huge_ratios_stay_finite():
    d = {k: v.float() for k, v in make_batch(3, 4, seed=11, padding=False).items()}
    d["rollout"][:, 0] = -80.0
    d["lp"][:, 0] = 0.0
    d["adv"] = torch.tensor([50.0, -50.0, 1.0])
    lp = d["lp"].clone().requires_grad_()
    loss, _ = policy_loss(cfg_for("alp_seq", log_ratio_clamp=20.0), _inputs(d, logprobs=lp))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()


# ------------------------------------------- CISPO and IcePop, from their papers' formulas


def _corrected(name: str, d: dict, **kw):
    """The code's loss and d loss / d log pi_theta (token-mean, no KL or entropy term)."""
    cfg = LossConfig(name=name, kl_coef=0.0, entropy_coef=0.0, **kw)
    lp = d["lp"].clone().requires_grad_()
    loss, stats = policy_loss(cfg, LossInputs(logprobs=lp, rollout_logprobs=d["rollout"], advantages=d["adv"],
                                              mask=d["mask"], old_logprobs=d["old"]))
    loss.backward()
    return cfg, loss, lp.grad, stats


def loss_tokens(mask) -> list[tuple[int, int]]:
    """``(row, position)`` of every loss token."""
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t] != 0]


@pytest.mark.parametrize("clip", [{}, {"clip_low": 0.2, "clip_high": 0.1}])
def test_cispo_is_minimax_m1_eq4(clip):
    """MiniMax-M1 eq. 4: J = 1/sum|o_i| sum_i sum_t sg(r^_it) A_i log pi_theta(o_it), r^ = clip(r, 1 - eps_low,
    1 + eps_high), r = pi_theta / pi_old; its default sets no lower bound (eps_low = 1 here: r^ >= 0),
    eps_high = 0.28. Loss = -J; its gradient is -r^_it A_i / N on every loss token, clipped or not."""
    for seed, shape in ((3, (4, 7)), (4, (5, 11))):
        d = make_batch(*shape, seed=seed)
        d["old"] = d["lp"] + 0.6 * torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        cfg, loss, grad, stats = _corrected("cispo", d, **clip)
        eps_low, eps_high = clip.get("clip_low", 1.0), clip.get("clip_high", 0.28)
        assert (cfg.clip_low or 1.0, cfg.clip_high or 0.28) == (eps_low, eps_high)
        n = float(d["mask"].sum())
        value, expected_grad, high = 0.0, torch.zeros(shape, dtype=torch.float64), 0
        for i, t in loss_tokens(d["mask"]):
            r = math.exp(float(d["lp"][i, t] - d["old"][i, t]))
            w = min(max(r, 1 - eps_low), 1 + eps_high)
            high += r > 1 + eps_high
            value += -w * float(d["adv"][i]) * float(d["lp"][i, t]) / n
            expected_grad[i, t] = -w * float(d["adv"][i]) / n
        assert loss.item() == pytest.approx(value, rel=1e-9)
        assert torch.allclose(grad, expected_grad, rtol=1e-9, atol=1e-15)
        assert high > 0 and stats["count/clip_high"].item() == high


def test_cispo_keeps_the_gradient_of_a_clipped_token_that_ppo_drops():
    """A token with r = e > 1 + eps_high and A > 0: PPO's clipped term is flat there (gradient 0),
    CISPO's weight is clipped to 1 + eps_high and the token still gets -(1 + eps_high) A / N."""
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    d = dict(lp=lp, old=lp - torch.tensor([[1.0, 0.0]], dtype=torch.float64), rollout=lp.clone(),
             adv=torch.tensor([2.0], dtype=torch.float64), mask=torch.ones(1, 2, dtype=torch.float64))
    _, _, cispo_grad, stats = _corrected("cispo", d)
    _, _, grpo_grad, _ = _corrected("grpo", d)
    assert stats["count/clip_high"].item() == 1
    assert cispo_grad[0, 0].item() == pytest.approx(-1.28 * 2.0 / 2)
    assert grpo_grad[0, 0].item() == 0.0
    assert cispo_grad[0, 1].item() == pytest.approx(grpo_grad[0, 1].item()) == pytest.approx(-2.0 / 2)


@pytest.mark.parametrize("bounds", [{}, {"icepop_low": 0.8, "icepop_high": 1.5}])
def test_icepop_is_ring_1t_masked_objective(bounds):
    """Ring-1T (IcePop): J = 1/N sum_i sum_t M(k_it) min(r_it A_i, clip(r_it, 1 - eps, 1 + eps_high) A_i) with
    k = pi_train(theta_old) / pi_infer(theta_old) per token, M(k) = k on [alpha, beta], 0 outside
    (alpha 0.5, beta 5), r = pi_theta / pi_old. Loss = -J (no dual clip, as the report); its gradient
    is -M(k) A r / N where the unclipped term is the smaller objective, else 0."""
    alpha, beta = bounds.get("icepop_low", 0.5), bounds.get("icepop_high", 5.0)
    eps_low, eps_high = 0.2, 0.28
    for seed, shape in ((5, (4, 9)), (6, (6, 13))):
        d = make_batch(*shape, seed=seed)
        g = torch.Generator().manual_seed(seed)
        d["rollout"] = d["old"] + torch.randn(shape, generator=g, dtype=torch.float64)  # |log k| ~ 1: both tails
        cfg, loss, grad, stats = _corrected("icepop", d, clip_low=eps_low, clip_high=eps_high, dual_clip_c=None,
                                            **bounds)
        n = float(d["mask"].sum())
        value, expected_grad, masked = 0.0, torch.zeros(shape, dtype=torch.float64), 0
        for i, t in loss_tokens(d["mask"]):
            k = math.exp(float(d["old"][i, t] - d["rollout"][i, t]))
            m = k if alpha <= k <= beta else 0.0
            masked += m == 0.0
            r, a = math.exp(float(d["lp"][i, t] - d["old"][i, t])), float(d["adv"][i])
            unclipped, clipped = r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a
            value += -m * min(unclipped, clipped) / n
            expected_grad[i, t] = -m * a * r / n if unclipped <= clipped else 0.0
        assert loss.item() == pytest.approx(value, rel=1e-9)
        assert torch.allclose(grad, expected_grad, rtol=1e-9, atol=1e-15)
        assert masked > 0 and stats["count/masked"].item() == masked
        assert (grad[d["mask"] == 0] == 0).all()


def test_correction_losses_resolve_their_defaults():
    cispo = config_from_dict({"model": {"tiny": "qwen2"}, "loss": {"name": "cispo"}})
    assert (cispo.loss.clip_low, cispo.loss.clip_high) == (1.0, 0.28) and cispo.perturbation.enabled is False
    icepop = config_from_dict({"model": {"tiny": "qwen2"}, "loss": {"name": "icepop"}})
    assert (icepop.loss.icepop_low, icepop.loss.icepop_high) == (0.5, 5.0)
    assert needs_old_logprobs("cispo") and needs_old_logprobs("icepop")


# ------------------------------------------------------------------------------ bad input


def test_unknown_loss_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo_typo'.*alp_seq"):
        get_policy_loss("ppo_typo")
    with pytest.raises(ConfigError, match=r"loss\.name"):
        config_from_dict({"model": {"tiny": "qwen2"}, "loss": {"name": "ppo_typo"}})
    cfg = LossConfig.model_construct(**{**LossConfig().model_dump(), "name": "ppo_typo"})
    d = make_batch(2, 3, seed=0)
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss(cfg, _inputs(d))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("dual_clip_c", 1.0, "dual clip c must be > 1"),
        ("dual_clip_c", 0.5, "dual clip c must be > 1"),
        ("clip_low", 1.5, "less than or equal to 1"),
        ("icepop_low", 1.5, "less than or equal to 1"),
        ("icepop_high", 0.5, "greater than or equal to 1"),
        ("clip_low", 0.0, "greater than 0"),
        ("clip_high", -0.1, "greater than 0"),
        ("mis_threshold", 0.0, "greater than 0"),
        ("tis_threshold", -1.0, "greater than 0"),
        ("log_ratio_clamp", 0.0, "greater than 0"),
        ("aggregation", "mean", "token-mean"),
        ("kl_type", "k2", "k1"),
        ("seq_ratio", "sum", "product"),
    ],
)
def test_invalid_thresholds_and_modes_are_rejected(field, value, message):
    with pytest.raises(ValidationError, match=message):
        LossConfig(**{field: value})
    with pytest.raises(ConfigError, match=rf"loss\.{field}"):
        config_from_dict({"model": {"tiny": "qwen2"}, "loss": {field: value}})


def test_missing_inputs_are_named():
    d = make_batch(2, 3, seed=0)
    with pytest.raises(ValueError, match="needs LossInputs.old_logprobs"):
        policy_loss(cfg_for("grpo"), _inputs(d, old_logprobs=None))
    with pytest.raises(ValueError, match="needs LossInputs.ref_logprobs"):
        policy_loss(cfg_for("alp_token"), _inputs(d, ref_logprobs=None))
    with pytest.raises(ValueError, match="needs LossInputs.entropy"):
        policy_loss(cfg_for("alp_token"), _inputs(d, entropy=None))
    with pytest.raises(ValueError, match="LossInputs.mask: expected shape"):
        policy_loss(cfg_for("alp_token"), _inputs(d, mask=d["mask"][:, :2]))
    with pytest.raises(ValueError, match="LossInputs.advantages"):
        policy_loss(cfg_for("alp_token"), _inputs(d, advantages=d["adv"][:1]))
    # ALP and bypass need neither the old-policy pass nor (without KL) the reference
    assert not needs_old_logprobs("alp_token") and not needs_old_logprobs("seq_bypass")
    assert needs_old_logprobs("grpo") and needs_old_logprobs("token_tis")
    assert needs_ref_logprobs(LossConfig(kl_coef=0.001)) and not needs_ref_logprobs(LossConfig(kl_coef=0.0))
    loss, _ = policy_loss(cfg_for("alp_token", kl_coef=0.0, entropy_coef=0.0),
                          _inputs(d, old_logprobs=None, ref_logprobs=None, entropy=None))
    assert torch.isfinite(loss)


def test_registry_accepts_new_losses():
    """A new loss is one registered function: selectable as loss.name, its declared properties used
    by config validation and listed in the generated docs, with no edit anywhere else."""
    from megatron_alp.commands.config_docs import losses_docs

    @register_policy_loss("test_half_alp", paper="Half-ALP", level="token", perturbed=True,
                          ratio="(pi_theta,sigma / pi_rollout)^0.5", clip=(0.1, 0.1))
    def _half(cfg, inputs, mask):
        return Ratio(0.5 * token_log_ratio(inputs.logprobs, inputs.rollout_logprobs, mask))

    try:
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("test_half_alp", paper="x", level="token", ratio="x")(_half)
        cfg = config_from_dict({"model": {"tiny": "qwen2"}, "loss": {"name": "test_half_alp"}})
        assert cfg.perturbation.enabled is True  # declared perturbed
        assert (cfg.loss.clip_low, cfg.loss.clip_high) == (0.1, 0.1)  # its declared default clip
        assert "`test_half_alp` | Half-ALP" in losses_docs()
        d = make_batch(3, 4, seed=1)
        loss, _ = policy_loss(cfg.loss, _inputs(d))
        base, _ = policy_loss(cfg_for("alp_token"), _inputs(d))
        assert torch.isfinite(loss) and not torch.isclose(loss, base)
    finally:
        del POLICY_LOSSES["test_half_alp"]
    with pytest.raises(ConfigError, match=r"loss\.name.*unknown policy loss 'test_half_alp'"):
        config_from_dict({"model": {"tiny": "qwen2"}, "loss": {"name": "test_half_alp"}})


def test_registry_declares_the_papers_properties():
    """Appendix table: which ratio each baseline clips, at which level; ALP alone is perturbed."""
    for name in LOSS_NAMES:
        spec = get_policy_loss(name)
        assert spec.perturbed == (name in PERTURBED), name
        assert spec.level == ("seq" if name in SEQ_LEVEL else "token"), name
        assert spec.needs_old == (name in ("grpo", "gspo", "token_mis", "seq_mis", "token_tis")), name
        # paper appendix: token ratios clip at 0.2 / 0.28, sequence ratios at 0.5 / 3.0
        assert spec.clip == ((0.5, 3.0) if name in SEQ_LEVEL else (0.2, 0.28)), name


@pytest.mark.parametrize("name", ["token_mis", "seq_mis"])
@pytest.mark.parametrize("two_sided", [False, True])
def test_mis_weight_is_the_correcting_ratio_masked_above_c(name, two_sided):
    """Paper section 2 (MIS): each sequence's objective is multiplied by rho' = prod_t pi_old / pi_rollout
    and masked where rho' > C (two-sided: also where rho' < 1/C). C = 2."""
    rhos = [0.3, 0.6, 1.0, 1.9, 2.5]  # per sequence, none on a boundary
    T = 3
    rollout = torch.full((len(rhos), T), -1.0, dtype=torch.float64)
    old = rollout.clone()
    for i, rho in enumerate(rhos):  # spread log rho' over the tokens unevenly
        old[i] += torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64) * math.log(rho)
    lp = old.clone().requires_grad_()  # pi_theta = pi_old: the clipped term is -A * 1 on every token
    adv = torch.ones(len(rhos), dtype=torch.float64)
    mask = torch.ones(len(rhos), T, dtype=torch.float64)
    cfg = LossConfig(name=name, mis_threshold=2.0, mis_two_sided=two_sided, kl_coef=0.0, entropy_coef=0.0,
                     aggregation="seq-mean-token-sum")
    loss, stats = policy_loss(cfg, LossInputs(logprobs=lp, rollout_logprobs=rollout, advantages=adv, mask=mask,
                                              old_logprobs=old))
    loss.backward()
    expected = [rho if rho <= 2.0 and not (two_sided and rho < 0.5) else 0.0 for rho in rhos]
    # ratio 1 (inside the clip): d loss / d log pi_theta(t) = -A * weight / n_seqs per token term that
    # depends on t: one for a token ratio, all T terms of the sequence for a sequence ratio
    terms = T if name == "seq_mis" else 1
    per_seq_grad = -lp.grad[:, 0] * len(rhos) / terms
    assert torch.allclose(per_seq_grad, torch.tensor(expected, dtype=torch.float64), rtol=1e-9), per_seq_grad
    assert torch.isclose(loss, torch.tensor(-sum(expected) * T / len(rhos), dtype=torch.float64), rtol=1e-9)
    assert stats["count/masked"].item() == T * sum(w == 0.0 for w in expected)


def test_k3_kl_is_bounded():
    """One token far from the reference (log-ratio 15) must not dominate: its k3 estimate is capped at
    kl_clamp (10) and contributes no gradient, while a token near the reference keeps its gradient."""
    lp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[14.0 - 1.0, -1.1]], dtype=torch.float64)  # log(pi_ref / pi) = 14 and -0.1 (k3 = e^14 ...)
    cfg = LossConfig(name="alp_token", kl_coef=1.0, entropy_coef=0.0)
    inputs = LossInputs(logprobs=lp, rollout_logprobs=lp.detach(), advantages=torch.zeros(1, dtype=torch.float64),
                        mask=torch.ones(1, 2, dtype=torch.float64), ref_logprobs=ref)
    loss, stats = policy_loss(cfg, inputs)
    loss.backward()
    near = math.exp(-0.1) + 0.1 - 1  # k3 of the near token, unbounded formula
    assert stats["sum/kl_ref"].item() == pytest.approx(10.0 + near)
    assert lp.grad[0, 0].item() == 0.0
    # d k3 / d log pi = 1 - pi_ref / pi for the near token, divided by 2 tokens
    assert lp.grad[0, 1].item() == pytest.approx((1 - math.exp(-0.1)) / 2)


def test_a_baseline_is_never_silently_perturbed():
    root = Path(__file__).resolve().parents[1]
    alp = root / "configs" / "qwen2.5-math-1.5b_token_alp.yaml"
    with pytest.raises(ConfigError, match=r"perturbation\.enabled.*loss\.name=grpo"):
        load_config(alp, ["loss.name=grpo"])
    with pytest.raises(ConfigError, match=r"perturbation\.enabled.*loss\.name=seq_bypass"):
        load_config(alp, ["loss.name=seq_bypass"])
    ablation = load_config(alp, ["loss.name=grpo", "perturbation.allow_with_baseline=true"])
    assert ablation.perturbation.enabled is True
    with pytest.raises(ConfigError, match=r"perturbation\.enabled: false.*alp_token"):
        load_config(alp, ["perturbation.enabled=false"])
    # without an explicit choice, the loss decides; clip ranges default to the loss's level
    for name in LOSS_NAMES:
        cfg = config_from_dict({"model": {"tiny": "qwen2"}, "loss": {"name": name}})
        assert cfg.perturbation.enabled == (name in PERTURBED), name
        assert (cfg.loss.clip_low, cfg.loss.clip_high) == ((0.5, 3.0) if name in SEQ_LEVEL else (0.2, 0.28))
    for path in sorted((root / "configs").glob("*.yaml")):
        cfg = load_config(path)
        assert cfg.perturbation.enabled == get_policy_loss(cfg.loss.name).perturbed, path.name
        if cfg.perturbation.enabled and "quickstart" not in path.name:
            assert cfg.perturbation.shape == "scalar", f"{path.name}: the paper learns one sigma per layer"


# ------------------------------------------------------------------ multi-rank (torchrun, gloo)


TP_LOSS = dist_job("tp_loss", "check_tp_loss.py", "{dir}/result.json")


@pytest.fixture(scope="module")
def dist_results(dist_jobs):
    return read_results(dist_jobs.run("tp_loss") / "result.json")


@TP_LOSS
def test_tp2_logprobs_entropy_loss_and_grads_equal_tp1(dist_results):
    synthetic, model = dist_results["synthetic"], dist_results["model"]
    assert all(v < 1e-5 for v in synthetic.values()), synthetic
    assert model["logprobs"] < 2e-5 and model["entropy"] < 2e-5 and model["loss"] < 2e-5, model
    assert model["grad_rel"] < 1e-4, model


@TP_LOSS
def test_dp2_metric_reduction_equals_single_process(dist_results):
    mis = dist_results["dp_metrics"]["token_mis"]
    assert 0 < mis["mask/frac"] < 1
    assert abs(mis["loss/total"] - mis["loss"]) < 1e-6
    assert mis["ratio/min"] <= mis["ratio/p2"] <= mis["ratio/p50"] <= mis["ratio/p98"] <= mis["ratio/max"]
