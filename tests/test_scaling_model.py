"""benchmarks/scaling_model.py: the step-time model's parts add up, its rollout term follows from the
published parameter count and the stated rates, replicas divide the rollout when nothing straggles,
and more GPUs never slow the replicas' rollout; with separate engines the asynchronous iteration
overlaps generation with training (max(rollout, logprob + update) + sync) and is never slower."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from megatron_alp.resolve import load_config

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("scaling_model", ROOT / "benchmarks" / "scaling_model.py")
sm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sm)

CFG = load_config(ROOT / "configs" / "qwen2.5-math-1.5b_token_alp.yaml")  # 512 x 8 samples, rollout TP1
SAMPLES, MAX_RESPONSE = 512 * 8, 2048
QWEN25_MATH_15B = 1_543_714_304  # published parameter count (tied embeddings; tests/test_plan.py)
# No stragglers (equal lengths), no HBM or per-step cost: decode is compute-bound, time per token fixed.
IDEAL = dataclasses.replace(sm.Rates(), response_cv=0.0, hbm_tbps=float("inf"), step_ms=0.0)


def test_parts_add_up_and_throughput_is_tokens_over_time():
    for gpus, engines in [(8, 1), (8, 8), (64, 64)]:
        p = sm.project(CFG, gpus, engines, sm.Rates())
        assert p["total"] == pytest.approx(sum(p[k] for k in ("rollout", "offload", "logprob", "update", "sync")))
        assert all(p[k] > 0 for k in sm.PARTS)
        assert p["tokens_per_s_per_gpu"] == pytest.approx(p["tokens"] / p["total"] / gpus)
    ideal = sm.project(CFG, 8, 8, IDEAL)
    assert ideal["tokens"] == SAMPLES * (IDEAL.prompt_tokens + MAX_RESPONSE // 2)


def test_one_engine_rollout_from_the_published_parameter_count():
    """One TP1 engine, compute-bound: every generated token costs 2 x parameters FLOPs (the final
    norm aside) at gen_mfu x peak; the GPU count does not matter."""
    expected = SAMPLES * (MAX_RESPONSE // 2) * 2 * QWEN25_MATH_15B / (IDEAL.gen_mfu * IDEAL.peak_tflops * 1e12)
    for gpus in (8, 64):
        assert sm.project(CFG, gpus, 1, IDEAL)["rollout"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("gpus", [8, 64, 256])
def test_replicas_divide_the_rollout_without_stragglers(gpus):
    one = sm.project(CFG, gpus, 1, IDEAL)
    many = sm.project(CFG, gpus, gpus, IDEAL)
    assert many["rollout"] == pytest.approx(one["rollout"] / gpus, rel=1e-9)
    for part in ("offload", "logprob", "update", "sync"):  # only generation depends on the engines
        assert many[part] == one[part]


def test_stragglers_only_slow_the_replicas_down():
    """Drawn lengths: the slowest replica carries at least the mean share, so R replicas take more
    than 1/R of one engine's time, and the excess grows as each replica gets fewer samples."""
    spread = dataclasses.replace(IDEAL, response_cv=0.6)
    one = sm.project(CFG, 8, 1, spread)["rollout"]
    excess = {r: sm.project(CFG, r, r, spread)["rollout"] / (one / r) for r in (8, 64)}
    assert 1.001 < excess[8] < excess[64]


def test_more_gpus_never_slow_the_replicas_rollout():
    times = [sm.project(CFG, g, g, sm.Rates())["rollout"] for g in (8, 16, 32, 64, 128, 256)]
    assert all(b <= a for a, b in zip(times, times[1:])), times
    # ...but they stop helping: past the point where each replica has few samples, the longest
    # response, decoded alone, bounds the step.
    assert times[-1] > times[0] / 32
    train = [sm.project(CFG, g, g, sm.Rates())["logprob"] for g in (8, 64)]
    assert train[1] == pytest.approx(train[0] / 8)  # the logprob passes' FLOPs spread over the GPUs


