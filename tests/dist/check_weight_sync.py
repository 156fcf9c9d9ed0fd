"""The rollout engine against the Megatron trainer: logprobs of the same tokens, weight sync, verify.

Usage:
  python check_weight_sync.py mismatch DIR
      a float32 engine vs the fp32 Megatron model on the engine's own samples (prints the mismatch
      statistics); then a training-side weight change, a verified in-memory sync, an engine broken
      by a bad update and recovered by a resync. (bf16 and FP8 engines against Megatron:
      tests/test_mismatch.py, through `megatron-alp mismatch`.)
  python check_weight_sync.py delta DIR
      a bf16 engine in process fed by delta syncs (rollout.sync_delta) of a float32 trainer whose weights
      change in a few percent of their elements: after each, the engine's parameters equal what a full
      sync then gives them, bit for bit; also when the engine restarted, in a fresh process (a resume:
      a new source), and when a leader's copy drifted (its checksum forces a full sync in the same call).
  torchrun --nproc_per_node 2 check_weight_sync.py sync DIR [METHOD]
      one engine (subprocess on rank 0; DP=1, so one replica) fed by TP=2 and then PP=2 trainers:
      weight change, sync by METHOD (rollout.sync_method, default memory: shared-memory buckets;
      broadcast: a gloo group of rank 0 and the engine's worker beside the trainer's default group),
      engine logprobs equal Megatron's on every rank; a sync that was skipped fails verification.
Each mode makes two tiny models of one family in DIR (a: seed 3, b: seed 4; qwen2 for mismatch,
qwen3 for sync): loading b is the "training-side weight change". Results go to DIR/r.json.
"""

import json
import sys

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
from megatron_alp.rollout import DistributedRollout, RolloutError, SamplingParams
from megatron_alp.sync import DeltaWeights, FullWeights, WeightSync
from megatron_alp.rollout.quantization import cpu_has_fp8_kv_kernels
from megatron_alp.algorithms.mismatch import format_mismatch, mismatch_stats
from megatron_alp.models.tiny import make_tiny_model

FP32_TOL = 1e-4  # float32 engine vs float32 Megatron, same tokens: different kernels and reduction orders
PROMPTS = [[1, 3 + 17 * i, 40 + 5 * i, 200 + i, 9, 11 + i] for i in range(8)]


def build(hf_dir, par):
    args = hf_to_megatron(load_hf_config(hf_dir))
    model = build_gpt_model(args, ModelConfig(hf_path=str(hf_dir), dtype="float32", layer_spec="local"), par)
    load_hf_weights(model, hf_dir)
    return model


def engine_cfg(**kw) -> RolloutConfig:
    base = dict(dtype="float32", max_model_len=256, request_timeout_s=300.0, max_retries=2,
                sampling=SamplingConfig(max_prompt_length=64, max_response_length=64))
    return RolloutConfig(**{**base, **kw})


def trainer_vs_engine(rollout, model, n=8, max_tokens=32):
    """Sample with the engine; returns (engine logprobs, Megatron logprobs) of the sampled tokens
    (on the last pipeline stage; None elsewhere) and the completions."""
    from megatron.core import parallel_state as ps

    groups = rollout.generate(PROMPTS, SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens))
    assert len(groups) == len(PROMPTS) and all(len(g) == n for g in groups)
    trajectories = [Trajectory.from_completion(c) for g in groups for c in g]
    batch = build_rl_batch(trajectories, torch.zeros(len(trajectories)), pad_id=0)
    megatron = compute_logprobs(model, batch, batching=Batching(size=16), temperature=1.0, pad_id=0)
    if not ps.is_pipeline_last_stage():
        return None, None, groups
    keep = batch.loss_mask > 0
    return batch.rollout_logprobs[keep], megatron[keep], groups


def same_on_all_ranks(groups) -> None:
    if dist.get_world_size() == 1:
        return
    mine = [[(c.response_ids, c.logprobs) for c in g] for g in groups]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    assert all(x == everyone[0] for x in everyone), "ranks received different rollouts"


def models(folder, family):
    """The engine's model and the "training-side weight change" (another model of the family)."""
    return (str(make_tiny_model(family, f"{folder}/a", seed=3)), str(make_tiny_model(family, f"{folder}/b", seed=4)))


