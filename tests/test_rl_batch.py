"""Packing trajectories into target-aligned tensors, splitting them, and taking responses out of the
loss (``loss.mask_truncated``) as if they were deleted."""

import random

import pytest
import torch

from megatron_alp.algorithms.advantages import group_advantages
from megatron_alp.algorithms.balance import imbalance
from megatron_alp.algorithms.policy_loss import LossInputs, loss_counts, policy_loss
from megatron_alp.config import LossConfig
from megatron_alp.data.trajectory import Trajectory
from megatron_alp.training.rl_batch import build_rl_batch, dp_assignment, dp_shard, exclude_from_loss, mini_batches


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


def test_contiguous_split_keeps_every_row_once():
    trajs = [_traj([1] * (i % 3 + 1), [2] * (i % 5 + 1)) for i in range(16)]
    b = build_rl_batch(trajs, torch.arange(16.0), pad_id=0)
    shard, sizes = dp_shard(b, dp_assignment(16, 2), dp_rank=1)
    assert shard.advantages.tolist() == list(range(8, 16)) and sizes == [8]
    shard, sizes = dp_shard(b, dp_assignment(16, 2, mini_batches=2), dp_rank=1)
    assert [m.advantages.tolist() for m in mini_batches(shard, sizes)] == [list(range(4, 8)), list(range(12, 16))]


def _steps(b, dp: int, costs=None) -> list[list[float]]:
    steps = [[] for _ in range(2)]
    for rank in range(dp):
        shard, sizes = dp_shard(b, dp_assignment(len(b), dp, 2, costs), rank)
        for k, m in enumerate(mini_batches(shard, sizes)):
            steps[k] += m.advantages.tolist()
    return [sorted(s) for s in steps]


@pytest.mark.parametrize("balanced", [False, True])
def test_each_optimizer_step_trains_on_the_same_rows_whatever_the_data_parallel_size(balanced):
    b = build_rl_batch([_traj([1], [2] * (i % 5 + 1)) for i in range(16)], torch.arange(16.0), pad_id=0)
    costs = b.lengths.float().tolist() if balanced else None
    assert _steps(b, 1, costs) == [list(range(8)), list(range(8, 16))]
    for dp in (2, 4):
        assert _steps(b, dp, costs) == [list(range(8)), list(range(8, 16))]


def test_balanced_split_evens_out_long_tailed_costs():
    rng = random.Random(0)
    costs = [min(2048.0, rng.lognormvariate(5.7, 1.0)) for _ in range(64)]
    loads = lambda a: [sum(costs[i] for i in rows) for rows in a[0]]  # noqa: E731
    contiguous, balanced = loads(dp_assignment(64, 4)), loads(dp_assignment(64, 4, costs=costs))
    assert imbalance(balanced) <= imbalance(contiguous)
    # LPT: the largest load is within the average plus one item of the optimum's bound
    assert max(balanced) <= sum(costs) / 4 + max(costs)
    assert sorted(i for rows in dp_assignment(64, 4, costs=costs)[0] for i in rows) == list(range(64))


# ------------------------------------------------------------------ loss.mask_truncated

LOSS_NAMES = ("alp_token", "alp_seq", "grpo", "gspo", "token_mis", "seq_mis", "token_tis", "seq_bypass")
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def _truncation_batch():
    """Two groups of four; responses 1, 4 and 6 hit the length limit (the longest: 9 tokens)."""
    g = torch.Generator().manual_seed(3)
    lengths = [4, 9, 3, 5, 9, 2, 9, 6]
    truncated = [False, True, False, False, True, False, True, False]
    trajs = []
    for i, (r, cut) in enumerate(zip(lengths, truncated)):
        mask = [1] * r if i != 3 else [1, 1, 0, 0, 1]  # a tool output in the middle of one response
        trajs.append(Trajectory([1] * (2 + i % 3), [3 + i] * r, (-torch.rand(r, generator=g) * 2).tolist(), mask, "",
                                "length" if cut else "stop"))
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]), 4)
    return trajs, advantages, torch.tensor(truncated)


def _noise(shape, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g, dtype=torch.float64) * 0.3 for k in ("lp", "old", "ref", "ent")}


