"""`math_verify` reward: 1.0 when the final ``\\boxed{}`` answer equals the ground truth.

The answer is the content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in the
response (:func:`extract_boxed`, also the answer parser of ``megatron-alp eval``); a response
without one scores 0. Answer and ground truth are parsed and compared by the math-verify package
(so ``\\frac{1}{2}``, ``0.5`` and ``1/2`` agree). Parsing and comparison run in worker processes
with a per-sample limit of ``reward.timeout_s`` seconds: an answer like a huge exponent tower
scores 0 when it runs out of time, and its worker is replaced.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Optional

from megatron_alp.rewards import RewardFn, check_batch, register_reward
from megatron_alp.rewards.worker_pool import ScoringPool

if TYPE_CHECKING:
    from megatron_alp.config import RewardConfig

# \boxed or \fbox as a whole control word (not the start of a longer one such as \boxedtext)
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` in ``text``: nested braces balanced,
    escaped ones (``\\{``, ``\\}``) kept as content. An unbraced argument (``\\boxed 5``) is the
    next word, up to a ``$``, without a trailing full stop or comma. None when there is none, it is
    empty, or its braces never close (a truncated last answer does not fall back to an earlier one)."""
    if not isinstance(text, str):
        return None
    last = None
    for last in _BOX.finditer(text):
        pass
    if last is None:
        return None
    i = last.end()
    while i < len(text) and text[i].isspace():
        i += 1
    if not text.startswith("{", i):
        return re.match(r"[^\s$]*", text[i:]).group(0).rstrip(".,;") or None
    depth, j = 0, i
    while j < len(text):
        ch = text[j]
        if ch == "\\":  # an escaped character, e.g. \{ or \}, is content
            j += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip() or None
        j += 1
    return None


@functools.lru_cache(maxsize=4096)
def _parse_truth(ground_truth: str) -> tuple:
    from math_verify import parse

    truth = ground_truth.strip()
    gold = parse(truth if "\\boxed" in truth else f"\\boxed{{{truth}}}", parsing_timeout=None)
    if not gold:
        gold = parse(truth, parsing_timeout=None)
    return tuple(gold) if gold else (truth,)


def score(response: str, ground_truth: str) -> float:
    """1.0 if the last boxed answer of ``response`` matches ``ground_truth`` (run in a worker:
    no time limit of its own)."""
    from math_verify import parse, verify

    answer = extract_boxed(response)
    if answer is None:
        return 0.0
    pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    if not pred:
        return 0.0
    return 1.0 if verify(list(_parse_truth(str(ground_truth))), pred, timeout_seconds=None) else 0.0


def warmup() -> None:
    """Import math-verify and its grammar once, before the worker reports ready."""
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    score("\\boxed{1}", "1")


@register_reward("math_verify")
class MathVerifyReward(RewardFn):
    def __init__(self, cfg: "RewardConfig"):
        self.pool = ScoringPool(f"{__name__}:score", workers=cfg.workers, timeout_s=cfg.timeout_s)

    def __call__(self, responses: list[str], ground_truths: list[str]) -> list[float]:
        check_batch(responses, ground_truths)
        items = [(r if isinstance(r, str) else "", "" if g is None else str(g))
                 for r, g in zip(responses, ground_truths)]
        return self.pool.map(items) if items else []

    def close(self) -> None:
        self.pool.close()
