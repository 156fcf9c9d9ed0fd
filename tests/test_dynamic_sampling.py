"""Dynamic sampling's selection logic on hand-built groups: a pure-Python stream of prompts whose
group rewards are fixed by the prompt id, so the expected batch is known without the code."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from megatron_alp.algorithms.advantages import group_advantages
from megatron_alp.algorithms.dynamic_sampling import Groups, fill_batch, keep_groups, round_size, zero_variance
from megatron_alp.batches.scoring import score

N = 4


def rewards_of(p: int, informative) -> list[float]:
    """Prompt ``p``'s group: mixed rewards (1.0 is the one correct answer, 0.5 partial credit) when
    ``informative(p)``, else all 0 (wrong) or all 1 (right)."""
    if informative(p):
        return [1.0, 0.0, float(p % 2), 0.5]
    return [float(p % 2)] * N


class Stream:
    """Prompts 0, 1, 2, ... in order; records what each extra round asked for."""

    def __init__(self, informative):
        self.informative = informative
        self.next = 0
        self.asks: list[tuple[int, int]] = []
        self.rewards: list[float] = []

    def draw(self, k: int) -> Groups:
        prompts = list(range(self.next, self.next + k))
        self.next += k
        rewards = [r for p in prompts for r in rewards_of(p, self.informative)]
        self.rewards += rewards
        return Groups(prompts, [f"p{p}s{j}" for p in prompts for j in range(N)], torch.tensor(rewards),
                      torch.tensor([r == 1.0 for r in rewards]))

    def more(self, k: int, round_: int) -> Groups:
        self.asks.append((k, round_))
        return self.draw(k)


def test_a_first_round_of_differing_rewards_is_the_batch():
    s = Stream(lambda p: True)
    first = s.draw(8)
    batch, stats = fill_batch(first, s.more, wanted=8, n=N, max_rounds=4)
    assert s.asks == []
    assert batch.prompts == first.prompts and batch.trajectories == first.trajectories
    assert torch.equal(batch.rewards, first.rewards)
    assert stats["dynamic_sampling/rounds"] == 0 and stats["dynamic_sampling/kept_frac"] == 1.0


def test_zero_variance_groups_are_replaced_by_the_next_groups_whose_rewards_differ():
    informative = lambda p: p % 3 == 1  # noqa: E731  (a keep rate of 1/3)
    s = Stream(informative)
    batch, stats = fill_batch(s.draw(8), s.more, wanted=8, n=N, max_rounds=4)
    expected = list(itertools.islice(filter(informative, itertools.count()), 8))
    assert batch.prompts == expected
    assert batch.trajectories == [f"p{p}s{j}" for p in expected for j in range(N)]
    assert batch.rewards.tolist() == [r for p in expected for r in rewards_of(p, informative)]
    assert not zero_variance(batch.rewards, N).any()
    # rounds are numbered from 1, and at a steady keep rate the adaptive size needs one of them
    assert [r for _, r in s.asks] == [1]
    drawn = s.next
    assert stats == pytest.approx({
        "dynamic_sampling/rounds": 1.0,
        "dynamic_sampling/generated_groups": float(drawn),
        "dynamic_sampling/kept_frac": sum(map(informative, range(drawn))) / drawn,
        "dynamic_sampling/filled_groups": 0.0,
        "dynamic_sampling/reward_mean": sum(s.rewards) / len(s.rewards),
    })


def test_at_the_round_cap_the_batch_is_completed_with_zero_variance_groups():
    informative = lambda p: p in (5, 100)  # noqa: E731
    s = Stream(informative)
    batch, stats = fill_batch(s.draw(6), s.more, wanted=6, n=N, max_rounds=2)
    assert len(s.asks) == 2 and s.next < 100
    # the one group found, plus the earliest zero-variance groups, in generation order
    assert batch.prompts == [0, 1, 2, 3, 4, 5]
    assert stats["dynamic_sampling/filled_groups"] == 5.0 and stats["dynamic_sampling/rounds"] == 2.0
    assert int(zero_variance(batch.rewards, N).sum()) == 5
    # with no extra round allowed, the first round is the batch as it is
    s = Stream(informative)
    batch, stats = fill_batch(s.draw(6), s.more, wanted=6, n=N, max_rounds=0)
    assert s.asks == [] and batch.prompts == list(range(6)) and stats["dynamic_sampling/filled_groups"] == 5.0


@pytest.mark.parametrize("kept, generated", [(1, 64), (8, 64), (16, 32), (30, 32), (0, 32)])
def test_a_round_asks_for_enough_at_the_keep_rate_seen_and_stays_bounded(kept, generated):
    missing, cap = 32 - kept, 128
    ask = round_size(missing, kept, generated, margin=1.25, max_prompts=cap)
    assert missing <= ask <= cap
    if kept:
        # the groups expected at the rate seen cover what is missing, with the margin, unless capped
        assert ask == cap or ask * kept / generated >= 1.25 * missing
        assert ask * kept / generated < 1.25 * missing + 1  # and not much more
    else:
        assert ask == cap  # nothing kept yet: as many as allowed
    # a lower keep rate never asks for fewer prompts
    assert round_size(missing, max(kept - 1, 0), generated, 1.25, cap) >= ask


def test_the_same_rewards_give_the_same_rounds():
    informative = lambda p: p % 7 in (2, 3)  # noqa: E731
    runs = []
    for _ in range(2):
        s = Stream(informative)
        batch, _ = fill_batch(s.draw(16), s.more, wanted=16, n=N, max_rounds=4, max_prompts=20)
        runs.append((s.asks, batch.prompts))
    assert runs[0] == runs[1]
    assert all(k <= 20 for k, _ in runs[0][0])


def test_zero_variance_is_exactly_where_group_advantages_are_zero():
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(64, 4, generator=g) < 0.3).float()
    rewards[::5] = 0.7
    rewards = rewards.reshape(-1)
    adv = group_advantages(rewards, 4).view(-1, 4)
    assert torch.equal(zero_variance(rewards, 4), (adv == 0).all(-1))


def test_a_round_of_the_wrong_shape_is_a_clear_error():
    s = Stream(lambda p: False)
    with pytest.raises(ValueError, match="asked for .* prompts, got 3 groups"):
        fill_batch(s.draw(4), lambda k, r: s.draw(3), wanted=4, n=N, max_rounds=1)
    with pytest.raises(ValueError, match="groups of 2 trajectories, expected n=4"):
        fill_batch(s.draw(4), lambda k, r: Groups(list(range(k)), ["t"] * 2 * k, torch.zeros(2 * k),
                                                  torch.zeros(2 * k, dtype=torch.bool)),
                   wanted=4, n=N, max_rounds=1)
    with pytest.raises(ValueError, match="rewards of shape .3,. .expected one per trajectory"):
        Groups([0], ["a", "b"], torch.zeros(3), torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="correct of shape .1,. .expected one per trajectory"):
        Groups([0], ["a", "b"], torch.zeros(2), torch.zeros(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="filter 'variance'"):
        fill_batch(s.draw(4), s.more, wanted=4, n=N, max_rounds=1, by="variance")


# DAPO's overlong punishment with L_max = 8 and L_c = 4: 0 up to 4 tokens, -0.5 at 6, -1 at 8
OVERLONG = SimpleNamespace(rollout=SimpleNamespace(sampling=SimpleNamespace(n=N, max_response_length=8)),
                           reward=SimpleNamespace(overlong_buffer=4, overlong_penalty=1.0))
# (name, the n answers, their lengths in tokens); the ground truth is "7"
CASES = [
    ("all correct, punished", ["7", "7", "7", "7"], [2, 4, 6, 8]),
    ("mixed", ["7", "3", "7", "3"], [2, 2, 2, 2]),
    ("all wrong, punished", ["3", "3", "3", "3"], [2, 4, 6, 8]),
    ("all wrong", ["3", "3", "3", "3"], [2, 2, 2, 2]),
    ("all correct", ["7", "7", "7", "7"], [2, 2, 2, 2]),
]
# DAPO keeps 0 < #correct < n; the reward filter keeps groups whose final rewards are not all equal
KEPT_BY_CORRECT = [False, True, False, False, False]
KEPT_BY_REWARD = [True, True, True, False, False]


def exact_match(responses, truths):
    return [float(r == t) for r, t in zip(responses, truths)]


def scored(cases, first_prompt: int = 0) -> Groups:
    """Groups scored as the trainer scores them (exact match, then the overlong punishment)."""
    prompts = [SimpleNamespace(id=first_prompt + i, ground_truth="7") for i in range(len(cases))]
    trajectories = [SimpleNamespace(response_text=a, response_ids=[0] * length)
                    for _, answers, lengths in cases for a, length in zip(answers, lengths)]
    rewards, correct = score(OVERLONG, exact_match, trajectories, prompts)
    return Groups(prompts, trajectories, torch.tensor(rewards), torch.tensor(correct))


def test_the_scores_carry_correctness_before_the_overlong_punishment():
    groups = scored(CASES[:1])
    assert groups.rewards.tolist() == [1.0, 1.0, 0.5, 0.0]
    assert groups.correct.tolist() == [True] * N


def test_dapo_keeps_groups_with_some_but_not_all_answers_correct():
    groups = scored(CASES)
    assert keep_groups(groups, N, "correct").tolist() == KEPT_BY_CORRECT
    assert keep_groups(groups, N, "reward").tolist() == KEPT_BY_REWARD


@pytest.mark.parametrize("by", ["correct", "reward"])
def test_the_batch_and_its_statistics_follow_the_filter(by):
    """Two groups wanted from the five cases, then extra rounds of mixed groups: under ``correct``
    the first round gives one (the mixed group) and a round adds the second; under ``reward`` the
    first round gives three, and the batch is its first two."""
    asks = []

    def more(k, round_):
        asks.append(k)
        return scored([CASES[1]] * k, first_prompt=100 * round_)

    batch, stats = fill_batch(scored(CASES), more, wanted=2, n=N, max_rounds=2, by=by)
    if by == "correct":
        assert len(asks) == 1
        assert [p.id for p in batch.prompts] == [1, 100]
        assert batch.correct.tolist() == [True, False, True, False] * 2
        assert stats["dynamic_sampling/kept_frac"] == (1 + asks[0]) / (5 + asks[0])
        assert stats["dynamic_sampling/generated_groups"] == 5 + asks[0]
    else:
        assert asks == []
        assert [p.id for p in batch.prompts] == [0, 1]
        assert batch.rewards.tolist() == [1.0, 1.0, 0.5, 0.0, 1.0, 0.0, 1.0, 0.0]
        assert batch.correct.tolist() == [True] * N + [True, False, True, False]
        assert stats["dynamic_sampling/kept_frac"] == 3 / 5
    assert stats["dynamic_sampling/filled_groups"] == 0
