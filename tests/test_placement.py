"""Which ranks start rollout replicas and on which devices (megatron_alp/rollout/placement.py)."""

import os

import pytest

from megatron_alp.config import ConfigError, RolloutConfig
from megatron_alp.rollout.placement import (
    ReplicaLayout,
    engine_placement,
    placement_env,
    placement_vars,
    replica_layout,
)


def cfg(**kw) -> RolloutConfig:
    return RolloutConfig(**kw)


def test_auto_is_one_replica_per_tp_group_on_gpus_and_per_data_parallel_rank_on_the_cpu():
    assert replica_layout(cfg(), world=8, data_parallel=8, gpu=True) == ReplicaLayout(8, 1)
    assert replica_layout(cfg(tensor_parallel_size=4), world=16, data_parallel=16, gpu=True) == ReplicaLayout(4, 4)
    assert replica_layout(cfg(), world=4, data_parallel=2, gpu=False) == ReplicaLayout(2, 2)  # TP2 x DP2
    assert replica_layout(cfg(), world=1, data_parallel=1, gpu=False) == ReplicaLayout(1, 1)
    assert replica_layout(cfg(replicas=1), world=8, data_parallel=8, gpu=True) == ReplicaLayout(1, 8)


def test_layouts_that_cannot_be_placed_name_the_keys():
    with pytest.raises(ConfigError, match=r"rollout.replicas=3 must divide the job's 8 ranks"):
        replica_layout(cfg(replicas=3), world=8, data_parallel=8, gpu=True)
    with pytest.raises(ConfigError, match=r"leaves 1 GPU\(s\) per replica, fewer than rollout.tensor_parallel_size=2"):
        replica_layout(cfg(replicas=8, tensor_parallel_size=2), world=8, data_parallel=8, gpu=True)
    with pytest.raises(ValueError, match="replicas must be `auto` or >= 1"):
        cfg(replicas=0)


def test_leaders_are_the_first_rank_of_each_block():
    layout = ReplicaLayout(replicas=4, stride=2)
    assert [layout.leader(k) for k in range(4)] == [0, 2, 4, 6]
    assert [layout.replica_of(r) for r in range(8)] == [0, None, 1, None, 2, None, 3, None]


def test_gpu_replicas_take_their_block_of_the_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    layout = ReplicaLayout(replicas=2, stride=2)
    c = cfg(tensor_parallel_size=2)
    p = engine_placement(c, layout, rank=10, local_rank=2, local_world=4, gpu=True)  # second node, 2nd block
    assert p.replica == 5 and p.gpus == (6, 7)
    assert engine_placement(c, layout, rank=11, local_rank=3, local_world=4, gpu=True) is None
    with pytest.raises(ConfigError, match="needs rollout.tensor_parallel_size=4 GPUs of its node, which has 4"):
        engine_placement(cfg(tensor_parallel_size=4), ReplicaLayout(2, 4), rank=4, local_rank=2, local_world=4,
                         gpu=True)


def test_cpu_replicas_sharing_a_machine_split_its_cores():
    cores = sorted(os.sched_getaffinity(0))
    layout = ReplicaLayout(replicas=2, stride=1)
    shares = [engine_placement(cfg(), layout, rank=r, local_rank=r, local_world=2, gpu=False) for r in range(2)]
    if len(cores) >= 2:
        half = len(cores) // 2
        assert [p.cores for p in shares] == [tuple(cores[:half]), tuple(cores[half:2 * half])]
    alone = engine_placement(cfg(), ReplicaLayout(1, 2), rank=0, local_rank=0, local_world=2, gpu=False)
    assert alone.cores is None  # one replica per machine: vLLM's defaults


def test_placement_env_is_set_while_starting_and_restored(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    p = engine_placement(cfg(tensor_parallel_size=2), ReplicaLayout(2, 2), rank=2, local_rank=2, local_world=4,
                         gpu=True)
    assert placement_vars(p) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    with placement_env(p):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    with placement_env(engine_placement(cfg(), ReplicaLayout(2, 1), rank=1, local_rank=1, local_world=2, gpu=False)):
        bound = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    if len(os.sched_getaffinity(0)) >= 2:
        assert bound is not None and bound.split(",")