def mismatch(folder, results):
    model_dir, new_dir = models(folder, "qwen2")
    par = reinit(1, 1)
    model = build(model_dir, par)
    fp32 = DistributedRollout(engine_cfg(), str(model_dir), seed=0)
    fp32_sync = WeightSync(fp32, FullWeights(fp32.cfg.sync_bucket_mb << 20), scorer=probe_mismatch)
    engine_lp, megatron_lp, _ = trainer_vs_engine(fp32, model, n=4, max_tokens=16)
    stats = {"float32": mismatch_stats(engine_lp, megatron_lp)}
    print(format_mismatch("engine float32 vs Megatron fp32", stats["float32"]), flush=True)
    results["mismatch"] = stats
    assert fp32.max_model_len == fp32.engine.max_model_len == 256
    assert stats["float32"]["max"] < FP32_TOL, stats["float32"]

    # Training-side weight change: Megatron now holds NEW_DIR; the engine still samples the old model.
    load_hf_weights(model, new_dir)
    engine_lp, megatron_lp, _ = trainer_vs_engine(fp32, model, n=2, max_tokens=16)
    results["stale_max"] = mismatch_stats(engine_lp, megatron_lp)["max"]
    assert results["stale_max"] > 1e-2
    fp32.cfg = fp32.cfg.model_copy(update={"verify_sync": True})
    sync = fp32_sync.sync(model)
    results["sync"] = sync
    assert sync["sync/verify_mean_abs_diff"] < 1e-3 and sync["sync/bytes"] > 0
    engine_lp, megatron_lp, _ = trainer_vs_engine(fp32, model, n=2, max_tokens=16)
    results["synced_max"] = mismatch_stats(engine_lp, megatron_lp)["max"]
    assert results["synced_max"] < FP32_TOL

    # A failed update breaks the in-process engine; the next rollout restarts it (back on MODEL_DIR
    # weights), resyncs from the trainer and completes on the trainer's weights.
    try:
        fp32.engine.update_weights([("model.embed_tokens.weight", torch.zeros(3, 3))])
        raise AssertionError("a wrongly shaped weight was accepted")
    except RolloutError as err:
        assert "vLLM rejected the weight update" in str(err)
    engine_lp, megatron_lp, _ = trainer_vs_engine(fp32, model, n=2, max_tokens=16)
    results["after_restart_max"] = mismatch_stats(engine_lp, megatron_lp)["max"]
    results["restarts"] = fp32.engine.restarts
    assert fp32.engine.restarts == 1 and results["after_restart_max"] < FP32_TOL
    fp32.shutdown()


def engine_params(rollout) -> dict:
    """The in-process engine's parameters (vLLM's names and layouts, fused where vLLM fuses), copied."""
    model = rollout.engine.process.in_process_worker().model_runner.get_model()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def nudge(model, step: int, frac: float = 0.02) -> float:
    """Scale ``frac`` of every weight's elements by 1.05 (a change bf16 shows); returns the fraction of
    the exported elements whose bf16 value changed, counted here on the model's own parameters."""
    g = torch.Generator().manual_seed(100 + step)
    changed = total = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "log_sigma" in name or (name == "output_layer.weight" and model.share_embeddings_and_output_weights):
                continue
            before = p.detach().to(torch.bfloat16)
            mask = torch.rand(p.shape, generator=g) < frac
            p[mask] *= 1.05
            changed += int((p.detach().to(torch.bfloat16) != before).sum())
            total += p.numel()
    return changed / total


