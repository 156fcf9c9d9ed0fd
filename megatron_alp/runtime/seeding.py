"""Seeds derived from a base seed and integer keys, for every random stream that must replay.

ALP noise (seed, step, micro-batch, ranks), rollout samples (seed, iteration, prompt, sample),
multi-turn episodes (per turn) and the trainer's per-iteration RNG (:func:`seed_everything`) all
derive their seeds here, so a resumed run or another parallel layout draws exactly the same
numbers. Splitmix64 steps mix the keys, so nearby keys give unrelated seeds.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed for the sub-stream ``keys`` of ``seed``."""
    x = 0x9E3779B97F4A7C15
    for v in (seed, *keys):
        x = (x ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (the trainer does at every iteration)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
