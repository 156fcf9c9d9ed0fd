"""DAPO's soft overlong punishment, added to the task reward of every response.

With ``L_max`` the response budget (``rollout.sampling.max_response_length``) and ``L_c`` the
buffer (``reward.overlong_buffer``), a response of ``|y|`` tokens gets 0 while ``|y| <= L_max - L_c``,
then a penalty growing linearly to ``-penalty`` at ``L_max``, and ``-penalty`` beyond: the model
learns that running into the limit costs reward before truncation cuts its answer off. ``|y|``
counts every token of the response, interpreter output of multi-turn episodes included: it spends
the same budget (:mod:`megatron_alp.tir.multi_turn`).
"""

from __future__ import annotations


def overlong_penalty(length: int, max_length: int, buffer: int, penalty: float) -> float:
    """The (non-positive) reward added to a response of ``length`` tokens; 0 when ``buffer`` is 0."""
    if buffer <= 0:
        return 0.0
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / buffer * penalty
    return -penalty