def delta(folder, results):
    model_dir, _ = models(folder, "qwen2")
    par = reinit(1, 1)
    model = build(model_dir, par)
    cfg = engine_cfg(dtype="bfloat16", sync_delta=True)
    rollout = DistributedRollout(cfg, str(model_dir), seed=0)
    source = DeltaWeights(cfg.sync_bucket_mb << 20, anchor_every=100, dtype=torch.bfloat16)
    weights = WeightSync(rollout, source)
    full_bytes = weights.sync(model)["sync/delta_bytes"]  # the first sync is an anchor: the whole model

    def synced_like_a_full_sync(label):
        held = engine_params(rollout)
        source.reset()
        assert weights.sync(model)["sync/anchor"] == 1.0
        full = engine_params(rollout)
        assert held.keys() == full.keys()
        differ = [n for n in full if not torch.equal(held[n], full[n])]
        assert not differ, f"{label}: the engine's weights differ from a full sync's in {differ}"

    fracs = []
    for step in range(3):
        expected = nudge(model, step)
        stats = weights.sync(model)
        assert stats["sync/anchor"] == 0.0, stats
        assert abs(stats["sync/changed_frac"] - expected) < 1e-12, (stats["sync/changed_frac"], expected)
        assert stats["sync/delta_bytes"] < full_bytes / 4, (stats["sync/delta_bytes"], full_bytes)
        fracs.append((expected, stats["sync/delta_bytes"]))
    synced_like_a_full_sync("after 3 delta syncs")
    results["delta"] = {"full_bytes": full_bytes, "changed_frac_and_bytes": fracs}

    rollout.engine.process.broken = True  # the next update restarts the engine from its model folder
    nudge(model, 10)
    stats = weights.sync(model)
    assert stats["sync/anchor"] == 1.0 and rollout.engine.restarts == 1, stats
    nudge(model, 11)
    assert weights.sync(model)["sync/anchor"] == 0.0
    synced_like_a_full_sync("after an engine restart")

    resumed = DeltaWeights(cfg.sync_bucket_mb << 20, anchor_every=100, dtype=torch.bfloat16)
    weights = WeightSync(rollout, resumed)  # a fresh process: nothing to build on
    source = resumed
    nudge(model, 12)
    assert weights.sync(model)["sync/anchor"] == 1.0
    nudge(model, 13)
    assert weights.sync(model)["sync/anchor"] == 0.0
    synced_like_a_full_sync("in a fresh process")

    name = next(iter(source.export.mirror))
    source.export.mirror[name].view(-1)[0] += 1  # the leader's copy drifts
    nudge(model, 14)
    stats = weights.sync(model)
    assert stats["sync/anchor"] == 1.0, stats  # the checksum caught it and a full sync followed
    synced_like_a_full_sync("after a drifted copy")
    rollout.shutdown()


def sync(folder, results, method="memory"):
    from megatron.core import parallel_state as ps

    reinit(2, 1)
    if dist.get_rank() == 0:
        models(folder, "qwen3")
    dist.barrier()
    model_dir, new_dir = f"{folder}/a", f"{folder}/b"
    rollout = DistributedRollout(engine_cfg(verify_sync=True, sync_method=method), str(model_dir), seed=0)
    weights = WeightSync(rollout, FullWeights(rollout.cfg.sync_bucket_mb << 20), scorer=probe_mismatch)
    if dist.get_rank() == 0:
        assert rollout.engine.engine_pids(), "under torchrun the engine runs in a subprocess"
    for tp, pp in ((2, 1), (1, 2)):
        layout = f"tp{tp}_pp{pp}"
        par = reinit(tp, pp)
        model = build(model_dir, par)
        stats = weights.sync(model)  # the engine may hold another layout's weights: start equal
        engine_lp, megatron_lp, groups = trainer_vs_engine(rollout, model, n=4, max_tokens=16)
        same_on_all_ranks(groups)
        load_hf_weights(model, new_dir)  # training-side weight change
        try:
            weights.verify(model)
            raise AssertionError(f"{layout}: verification passed without a sync")
        except RolloutError as err:
            assert "weight sync verification failed" in str(err), err
        stats = weights.sync(model)
        if rollout.engine is not None:
            assert rollout.engine.last_sync["path"] == method, rollout.engine.last_sync
        dist.barrier()  # the trainer's default group still works beside the broadcast group
        engine_lp, megatron_lp, groups = trainer_vs_engine(rollout, model, n=4, max_tokens=16)
        same_on_all_ranks(groups)
        if ps.is_pipeline_last_stage():
            diff = mismatch_stats(engine_lp, megatron_lp)["max"]
            assert diff < FP32_TOL, f"{layout}: engine vs Megatron after sync: max |diff| {diff}"
            results[layout] = {"max_diff": diff, **stats}
        load_hf_weights(model, model_dir)
    rollout.shutdown()
    merged = [None] * dist.get_world_size()
    dist.all_gather_object(merged, results)
    results.update({k: v for r in merged for k, v in r.items()})


def main():
    mode, folder, *method = sys.argv[1:]
    results = {}
    {"mismatch": mismatch, "sync": sync, "delta": delta}[mode](folder, results, *method)
    if dist.get_rank() == 0:
        json.dump(results, open(f"{folder}/r.json", "w"), indent=1)
    print("OK", mode, json.dumps(results), flush=True)


if __name__ == "__main__":  # the engine's subprocess re-imports this module
    main()
