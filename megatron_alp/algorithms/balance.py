"""Splitting work items of known cost into bins of near-equal load (rollout replicas, ranks).

Deterministic: every rank computes the same split from the same costs, so no rank has to send
the split to the others.
"""

from __future__ import annotations

import heapq
from typing import Sequence


def partition(costs: Sequence[float], bins: int) -> list[list[int]]:
    """Indices of ``costs`` in ``bins`` lists, each ascending. Greedy longest-processing-time: items
    in decreasing cost (ties by index) go to the least-loaded bin (ties by bin number), which keeps
    the largest load within 4/3 of the optimum."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1 (got {bins})")
    heap = [(0.0, b) for b in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, b = heapq.heappop(heap)
        out[b].append(i)
        heapq.heappush(heap, (load + float(costs[i]), b))
    return [sorted(items) for items in out]


def imbalance(loads: Sequence[float]) -> float:
    """max / mean load (1.0 is perfect balance; 1.0 for no load at all)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def sequence_cost(length: int, hidden_size: int) -> float:
    """Relative forward/backward cost of a sequence of ``length`` tokens in a transformer of width
    ``hidden_size``: the linear layers cost ~24 h^2 FLOPs per token per layer, causal attention
    ~2 h L (half of QK^T and AV), so a token costs 1 + L / (12 h) token-equivalents."""
    return length * (1.0 + length / (12.0 * hidden_size))
