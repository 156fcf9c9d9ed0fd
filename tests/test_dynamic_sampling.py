"""Dynamic sampling's selection logic on hand-built groups: a pure-Python stream of prompts whose
group rewards are fixed by the prompt id, so the expected batch is known without the code."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_alp.algorithms.advantages import group_advantages
from megatron_alp.algorithms.dynamic_sampling import Groups, fill_batch, round_size, zero_variance

N = 4


def rewards_of(p: int, informative) -> list[float]:
    """Prompt ``p``'s group: mixed rewards when ``informative(p)``, else all 0 or all 1."""
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
        return Groups(prompts, [f"p{p}s{j}" for p in prompts for j in range(N)], torch.tensor(rewards))

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
        fill_batch(s.draw(4), lambda k, r: Groups(list(range(k)), ["t"] * 2 * k, torch.zeros(2 * k)),
                   wanted=4, n=N, max_rounds=1)
    with pytest.raises(ValueError, match="one reward per trajectory"):
        Groups([0], ["a", "b"], torch.zeros(3))
