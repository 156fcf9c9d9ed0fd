"""average@k and the unbiased pass@k estimator (Chen et al., 2021) of sampled answers.

pass@k uses 1 - C(n-c, k) / C(n, k) with n samples of which c are correct, so pass@j for every
j <= n comes from the same samples.
"""

from __future__ import annotations

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), computed as a
    product so it stays exact for large n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def score_matrix(correct: np.ndarray, pass_k: list[int]) -> dict:
    """average@n and pass@k (k <= n) of a (problems x samples) boolean matrix."""
    correct = np.asarray(correct, dtype=bool)
    if correct.ndim != 2 or correct.shape[0] == 0 or correct.shape[1] == 0:
        raise ValueError(f"expected a non-empty (problems x samples) matrix, got shape {correct.shape}")
    n = correct.shape[1]
    counts = correct.sum(axis=1)
    ks = [k for k in pass_k if k <= n]
    return {
        "problems": int(correct.shape[0]),
        "samples": n,
        f"average@{n}": float(correct.mean()),
        "pass@k": {str(k): float(np.mean([pass_at_k(n, int(c), k) for c in counts])) for k in ks},
    }