def test_asynchronous_iteration_overlaps_generation_with_training():
    """Separate engines: synchronous = rollout + logprob + update + sync; with max_staleness 1 the
    rollout runs beside the logprob passes and the update, and the sync waits for both."""
    parts = {"rollout": 10.0, "offload": 0.0, "logprob": 3.0, "update": 4.0, "sync": 1.5}
    assert sm.iteration_seconds(parts, asynchronous=False) == 10 + 3 + 4 + 1.5
    assert sm.iteration_seconds(parts, asynchronous=True) == 10 + 1.5  # generation is the longer side
    training_bound = {**parts, "rollout": 2.0}
    assert sm.iteration_seconds(training_bound, asynchronous=True) == 3 + 4 + 1.5
    for idle in ({**parts, "rollout": 0.0}, {**parts, "logprob": 0.0, "update": 0.0}):  # nothing to overlap
        assert sm.iteration_seconds(idle, asynchronous=True) == sm.iteration_seconds(idle, asynchronous=False)
    # overlap never costs time, and saves at most the shorter side
    for rollout, train in [(1.0, 9.0), (5.0, 5.0), (9.0, 1.0)]:
        p = {**parts, "rollout": rollout, "logprob": 0.0, "update": train}
        saved = sm.iteration_seconds(p, False) - sm.iteration_seconds(p, True)
        assert saved == pytest.approx(min(rollout, train))


def test_separate_projection_from_the_published_parameter_count():
    """One 8-GPU node, half for the engines: 4 trainer ranks, 4 TP1 engines. Compute-bound decoding
    spreads the generated tokens' FLOPs over the 4 engines; training runs on 4 GPUs, twice the
    colocated time on 8; nothing is offloaded; the sync adds an NCCL broadcast of the bf16 model."""
    p = sm.project_separate(CFG, 8, IDEAL)
    assert (p["trainer_gpus"], p["engine_gpus"], p["engines"], p["offload"]) == (4, 4, 4, 0.0)
    flops = SAMPLES * (MAX_RESPONSE // 2) * 2 * QWEN25_MATH_15B
    assert p["rollout"] == pytest.approx(flops / (IDEAL.gen_mfu * IDEAL.peak_tflops * 1e12) / 4, rel=1e-5)
    colocated = sm.project(CFG, 8, 8, IDEAL)
    assert p["logprob"] == pytest.approx(2 * colocated["logprob"])
    model_bytes = QWEN25_MATH_15B * 2
    assert p["sync"] == pytest.approx(model_bytes / (IDEAL.sync_gbps * 1e9) + model_bytes / (IDEAL.broadcast_gbps * 1e9))
    assert p["total_sync"] == pytest.approx(p["rollout"] + p["logprob"] + p["update"] + p["sync"])
    assert p["total_async"] == pytest.approx(max(p["rollout"], p["logprob"] + p["update"]) + p["sync"])
    assert p["total_async"] < p["total_sync"]
    assert p["tokens_per_s_per_gpu_async"] == pytest.approx(p["tokens"] / p["total_async"] / 8)  # every GPU counts
    assert p["fits"]
    # the shipped asynchronous config is that layout: same projection
    shipped = sm.project_separate(load_config(ROOT / "configs" / "qwen2.5-math-1.5b_token_alp_async.yaml"), 8, IDEAL)
    assert shipped["total_async"] == pytest.approx(p["total_async"])


@pytest.mark.parametrize("gpus", [8, 64, 256])
def test_asynchronous_never_slower_than_synchronous_separate(gpus):
    p = sm.project_separate(CFG, gpus, sm.Rates())
    assert p["total_async"] <= p["total_sync"]
    assert p["total_sync"] - p["total_async"] == pytest.approx(min(p["rollout"], p["logprob"] + p["update"]))


def test_separate_layout_that_cannot_run_is_refused():
    """Qwen3-30B-A3B's EP8 needs 8 trainer ranks: 4 of one node's 8 GPUs cannot hold it."""
    moe = load_config(ROOT / "configs" / "qwen3-30b-a3b_seq_alp.yaml")
    with pytest.raises(sm.ConfigError, match="expert_model_parallel_size"):
        sm.project_separate(moe, 8, sm.Rates())
    assert sm.project_separate(moe, 64, sm.Rates())["trainer_gpus"] == 32
