"""Packing trajectories into target-aligned tensors and splitting them."""

import torch

from megatron_alp.rl_batch import build_rl_batch, dp_shard, micro_batches, mini_batches
from megatron_alp.rollout.base import Trajectory


def _traj(prompt, response, mask=None, lp=None):
    mask = mask if mask is not None else [1] * len(response)
    lp = lp if lp is not None else [-0.1 * (i + 1) for i in range(len(response))]
    return Trajectory(prompt, response, lp, mask, "", "stop")


def test_alignment_token_by_token():
    trajs = [_traj([5, 6, 7], [8, 9], mask=[1, 0]), _traj([5], [10, 11, 12, 13]), _traj([4, 4], [])]
    b = build_rl_batch(trajs, torch.tensor([1.0, -1.0, 0.0]), pad_id=0)
    assert b.tokens.shape == (3, 5)
    for i, t in enumerate(trajs):
        p = len(t.prompt_ids)
        for j, tok in enumerate(t.response_ids):
            # logits at p-1+j predict response token j
            assert b.targets[i, p - 1 + j] == tok
            assert b.loss_mask[i, p - 1 + j] == t.loss_mask[j]
            expected_lp = t.rollout_logprobs[j] if t.loss_mask[j] else 0.0
            assert torch.isclose(b.rollout_logprobs[i, p - 1 + j], torch.tensor(expected_lp))
        assert b.loss_mask[i].sum() == sum(t.loss_mask)
    assert b.loss_mask[2].sum() == 0 and b.lengths.tolist() == [5, 5, 2]


def test_splits_keep_every_row_once():
    trajs = [_traj([1] * (i % 3 + 1), [2] * (i % 5 + 1)) for i in range(16)]
    b = build_rl_batch(trajs, torch.arange(16.0), pad_id=0)
    shard = dp_shard(b, dp_rank=1, dp_size=2)
    assert shard.advantages.tolist() == list(range(8, 16))
    minis = mini_batches(shard, 2)
    assert [m.advantages.tolist() for m in minis] == [list(range(8, 12)), list(range(12, 16))]
    micro = micro_batches(minis[0], size=3, pad_multiple=2, pad_id=0)
    assert sorted(a for m in micro for a in m.advantages.tolist()) == list(range(8, 12))
    assert all(m.tokens.shape[1] % 2 == 0 for m in micro)
    # longest first, so the first micro-batch holds the longest row and the last is narrow
    assert micro[0].lengths.max() >= micro[-1].lengths.max()
    total_mask = sum(m.loss_mask.sum() for m in micro)
    assert total_mask == minis[0].loss_mask.sum()


def test_each_optimizer_step_trains_on_the_same_rows_whatever_the_data_parallel_size():
    b = build_rl_batch([_traj([1], [2] * (i % 5 + 1)) for i in range(16)], torch.arange(16.0), pad_id=0)
    one_rank = [m.advantages.tolist() for m in mini_batches(dp_shard(b, 0, 1, mini_batches=2), 2)]
    assert one_rank == [list(range(8)), list(range(8, 16))]
    for dp in (2, 4):
        steps = [[] for _ in range(2)]
        for rank in range(dp):
            for k, m in enumerate(mini_batches(dp_shard(b, rank, dp, mini_batches=2), 2)):
                steps[k] += m.advantages.tolist()
        assert steps == one_rank