def _loss_and_grad(batch, name, aggregation, noise):
    """The real policy loss of ``batch`` normalised by :func:`loss_counts` (what the trainer's
    global counts sum over ranks), and its gradient in the logprobs."""
    rollout = batch.rollout_logprobs.double()
    lp = (rollout + noise["lp"]).requires_grad_()
    tokens, seqs = loss_counts(batch.loss_mask)
    cfg = LossConfig(name=name, aggregation=aggregation, kl_coef=0.05, entropy_coef=0.02)
    loss, _ = policy_loss(cfg, LossInputs(
        logprobs=lp, rollout_logprobs=rollout, advantages=batch.advantages.double(), mask=batch.loss_mask,
        old_logprobs=rollout + noise["old"], ref_logprobs=rollout + noise["ref"], entropy=noise["ent"].abs(),
        global_tokens=tokens, global_seqs=seqs))
    loss.backward()
    return loss.detach(), lp.grad


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_masked_truncated_responses_leave_the_loss_as_if_deleted(name, aggregation):
    trajs, advantages, truncated = _truncation_batch()
    masked = build_rl_batch(trajs, advantages, pad_id=0)
    exclude_from_loss(masked, truncated)
    kept = [i for i in range(len(trajs)) if not truncated[i]]
    deleted = build_rl_batch([trajs[i] for i in kept], advantages[kept], pad_id=0)
    assert loss_counts(masked.loss_mask) == loss_counts(deleted.loss_mask) == (
        float(sum(sum(trajs[i].loss_mask) for i in kept)), 5.0)

    noise = _noise(masked.tokens.shape)
    width = deleted.tokens.shape[1]  # narrower: the longest responses were cut
    loss_m, grad_m = _loss_and_grad(masked, name, aggregation, noise)
    loss_d, grad_d = _loss_and_grad(deleted, name, aggregation, {k: v[kept, :width] for k, v in noise.items()})
    assert torch.isclose(loss_m, loss_d, rtol=1e-12, atol=1e-15), (loss_m, loss_d)
    assert (grad_m[truncated] == 0).all() and (grad_m[kept, width:] == 0).all()
    assert torch.allclose(grad_m[kept, :width], grad_d, rtol=1e-12, atol=1e-15)


def test_a_mini_batch_of_truncated_responses_only_has_zero_loss_not_nan():
    trajs, advantages, _ = _truncation_batch()
    batch = build_rl_batch(trajs, advantages, pad_id=0)
    exclude_from_loss(batch, torch.ones(len(trajs), dtype=torch.bool))
    assert loss_counts(batch.loss_mask) == (0.0, 0.0) and batch.rollout_logprobs.abs().sum() == 0
    for aggregation in AGGREGATIONS:
        for name in LOSS_NAMES:
            loss, grad = _loss_and_grad(batch, name, aggregation, _noise(batch.tokens.shape))
            assert loss.item() == 0.0 and (grad == 0).all(), (name, aggregation)


def test_engine_routing_is_aligned_to_its_token_and_follows_the_rows():
    """Engine routing [tokens, layers, k] lands at the token positions it describes (input-aligned
    like ``tokens``: the last token, never fed back, has none), in a compact dtype with the
    no-expert marker past each trajectory's routing; selecting, sharding and padding rows carry it
    with them."""
    import numpy as np

    from megatron_alp.models.routing import no_expert

    trajs = []
    for n_prompt, n_resp, base in ((3, 2, 10), (1, 4, 40), (2, 0, 70)):
        total = n_prompt + n_resp
        routed = (base + np.arange((total - 1) * 2 * 2).reshape(total - 1, 2, 2)).astype(np.uint8)
        t = _traj(list(range(5, 5 + n_prompt)), list(range(50, 50 + n_resp)))
        t.routed_experts = routed
        trajs.append(t)
    b = build_rl_batch(trajs, torch.zeros(3), pad_id=0)
    none = no_expert(torch.uint8)
    assert b.rollout_routing.shape == (3, 5, 2, 2) and b.rollout_routing.dtype == torch.uint8
    for i, t in enumerate(trajs):
        fed = len(t.routed_experts)
        assert torch.equal(b.rollout_routing[i, :fed], torch.from_numpy(t.routed_experts))
        assert bool((b.rollout_routing[i, fed:] == none).all())
    shard, _ = dp_shard(b, [[[2, 0], [1]]], 0)  # rows 2 and 0, trimmed to their longest (5)
    assert torch.equal(shard.rollout_routing, b.rollout_routing[[2, 0]])
    padded = shard.pad_to_multiple(4, pad_id=0)
    assert padded.rollout_routing.shape == (2, 8, 2, 2) and bool((padded.rollout_routing[:, 5:] == none).all())
    short = b.select(torch.tensor([2]))  # one 2-token trajectory: width 2
    assert short.rollout_routing.shape == (1, 2, 2, 2)
    wide = [_traj([5], [6])]
    wide[0].routed_experts = np.array([[[300, 1]]], dtype=np.uint16)  # > 254: int16 keeps room for the marker
    assert build_rl_batch(wide, torch.zeros(1), pad_id=0).rollout_routing.dtype == torch.int16
    mixed = [_traj([5], [6]), _traj([5], [7])]
    mixed[0].routed_experts = np.zeros((1, 2, 2), dtype=np.uint8)
    with pytest.raises(ValueError, match="trajectory 1 carries no engine routing while others do"):
        build_rl_batch(mixed, torch.zeros(2), pad_id=0)
    with pytest.raises(ValueError, match="routed experts cover 3 tokens of a 2-token sequence"):
        Trajectory([5], [6], [0.0], [1], "", "stop", routed_experts=np.zeros((3, 2, 2), dtype=np.uint8))
