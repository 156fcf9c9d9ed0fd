"""Rollout replicas (megatron_alp/rollout/distributed.py) on a 2-rank gloo job with real vLLM engines."""

import pytest
import torch
from helpers import read_results, torchrun

from megatron_alp.models.tiny import make_tiny_model


@pytest.mark.slow  # a kill/crash soak (minutes on 2 cores): pytest -m slow
def test_two_replicas_sample_like_one_follow_syncs_survive_a_killed_engine_and_retire_a_dead_one(tmp_path):
    """DP=2 with one vLLM engine subprocess per rank: per-sample seeds give the trajectories of a
    single engine; after a training-side change and an in-memory sync in 1 MB buckets, both
    replicas' logprobs equal Megatron's (fp32); a replica whose engine is SIGKILLed mid-generate
    is restarted, resynced and its groups re-sent, and the call returns every group unchanged.
    Killed on two attempts in a row, a replica is retired with one warning: the survivor generates
    its groups (the same ones), then syncs and generates alone; the last one failing twice is an error."""
    a = make_tiny_model("qwen3", tmp_path / "a", seed=3)
    b = make_tiny_model("qwen3", tmp_path / "b", seed=4)
    out = torchrun("check_rollout_replicas.py", str(a), str(b), str(tmp_path / "r.json"), timeout=900)
    r = read_results(tmp_path / "r.json")
    assert all(r["shares"]) and sorted(sum(r["shares"], [])) == list(range(10))
    assert r["rollout_stats"]["rollout/replicas"] == 2 and r["rollout_stats"]["rollout/replicas_live"] == 2
    assert r["sync"]["sync/verify_mean_abs_diff"] < 1e-3 and r["sync"]["sync/bytes"] > 3e6
    assert r["synced_max_diff"] < 1e-4
    assert r["restarts"] == [0, 1]
    warnings = [line for line in out.splitlines() if "failed twice in a row and is retired" in line]
    assert len(warnings) == 1 and "rollout replica 1 (rank 1)" in warnings[0], warnings
    assert r["retired_same"] and r["replicas_live"] == 1
    assert r["survivor_sync"]["sync/verify_mean_abs_diff"] < 1e-3 and r["survivor_same"]
    assert r["last_error"].startswith("rollout replica 0 (rank 0) failed twice in a row and no other replica"), r
    assert "injected engine failure" in r["last_error"], r


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 NVIDIA GPUs (one vLLM replica on each)")
def test_two_gpu_replicas_sample_like_one_and_follow_cuda_ipc_syncs(tmp_path):
    """The CPU check above on 2 GPUs: a replica per GPU, CUDA IPC sync, a killed replica resynced."""
    a = make_tiny_model("qwen3", tmp_path / "a", seed=3)
    b = make_tiny_model("qwen3", tmp_path / "b", seed=4)
    torchrun("check_rollout_replicas.py", str(a), str(b), str(tmp_path / "r.json"))
    r = read_results(tmp_path / "r.json")
    assert r["synced_max_diff"] < 1e-4 and r["restarts"] == [0, 1]
