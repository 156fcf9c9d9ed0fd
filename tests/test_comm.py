"""Every collective's tensors sit on a device its group's backend takes on a GPU job (NCCL:
accelerator tensors, gloo: CPU tensors), checked without a GPU: under
MEGATRON_ALP_CHECK_COLLECTIVE_DEVICES=1 the CPU shims track which tensors a GPU job holds on its
GPU and every tensor collective refuses a wrong one (megatron_alp.runtime.comm). The checker must catch
both kinds of mistake, and the trainer must run under it with data, pipeline and expert
parallelism (torchrun, 2 gloo ranks)."""

from __future__ import annotations

import math

import pytest
from helpers import ROOT, dist_job, metrics, read_results, train

CHECK = {"MEGATRON_ALP_CHECK_COLLECTIVE_DEVICES": "1"}
COMM = dist_job("comm", "check_comm.py", "{dir}/result.json", env=CHECK)


@pytest.fixture(scope="module")
def checks(dist_jobs) -> dict:
    return read_results(dist_jobs.run("comm") / "result.json")


@COMM
@pytest.mark.parametrize("case, collective, backend, held_on, shape", [
    ("cpu_on_default_group", "all_reduce", "NCCL", "CPU", "(3,), torch.float32"),
    ("cpu_on_dp_group", "all_reduce", "NCCL", "CPU", "(2,), torch.float64"),
    ("cpu_p2p", "isend", "NCCL", "CPU", "(2,), torch.float32"),
    ("gpu_on_cpu_group", "broadcast", "gloo", "GPU", "(4,), torch.float32"),
])
def test_the_checker_refuses_a_tensor_on_the_wrong_device_for_its_group(checks, case, collective, backend, held_on,
                                                                       shape):
    c = checks["collectives"]
    assert c["checker_on"]
    message = c[case]
    assert message.startswith(f"{collective} at ") and "tests/dist/check_comm.py:" in message, message
    assert f"holds on the {held_on}, over a group whose backend there is {backend}" in message, message
    assert f"(shape {shape})" in message, message


@COMM
def test_tensors_on_comm_device_pass_and_arrive(checks):
    c = checks["collectives"]
    for case in ("comm_device_on_dp_group", "comm_device_on_cpu_group", "comm_device_p2p", "objects"):
        assert c[case] == "ok", (case, c[case])
    assert c["values"] == [[2.0] * 3, [2.0] * 3, [7.0, 7.0], [0, 1]]
    # the default and Megatron's groups are NCCL on a GPU job; cpu_group and Megatron's gloo groups are gloo
    assert c["devices"] == {"default": "cuda:0", "dp": "cuda:0", "cpu_group": "cpu", "megatron_gloo_dp": "cpu"}


@COMM
def test_tensors_are_tracked_where_a_gpu_job_places_them(checks):
    t = checks["tracking"]
    assert t == {
        "host": False, "cuda_factory": True, "reported_device": "cuda:0", "moved_copy": True, "back_copy": True,
        "same_device_as": True, "computed_from": True, "in_place_keeps_own": False, "parameter": True,
        "gradient": True, "model_parameters": True, "alp_sigmas": True,
    }


@COMM
def test_a_tensor_parallel_update_passes_the_checker(checks):
    """TP=2 with sequence parallelism: Megatron's TP/SP collectives and our vocab-parallel logprob
    reductions."""
    u = checks["tp2_update"]
    assert u["update_ok"] and math.isfinite(u["grad_norm"]) and 0.5 < u["ratio_p50"] < 2, u


@pytest.mark.parametrize("layout, overrides", [
    ("dp2_ep2", ("model.tiny=qwen3_moe", "parallel.expert_model_parallel_size=2", "moe.routing_replay=r2",
                 "trainer.max_tokens_per_micro_batch=120")),
    pytest.param("pp2", ("parallel.pipeline_model_parallel_size=2",), marks=pytest.mark.slow),
])
def test_the_trainer_runs_under_the_checker(tmp_path, layout, overrides):
    """One iteration of the smallest shape that runs every collective of one: rollouts on every
    replica (two under DP=2, one under PP=2), the reward broadcast, logprob passes, an update with DP gradient reduction, MoE
    all-to-all (with R2 routing replay: its TP gathers, metric reductions and the micro-batch count
    agreement) or pipeline send/recv, metrics, weight sync, checkpoint, validation (4 problems, k=1)."""
    run = tmp_path / layout
    val = tmp_path / "val.jsonl"
    val.write_text("".join((ROOT / "data" / "largest" / "val.jsonl").read_text().splitlines(True)[:4]))
    rc, out = train(run, "trainer.iterations=1", "trainer.prompts_per_iteration=2", "trainer.updates_per_iteration=1",
                    "trainer.sft_warmup_steps=0", "rollout.sampling.max_response_length=12", "eval.k=1",
                    f"data.val_files=[{val}]", *overrides, nproc=2, env=CHECK)
    assert rc == 0, out[-6000:]
    (m,) = metrics(run)
    assert m["iteration"] == 0 and m["update/skipped"] == 0 and m["batch/groups"] == 2, m
    replicas = 2 if layout == "dp2_ep2" else 1  # one replica per data-parallel rank: PP=2 is one model
    assert m["rollout/replicas"] == replicas and "val/reward_mean" in m, m
    for key in ("loss/total", "ratio/p50", "grad_norm", "mismatch/kl_k3", "sigma/mean"):
        assert math.isfinite(m[key]), (key, m)
    assert (run / "checkpoints" / "iter_0000001").is_dir()
    if layout == "dp2_ep2":  # R2 under perturbation.moe_routing: fixed: the replayed experts never flip
        assert m["moe/update_flip_frac"] == 0.0 and m["moe/replayed_frac"] == 1.0, m
        assert m["moe/expert_load"] >= 1.0 and math.isfinite(m["moe/aux_loss"]), m
