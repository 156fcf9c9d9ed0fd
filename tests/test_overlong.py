"""DAPO's soft overlong punishment against the paper's formula, and its config checks."""

from __future__ import annotations

import pytest

from megatron_alp.config import ConfigError
from megatron_alp.resolve import config_from_dict
from megatron_alp.rewards.overlong import overlong_penalty


def dapo_penalty(y: int, l_max: int, l_cache: int, penalty: float) -> float:
    """DAPO (Yu et al. 2025), soft overlong punishment, scaled by ``penalty``:
    R_length(y) = 0                                     if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                = -1                                    if |y| > L_max"""
    if y <= l_max - l_cache:
        return 0.0
    if y <= l_max:
        return ((l_max - l_cache) - y) / l_cache * penalty
    return -penalty


@pytest.mark.parametrize("l_max, l_cache, penalty", [(20, 5, 1.0), (24, 8, 0.5), (4096, 1024, 2.0), (10, 10, 1.0)])
def test_penalty_follows_the_dapo_formula(l_max, l_cache, penalty):
    for y in range(0, l_max + 3):
        assert overlong_penalty(y, l_max, l_cache, penalty) == pytest.approx(dapo_penalty(y, l_max, l_cache, penalty))


def test_penalty_by_hand():
    # L_max 20, buffer 5: free up to 15 tokens, then -1/5 per token down to -1 at 20
    assert [overlong_penalty(y, 20, 5, 1.0) for y in (0, 15, 16, 18, 20, 21)] == pytest.approx(
        [0.0, 0.0, -0.2, -0.6, -1.0, -1.0])
    assert overlong_penalty(18, 20, 5, 0.5) == pytest.approx(-0.3)


def test_no_buffer_no_penalty():
    assert all(overlong_penalty(y, 16, 0, 1.0) == 0.0 for y in range(0, 20))


def test_penalty_is_continuous_and_never_rises_with_length():
    values = [overlong_penalty(y, 100, 30, 1.0) for y in range(0, 120)]
    assert all(b <= a for a, b in zip(values, values[1:]))
    assert max(abs(b - a) for a, b in zip(values, values[1:])) == pytest.approx(1 / 30)


def _cfg(**sections):
    base = {"model": {"tiny": "qwen2"}, "rollout": {"sampling": {"n": 4, "max_response_length": 32}}}
    for key, value in sections.items():
        base.setdefault(key, {}).update(value)
    return config_from_dict(base)


def test_recipe_keys_are_off_by_default_and_checked():
    cfg = _cfg()
    assert (cfg.trainer.dynamic_sampling, cfg.loss.mask_truncated, cfg.reward.overlong_buffer) == (False, False, 0)
    assert cfg.trainer.dynamic_sampling_filter == "correct"  # DAPO's rule
    assert _cfg(trainer={"dynamic_sampling_filter": "reward"}).trainer.dynamic_sampling_filter == "reward"
    with pytest.raises(ConfigError, match="trainer.dynamic_sampling_filter"):
        _cfg(trainer={"dynamic_sampling_filter": "variance"})
    assert _cfg(reward={"overlong_buffer": 32}).reward.overlong_buffer == 32
    with pytest.raises(ConfigError, match="reward.overlong_buffer=33 is longer than rollout.sampling.max_response"):
        _cfg(reward={"overlong_buffer": 33})
    with pytest.raises(ConfigError, match="reward.overlong_penalty"):
        _cfg(reward={"overlong_buffer": 8, "overlong_penalty": -1.0})
    with pytest.raises(ConfigError, match="trainer.dynamic_sampling .* needs rollout.sampling.n >= 2"):
        config_from_dict({"model": {"tiny": "qwen2"}, "rollout": {"sampling": {"n": 1}},
                          "trainer": {"dynamic_sampling": True}})
    with pytest.raises(ConfigError, match="trainer.dynamic_sampling_max_rounds"):
        _cfg(trainer={"dynamic_sampling": True, "dynamic_sampling_max_rounds": -1})
