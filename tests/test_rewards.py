"""Rewards: final-answer extraction, real math-verify comparisons, the per-sample time limit
(a pathological answer times out to 0 and the pool carries on), and the registry."""

from __future__ import annotations

import time

import pytest

from megatron_alp.config import RewardConfig
from megatron_alp.rewards import REWARDS, RewardFn, build_reward, register_reward
from megatron_alp.rewards.math_verify import MathVerifyReward, extract_boxed
from megatron_alp.rewards.worker_pool import ScoringPool


@pytest.fixture(scope="module")
def reward():
    with build_reward(RewardConfig(name="math_verify", timeout_s=1.0, workers=2)) as fn:
        yield fn


@pytest.mark.parametrize("text, expected", [
    ("The answer is \\boxed{42}.", "42"),
    ("first \\boxed{1}, then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{ 7 }", "7"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\boxed{x^{2}} and \\fbox{y_{1}}", "y_{1}"),
    ("so $\\boxed 5$", "5"),
    ("The answer is \\boxed 12.", "12"),
    ("\\boxed 3.5, done", "3.5"),
    ("\\boxed {7}", "7"),
    ("\\boxed{1} and later \\boxed 2", "2"),
    ("\\fbox{\\{a\\}}", "\\{a\\}"),
    ("\\boxed{\\}}", "\\}"),  # an escaped closing brace is content
    ("\\boxed{a \\{ b}", "a \\{ b"),  # an escaped opening brace opens nothing
    ("\\boxed{2} \\boxedtext{3}", "2"),  # another command, not \boxed
    ("ends in \\boxed", None),
    ("no box here", None),
    ("\\boxed{}", None),
    ("\\boxed{unclosed {", None),
    ("\\boxed{3} then a truncated \\boxed{1", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_math_verify_scores(reward):
    cases = [
        ("So the answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{ 7 }", "7", 1.0),
        ("\\boxed{7}", "\\boxed{7}", 1.0),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
        ("\\boxed{(x+1)^{2}}", "x^2 + 2x + 1", 1.0),
        ("\\boxed{\\{1,2\\}}", "\\{2, 1\\}", 1.0),
        ("we try \\boxed{3}, no wait: \\boxed{4}", "4", 1.0),
        ("The answer is \\boxed 5.", "5", 1.0),
        ("we try \\boxed{4}, no wait: \\boxed{3}", "4", 0.0),
        ("\\boxed{8}", "7", 0.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("The answer is 7.", "7", 0.0),  # no boxed answer
        ("", "7", 0.0),
        ("\\boxed{\\frac{1}{", "0.5", 0.0),
        ("\\boxed{)(*&^}", "1", 0.0),
    ]
    scores = reward([c[0] for c in cases], [c[1] for c in cases])
    assert scores == [c[2] for c in cases]


def test_bad_batches(reward):
    assert reward([], []) == []
    assert reward([None, 42], ["1", None]) == [0.0, 0.0]  # never raises for bad model output
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        reward(["a", "b"], ["1"])


def test_pathological_answer_times_out_and_pool_survives(reward):
    tower = "\\boxed{9^{9^{9^{9^{9}}}}}"
    huge = "\\boxed{" + "+".join(f"{i}^{{{i}^{{{i}}}}}" for i in range(2, 400)) + "}"
    pids_before = {w.proc.pid for w in reward.pool._workers}
    timeouts_before = reward.pool.timeouts
    t0 = time.monotonic()
    scores = reward([tower, "\\boxed{2}", huge, "\\boxed{\\frac{6}{4}}"], ["1", "2", "3", "1.5"])
    elapsed = time.monotonic() - t0
    assert scores == [0.0, 1.0, 0.0, 1.0]
    assert reward.pool.timeouts - timeouts_before == 2
    assert elapsed < 8.0, elapsed  # 2 timeouts of 1 s plus worker restarts, never a hang
    assert {w.proc.pid for w in reward.pool._workers} != pids_before  # killed workers were replaced
    assert reward(["\\boxed{3}"] * 4, ["3"] * 4) == [1.0] * 4  # and the pool keeps working


def test_scoring_pool_contains_errors_crashes_and_hangs():
    with pytest.raises(ValueError, match="package.module:function"):
        ScoringPool("math.sqrt", workers=1, timeout_s=1)
    errors = ScoringPool("math:sqrt", workers=2, timeout_s=5.0, default=-1.0)
    crashes = ScoringPool("os:_exit", workers=1, timeout_s=5.0)
    hangs = ScoringPool("time:sleep", workers=2, timeout_s=0.5, default=-2.0)
    try:
        assert errors.map([(4,), (-1,), ("x",), (2.25,)]) == [2.0, -1.0, -1.0, 1.5]
        assert crashes.map([(3,), (0,)]) == [0.0, 0.0] and crashes.crashes == 2
        t0 = time.monotonic()
        assert hangs.map([(30,), (30,), (30,)]) == [-2.0] * 3
        assert time.monotonic() - t0 < 5.0 and hangs.timeouts == 3
    finally:
        for pool in (errors, crashes, hangs):
            pool.close()
    assert all(w.proc.poll() is not None for w in errors._workers) or errors._workers == []


def test_worker_start_failure_is_reported():
    pool = ScoringPool("megatron_alp.no_such_module:score", workers=1, timeout_s=1.0)
    try:
        with pytest.raises(RuntimeError, match="(?s)failed to start.*ModuleNotFoundError"):
            pool.map([("x",)])
    finally:
        pool.close()


def test_registry():
    assert isinstance(REWARDS["math_verify"], type) and issubclass(REWARDS["math_verify"], MathVerifyReward)

    @register_reward("test_length")
    class LengthReward(RewardFn):
        def __init__(self, cfg):
            self.scale = cfg.timeout_s

        def __call__(self, responses, ground_truths):
            return [self.scale * len(r) for r in responses]

    try:
        fn = build_reward(RewardConfig(name="test_length", timeout_s=2.0))
        assert fn(["ab", "abc"], ["", ""]) == [4.0, 6.0]
        with pytest.raises(ValueError, match="already registered"):
            register_reward("test_length")(LengthReward)
    finally:
        REWARDS.pop("test_length")
    with pytest.raises(ValueError, match="reward.name='nope' is not a registered reward"):
        build_reward(RewardConfig(name="nope"))
