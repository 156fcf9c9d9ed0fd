"""Engine routing (MoE, R3) stays on the replica leader that generated it until the ranks that train
its rows fetch them (megatron_alp.rollout.held_routing, batches.local_share): review finding R5, every
rank used to receive and densify every rank's routing."""

from __future__ import annotations

import gc
import json
import pickle

import numpy as np
import pytest
import torch

from helpers import QUICKSTART, torchrun
from megatron_alp.algorithms.dynamic_sampling import Groups
from megatron_alp.batches.local_share import local_share
from megatron_alp.config import ParallelConfig
from megatron_alp.data.trajectory import Trajectory
from megatron_alp.models.routing import no_expert
from megatron_alp.resolve import load_config
from megatron_alp.rollout.base import Completion
from megatron_alp.rollout.held_routing import STORE, HeldRouting, hold
from megatron_alp.runtime.parallel import init_distributed
from megatron_alp.training.rl_batch import build_rl_batch


def completion(tokens: int, seed: int) -> Completion:
    """A response of ``tokens`` after a 3-token prompt, routed like vLLM reports it (uint8, [fed, layers, k])."""
    routed = np.random.default_rng(seed).integers(0, 8, size=(3 + tokens - 1, 4, 2), dtype=np.uint8)
    return Completion([1, 2, 3], list(range(10, 10 + tokens)), [-0.5] * tokens, "stop", routed_experts=routed)


def test_a_held_array_lives_exactly_as_long_as_a_handle_to_it():
    before = len(STORE)
    groups = [[completion(5, 0), completion(7, 1)]]
    original = groups[0][1].routed_experts.copy()
    hold(groups, 0)
    held = groups[0][1].routed_experts
    assert isinstance(held, HeldRouting) and held.shape == original.shape and len(STORE) == before + 2
    copy = pickle.loads(pickle.dumps(held))  # as the gather delivers it back to its own holder
    cut = copy[:4]  # as a multi-turn episode cuts a turn's routing
    del groups, held, copy
    gc.collect()
    assert len(STORE) == before + 1  # the first completion's array went with its only handle
    assert len(cut) == 4 and np.array_equal(STORE.get(cut.key)[: len(cut)], original[:4])
    del cut
    gc.collect()
    assert len(STORE) == before


def test_held_routing_passes_the_trajectory_checks_and_refuses_what_it_cannot_do():
    groups = [[completion(6, 2)]]
    hold(groups, 0)
    t = Trajectory.from_completion(groups[0][0])  # check_routing: [tokens, layers, k] integers, no longer than the sequence
    assert t.routed_experts.shape == (8, 4, 2) and t.routed_experts[:100].shape == (8, 4, 2)
    with pytest.raises(TypeError, match=r"slices only as \[:n\]"):
        t.routed_experts[2:5]
    with pytest.raises(ValueError, match="trajectory 0: its engine routing is still held.*fetch_routing"):
        build_rl_batch([t], torch.zeros(1), pad_id=0)
    assert build_rl_batch([t], torch.zeros(1), pad_id=0, routing=False).rollout_routing is None


class Fetches:
    """The rollout side of :func:`local_share` on one rank: nothing is held, so a fetch finds the
    arrays in place; it records which trajectories were asked for."""

    def __init__(self):
        self.asked = []

    def fetch_routing(self, items):
        self.asked.append(list(items))


@pytest.mark.parametrize("probe", [False, True])
def test_the_local_share_carries_the_routing_of_its_rows_and_the_probes(probe):
    init_distributed(ParallelConfig(), seed=3)
    cfg = load_config(QUICKSTART, ["rollout.sampling.n=2", "trainer.prompts_per_iteration=4"])
    lengths = [300, 250, 40, 120, 90, 60, 200, 10]  # the layer probe takes the first 512 tokens: rows 0-1
    trajectories = [Trajectory.from_completion(completion(n, i)) for i, n in enumerate(lengths)]
    groups = Groups(prompts=[None] * 4, trajectories=trajectories, rewards=torch.tensor([1.0, 0.0] * 4),
                    correct=torch.tensor([True, False] * 4))
    rollout = Fetches()
    share = local_share(cfg, groups, rollout, pad_id=0, hidden_size=64, probe=probe)
    assert share.batch.rollout_routing is None  # the whole batch never holds the routing
    assert [id(t) for t in rollout.asked[0]] == [id(t) for t in trajectories]  # one rank: every row
    width = max(lengths) + 3
    for i, t in enumerate(trajectories):
        row = share.local.rollout_routing[i]
        assert row.shape == (width, 4, 2)
        assert torch.equal(row[: len(t.routed_experts)], torch.from_numpy(t.routed_experts.astype(np.int64)).to(row.dtype))
        assert (row[len(t.routed_experts):] == no_expert(row.dtype)).all()
    if probe:
        assert len(share.probe) == 2 and torch.equal(share.probe.tokens, share.batch.tokens[:2, :303])
        assert torch.equal(share.probe.rollout_routing, share.local.rollout_routing[:2, :303])
    else:
        assert share.probe is None


def test_each_rank_receives_only_the_routing_of_the_rows_it_trains(tmp_path):
    """2 gloo ranks, each a replica leader holding its responses' routing (48 layers x top-8, as on
    Qwen3-30B-A3B): the gather carries handles only; each rank fetches its share (rows of both
    leaders, one cut short) and gets the arrays bit for bit; the rows it did not ask for stay held;
    a row whose holder has no handle left is refused by name; the stores end empty."""
    torchrun("check_held_routing.py", str(tmp_path / "r.json"), timeout=300)
    for rank in range(2):
        r = json.loads((tmp_path / f"r.{rank}.json").read_text())
        assert r["held_here"] == 6 and r["store_after_gather"] == 6 and r["all_held"], r
        assert r["gathered_bytes"] * 20 < r["whole_bytes"], r  # handles, not arrays
        assert len(r["fetched_equal"]) == 6 and all(r["fetched_equal"].values()), r
        assert r["others_still_held"], r
        assert r["refused"] and f"is no longer held by rank {1 - rank}" in r["refused"], r
        assert r["store_at_end"] == 0, r
