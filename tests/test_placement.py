"""Which ranks start rollout replicas and on which devices (megatron_alp/rollout/placement.py)."""

import os
import re

import pytest

from megatron_alp.config import ConfigError, RolloutConfig
from megatron_alp.rollout.placement import (
    ReplicaLayout,
    engine_core_pool,
    engine_placement,
    placement_env,
    placement_vars,
    replica_layout,
    trainer_cores,
)
from megatron_alp.rollout.vllm.engine import VLLMEngine


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


def test_separate_gpu_replicas_use_the_nodes_rollout_gpus_led_by_the_nodes_trainer_ranks(monkeypatch):
    """8-GPU nodes, 4 trainer ranks each (GPUs 0-3), engines on GPUs 4-7 of every node."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    one = cfg(placement="separate", gpus=[4, 5, 6, 7])
    layout = replica_layout(one, world=8, data_parallel=8, gpu=True, local_world=4)
    assert layout == ReplicaLayout(replicas=8, stride=1)  # 4 per node, 2 nodes
    p = engine_placement(one, layout, rank=5, local_rank=1, local_world=4, gpu=True)  # node 1, its 2nd replica
    assert (p.replica, p.gpus) == (5, (5,))
    two = cfg(placement="separate", gpus=[4, 5, 6, 7], tensor_parallel_size=2)
    layout = replica_layout(two, world=8, data_parallel=8, gpu=True, local_world=4)
    assert layout == ReplicaLayout(replicas=4, stride=2)
    assert engine_placement(two, layout, rank=6, local_rank=2, local_world=4, gpu=True).gpus == (6, 7)
    assert engine_placement(two, layout, rank=7, local_rank=3, local_world=4, gpu=True) is None


def test_separate_gpu_layouts_that_cannot_be_placed_name_the_keys(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    with pytest.raises(ConfigError, match="needs rollout.gpus"):
        replica_layout(cfg(placement="separate"), world=4, data_parallel=4, gpu=True, local_world=4)
    with pytest.raises(ConfigError, match="must divide the node's 4 trainer ranks"):
        replica_layout(cfg(placement="separate", gpus=[4, 5, 6]), world=4, data_parallel=4, gpu=True, local_world=4)
    with pytest.raises(ConfigError, match="rollout.replicas=2, but rollout.gpus"):
        replica_layout(cfg(placement="separate", gpus=[4, 5, 6, 7], replicas=2), world=4, data_parallel=4, gpu=True,
                       local_world=4)
    clash = cfg(placement="separate", gpus=[2, 3])  # GPUs 0-3 belong to the 4 trainer ranks
    layout = replica_layout(clash, world=4, data_parallel=4, gpu=True, local_world=4)
    with pytest.raises(ConfigError, match=r"GPU\(s\) \[2\] of rollout replica 0 are not free"):
        engine_placement(clash, layout, rank=0, local_rank=0, local_world=4, gpu=True)
    with pytest.raises(ValueError, match="gpus lists the engines' own GPUs and needs placement: separate"):
        cfg(gpus=[4])
    with pytest.raises(ValueError, match="a multiple of tensor_parallel_size=2"):
        cfg(placement="separate", gpus=[4, 5, 6], tensor_parallel_size=2)


def test_separate_cpu_placement_splits_the_cores_between_engine_and_trainer(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    sep = cfg(placement="separate")
    assert engine_core_pool(sep) == [2, 3] and trainer_cores(sep) == [0, 1]
    layout = replica_layout(sep, world=2, data_parallel=2, gpu=False, local_world=2)
    assert layout == ReplicaLayout(replicas=1, stride=2)  # one replica per machine
    assert engine_placement(sep, layout, rank=0, local_rank=0, local_world=2, gpu=False).cores == (2, 3)
    pinned = cfg(placement="separate", cpu_cores=[3])
    assert engine_core_pool(pinned) == [3] and trainer_cores(pinned) == [0, 1, 2]
    assert trainer_cores(cfg()) is None and engine_core_pool(cfg()) is None  # colocated: shared, unpinned
    colocated_pinned = cfg(cpu_cores=[1])  # the engine on core 1, still taking turns with the trainer
    assert engine_placement(colocated_pinned, ReplicaLayout(1, 1), rank=0, local_rank=0, local_world=1,
                            gpu=False).cores == (1,)
    with pytest.raises(ConfigError, match="fewer cores than the 2 engine replicas"):
        engine_placement(cfg(placement="separate", cpu_cores=[3], replicas=2), ReplicaLayout(2, 1), rank=1,
                         local_rank=1, local_world=2, gpu=False)


def test_an_engine_started_on_its_cores_inherits_them_and_this_process_keeps_its_own():
    cores = sorted(os.sched_getaffinity(0))
    p = engine_placement(cfg(cpu_cores=[cores[-1]]), ReplicaLayout(1, 1), rank=0, local_rank=0, local_world=1,
                         gpu=False)
    with placement_env(p):
        assert os.sched_getaffinity(0) == {cores[-1]}
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == str(cores[-1])
    assert sorted(os.sched_getaffinity(0)) == cores


def test_async_settings_that_cannot_work_are_refused_naming_the_keys():
    from megatron_alp.resolve import load_config

    quick = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart_cpu.yaml")
    cases = {
        ("trainer.max_staleness=1",): "trainer.max_staleness=1 generates while the trainer trains, which needs "
                                      "rollout.placement: separate",
        ("rollout.placement=separate", "rollout.engine_process=in_process"): "engine_process: in_process cannot",
        ("rollout.cpu_cores=[1]", "rollout.engine_process=in_process"): "cpu_cores runs the engine in a process",
        ("rollout.placement=separate", "rollout.partial_rollout=true"): "rollout.partial_rollout continues "
                                                                        "generations across weight updates",
        ("rollout.placement=separate", "trainer.max_staleness=2", "rollout.partial_rollout=true",
         "rollout.partial_cut_tokens=64", "rollout.sampling.max_response_length=64"):
            "rollout.partial_cut_tokens=64 must be below rollout.sampling.max_response_length=64",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(quick, list(overrides))
    for schedule in ("deterministic", "free"):
        load_config(quick, ["rollout.placement=separate", "trainer.max_staleness=2", f"trainer.async_schedule={schedule}",
                            "rollout.partial_rollout=true"])


def test_sync_methods_that_cannot_reach_gpu_engines_are_refused_naming_both_keys():
    """On GPUs a colocated engine's first worker shares the trainer rank's GPU (NCCL refuses two ranks
    of one group there), and engines on GPUs of their own cannot open CUDA IPC handles of the trainer's
    GPU. On the CPU both work (gloo, shared memory)."""
    colocated_broadcast = cfg(sync_method="broadcast")
    with pytest.raises(ConfigError, match="rollout.sync_method: broadcast with rollout.placement: colocated"):
        replica_layout(colocated_broadcast, world=8, data_parallel=8, gpu=True)
    assert replica_layout(colocated_broadcast, world=2, data_parallel=2, gpu=False) == ReplicaLayout(2, 1)
    gpu_memory = cfg(placement="separate", gpus=[4, 5, 6, 7], sync_method="memory")
    with pytest.raises(ConfigError, match="rollout.sync_method: memory with rollout.placement: separate"):
        replica_layout(gpu_memory, world=4, data_parallel=4, gpu=True, local_world=4)
    with pytest.raises(ConfigError, match="rollout.sync_method: memory with rollout.placement: separate"):
        VLLMEngine.check_config(gpu_memory)  # config validation, wherever it runs: rollout.gpus says GPUs
    cpu_memory = cfg(placement="separate", sync_method="memory")
    VLLMEngine.check_config(cpu_memory)
    VLLMEngine.check_config(colocated_broadcast)
    assert replica_layout(cpu_memory, world=2, data_parallel=2, gpu=False).replicas == 1
    for ok in (cfg(placement="separate", gpus=[4, 5, 6, 7], sync_method="broadcast"), cfg(sync_method="memory")):
        replica_layout(ok, world=4, data_parallel=4, gpu=True, local_world=4)
