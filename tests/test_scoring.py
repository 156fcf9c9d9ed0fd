"""Rewards of sampled trajectories (megatron_alp/batches/scoring.py)."""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_alp.batches.scoring import Scorer, score

CFG = SimpleNamespace(rollout=SimpleNamespace(sampling=SimpleNamespace(n=2)),
                      reward=SimpleNamespace(overlong_buffer=0))
PROMPTS = [SimpleNamespace(ground_truth="3"), SimpleNamespace(ground_truth="5")]
TRAJECTORIES = [SimpleNamespace(response_text=t) for t in ("3", "4", "5", "5")]


def exact_match(responses, truths):
    return [float(r == t) for r, t in zip(responses, truths)]


def test_rank_0_scores_and_the_others_receive_its_rewards_through_the_given_broadcast(monkeypatch):
    """No collective of the default (NCCL on GPUs) process group: the rewards travel only through
    the broadcast handed in (the rollout's CPU group), which the ranks that do not score wait in."""
    def refuse(*args, **kwargs):
        raise AssertionError("a collective of the default process group")

    for name in ("broadcast", "broadcast_object_list", "all_reduce", "all_gather", "all_gather_object"):
        monkeypatch.setattr(dist, name, refuse)
    sent = []

    def rank0_broadcast(obj):
        sent.append(obj)
        return obj

    rewards, correct = Scorer(CFG, exact_match)(TRAJECTORIES, PROMPTS, rank0_broadcast)
    assert sent == [([1.0, 0.0, 1.0, 1.0], [True, False, True, True])]
    assert rewards.dtype == torch.float32 and rewards.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert correct.dtype == torch.bool and correct.tolist() == [True, False, True, True]
    received = Scorer(CFG, None)(TRAJECTORIES, PROMPTS, lambda obj: sent[0] if obj is None else None)
    assert torch.equal(received[0], rewards) and torch.equal(received[1], correct)


def test_correct_is_full_credit_before_the_overlong_punishment():
    """L_max = 10, L_c = 4, penalty 2: 0 up to 6 tokens, -1 at 8, -2 at 10. A punished right answer
    stays correct; partial credit is not correct however short the answer."""
    cfg = SimpleNamespace(rollout=SimpleNamespace(sampling=SimpleNamespace(n=2, max_response_length=10)),
                          reward=SimpleNamespace(overlong_buffer=4, overlong_penalty=2.0))
    trajectories = [SimpleNamespace(response_text=t, response_ids=[0] * length)
                    for t, length in (("3", 10), ("4", 2), ("5", 8), ("half", 2))]
    rewards, correct = score(cfg, lambda responses, truths: [1.0, 0.0, 1.0, 0.5], trajectories, PROMPTS)
    assert rewards == [-1.0, 0.0, 0.0, 0.5]
    assert correct == [True, False, True, False]
