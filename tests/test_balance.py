"""Greedy splitting of work into balanced bins (megatron_alp/algorithms/balance.py)."""

import itertools
import random

import pytest

from megatron_alp.algorithms.balance import imbalance, partition


def brute_force_best(costs, bins):
    """The smallest possible largest load, by trying every assignment."""
    best = float("inf")
    for assignment in itertools.product(range(bins), repeat=len(costs)):
        loads = [0.0] * bins
        for c, b in zip(costs, assignment):
            loads[b] += c
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_partition_covers_every_item_once_within_four_thirds_of_the_optimum(seed):
    rng = random.Random(seed)
    costs = [rng.choice([1, 2, 3, 5, 8, 13, 40]) for _ in range(rng.randint(1, 9))]
    bins = rng.randint(1, 3)
    out = partition(costs, bins)
    assert len(out) == bins
    assert sorted(i for b in out for i in b) == list(range(len(costs)))
    assert all(b == sorted(b) for b in out)
    largest = max(sum(costs[i] for i in b) for b in out)
    assert largest <= 4 / 3 * brute_force_best(costs, bins) + 1e-9


def test_partition_is_deterministic_and_fills_bins_before_stacking():
    costs = [5.0] * 4 + [1.0] * 4
    assert partition(costs, 4) == partition(list(costs), 4)
    assert partition(costs, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert partition([3.0], 3) == [[0], [], []]
    with pytest.raises(ValueError, match="bins must be >= 1"):
        partition([1.0], 0)


def test_imbalance_is_max_over_mean():
    assert imbalance([2.0, 2.0]) == 1.0
    assert imbalance([3.0, 1.0]) == pytest.approx(1.5)
    assert imbalance([0.0, 0.0]) == 1.0
