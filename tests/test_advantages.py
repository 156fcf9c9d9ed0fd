"""GRPO group-normalised advantages."""

from __future__ import annotations

import pytest
import torch

from megatron_alp.algorithms.advantages import group_advantages


def test_matches_per_group_mean_and_std():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(5 * 8, generator=g)
    adv = group_advantages(rewards, 8, norm_by_std=True, eps=1e-6)
    for p in range(5):
        r = rewards[p * 8:(p + 1) * 8].double()
        expected = (r - r.mean()) / (r.std(unbiased=True) + 1e-6)
        assert torch.allclose(adv[p * 8:(p + 1) * 8].double(), expected, atol=1e-6)
        assert abs(adv[p * 8:(p + 1) * 8].sum().item()) < 1e-5


def test_without_std_only_centres():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0])
    adv = group_advantages(rewards, 4, norm_by_std=False)
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 1.0, 1.0, -1.0, -1.0]))


def test_binary_rewards_sign_and_scale():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, norm_by_std=True, eps=1e-6)
    assert adv[0] > 0 and (adv[1:] < 0).all()
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_identical_rewards_give_exact_zeros(norm_by_std):
    rewards = torch.tensor([0.1] * 8 + [1.0, 0.0] * 4 + [7.3] * 8)
    adv = group_advantages(rewards, 8, norm_by_std=norm_by_std, eps=1e-6)
    assert torch.isfinite(adv).all()
    assert (adv[:8] == 0).all() and (adv[16:] == 0).all()
    assert (adv[8:16] != 0).all()


def test_group_of_one_has_no_signal():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5]), 1)
    assert (adv == 0).all()


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="not a whole number of groups of 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 4), 4)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        group_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="NaN or inf"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match="eps must be > 0"):
        group_advantages(torch.zeros(4), 2, eps=0.0)
