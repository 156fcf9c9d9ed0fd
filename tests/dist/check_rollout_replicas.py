"""Rollout replicas on a 2-rank DP=2 job: one real vLLM engine subprocess per rank.

Usage: torchrun --nproc_per_node 2 check_rollout_replicas.py MODEL_DIR NEW_DIR RESULT.json

1. One replica (rank 0) and two replicas (one per rank) sample the same prompts with per-sample
   seeds: the trajectories must be identical.
2. A training-side weight change (NEW_DIR loaded into Megatron), an in-memory sync (shared-memory
   buckets of 1 MB, so several partial reloads) with verification on every replica: each
   replica's logprobs equal Megatron's (fp32).
3. Replica 1's engine process is SIGKILLed in the middle of a generate call: the call still
   returns every group, the restarted engine is resynced from the trainer, and the result equals
   an undisturbed call's.
"""

import faulthandler
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from common import reinit
from megatron_alp.config import ModelConfig, RolloutConfig, SamplingConfig
from megatron_alp.training.builder import build_gpt_model
from megatron_alp.models.families import hf_to_megatron, load_hf_config
from megatron_alp.models.hf_weights import load_hf_weights
from megatron_alp.training.micro_batch import Batching
from megatron_alp.training.policy_update import compute_logprobs, probe_mismatch
from megatron_alp.training.rl_batch import build_rl_batch
from megatron_alp.data.trajectory import Trajectory
from megatron_alp.rollout import DistributedRollout, SamplingParams
from megatron_alp.algorithms.mismatch import mismatch_stats

FP32_TOL = 1e-4
# Prompts of different lengths, so the balanced split is not just halves.
PROMPTS = [[1 + (7 * i + k) % 200 for k in range(4 + 3 * (i % 5))] for i in range(10)]
PARAMS = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=1234)


def cfg(replicas) -> RolloutConfig:
    # 1 MB buckets: the 3.4 MB model goes over in several reloads, each of whole layers.
    return RolloutConfig(dtype="float32", max_model_len=128, replicas=replicas, request_timeout_s=300.0,
                         max_retries=2, verify_sync=True, sync_bucket_mb=1,
                         sampling=SamplingConfig(max_prompt_length=32, max_response_length=32))


def flat(groups):
    return [(c.response_ids, c.logprobs) for g in groups for c in g]


def same_tokens(a, b) -> bool:
    return [r for r, _ in a] == [r for r, _ in b] and all(
        max((abs(x - y) for x, y in zip(la, lb)), default=0.0) < 1e-5 for (_, la), (_, lb) in zip(a, b))


def megatron_diff(model, groups) -> float:
    trajectories = [Trajectory.from_completion(c) for g in groups for c in g]
    batch = build_rl_batch(trajectories, torch.zeros(len(trajectories)), pad_id=0)
    lp = compute_logprobs(model, batch, batching=Batching(size=len(trajectories)), temperature=1.0, pad_id=0)
    keep = batch.loss_mask > 0
    return mismatch_stats(batch.rollout_logprobs[keep], lp[keep])["max"]


def kill_engine_at_step(rollout, step: int) -> None:
    """SIGKILL this rank's engine-core process when its ``step``-th engine step runs."""
    core = rollout.engine._llm.llm_engine
    original, calls = core.step, [0]

    def step_then_die():
        calls[0] += 1
        if calls[0] == step:
            for pid in rollout.engine.engine_pids():
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        return original()

    core.step = step_then_die


def main():
    faulthandler.dump_traceback_later(480, exit=True)  # a hang shows where each rank waits
    model_dir, new_dir, result_path = sys.argv[1:4]
    par = reinit(1, 1)  # DP=2
    rank = dist.get_rank()
    results = {}

    one = DistributedRollout(cfg(1), model_dir, seed=0, scorer=probe_mismatch)
    assert one.replicas == 1 and (one.engine is not None) == (rank == 0)
    reference = one.generate(PROMPTS, PARAMS)
    one.shutdown()

    two = DistributedRollout(cfg("auto"), model_dir, seed=0, scorer=probe_mismatch)
    assert two.replicas == 2 and two.engine is not None, "auto on the CPU: one replica per data-parallel rank"
    pids = [None] * 2
    dist.all_gather_object(pids, two.engine.engine_pids())
    assert pids[0] and pids[1] and set(pids[0]).isdisjoint(pids[1]), pids
    shares = two.split(PROMPTS, PARAMS)
    assert sorted(i for s in shares for i in s) == list(range(len(PROMPTS))) and all(shares), shares
    groups = two.generate(PROMPTS, PARAMS)
    assert same_tokens(flat(groups), flat(reference)), "2 replicas sampled other trajectories than 1"
    stats = two.take_stats()
    assert stats["rollout/replicas"] == 2 and stats["rollout/straggler_ratio"] >= 1.0, stats
    results["shares"] = shares
    results["rollout_stats"] = stats

    args = hf_to_megatron(load_hf_config(model_dir))
    model = build_gpt_model(args, ModelConfig(hf_path=model_dir, dtype="float32", layer_spec="local"), par)
    load_hf_weights(model, new_dir)  # the training-side weight change
    sync = two.sync_weights(model)  # verify_sync: every replica's probe is scored
    assert two.engine.last_sync["path"] == "memory", two.engine.last_sync
    results["sync"] = sync
    synced = two.generate(PROMPTS, PARAMS)
    results["synced_max_diff"] = megatron_diff(model, synced)
    assert results["synced_max_diff"] < FP32_TOL, results["synced_max_diff"]
    assert not same_tokens(flat(synced), flat(reference)), "the new weights should sample differently"

    if rank == 1:
        kill_engine_at_step(two, step=3)
    survived = two.generate(PROMPTS, PARAMS)
    restarts = [None] * 2
    dist.all_gather_object(restarts, two.engine.restarts)
    assert restarts == [0, 1], restarts
    assert same_tokens(flat(survived), flat(synced)), "the killed replica's groups differ after the resync"
    results["restarts"] = restarts
    two.shutdown()
    if rank == 0:
        json.dump(results, open(result_path, "w"), indent=1)
    print("OK replicas", json.dumps(results), flush=True)


if __name__ == "__main__":  # the engine's subprocess re-imports this module
    main()
