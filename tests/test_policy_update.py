"""The policy-update pass learns in the direction the advantages give, for every loss, on every
layout (DP=2, TP=2, PP=2; torchrun over gloo), and activation recomputation changes nothing.

A deterministic learning check in place of a reward-rise run: one optimizer step on a fixed batch
of random responses with advantages +1 / -1 must raise J = sum_i A_i log pi(y_i) (first-order
ascent of the clipped objective at ratio ~1), raise the log-probability of every positive-advantage
response and lower every negative one's.
"""

from __future__ import annotations

import pytest
from helpers import dist_job, read_results

LOSSES = ("alp_token", "alp_seq", "grpo", "gspo", "token_mis", "seq_mis", "token_tis", "seq_bypass")
PERTURBED = {"alp_token", "alp_seq"}
LAYOUTS = ("dp2", "tp2", "pp2", "dp2_recompute", "dp2_bf16")
ADVANTAGES = [1.0 if i % 2 == 0 else -1.0 for i in range(8)]


pytestmark = dist_job("policy_update", "check_policy_update.py", "{dir}/result.json", timeout=900)


@pytest.fixture(scope="module")
def updates(dist_jobs):
    return read_results(dist_jobs.run("policy_update") / "result.json")


def _deltas(r: dict) -> list[float]:
    return [a - b for a, b in zip(r["after"], r["before"])]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", LOSSES)
def test_one_update_moves_each_response_the_way_its_advantage_says(updates, layout, name):
    d = _deltas(updates[f"{layout}/{name}"])
    assert len(d) == len(ADVANTAGES)
    assert sum(a * x for a, x in zip(ADVANTAGES, d)) > 0, d
    for a, x in zip(ADVANTAGES, d):
        assert (x > 0) if a > 0 else (x < 0), (layout, name, d)


@pytest.mark.parametrize("name", LOSSES)
def test_recomputation_replays_the_same_update(updates, name):
    """Full recomputation re-runs the forward (and ALP's noise) in the backward: identical update."""
    plain, recomputed = updates[f"dp2/{name}"]["after"], updates[f"dp2_recompute/{name}"]["after"]
    assert recomputed == pytest.approx(plain, abs=1e-5)


@pytest.mark.parametrize("layout", ("tp2", "pp2"))
@pytest.mark.parametrize("name", sorted(set(LOSSES) - PERTURBED))
def test_model_parallel_update_equals_data_parallel(updates, layout, name):
    """Without noise (baselines) the update does not depend on the layout beyond float summation order."""
    ref, got = _deltas(updates[f"dp2/{name}"]), _deltas(updates[f"{layout}/{name}"])
    assert got == pytest.approx(ref, rel=2e-3, abs=2e-3)


def test_bf16_outputs_reach_the_logprob_code_in_bf16(updates):
    """The chunked logprob code upcasts per chunk; the model output must not arrive as an fp32 copy."""
    assert updates["output_dtypes"]["dp2_bf16"] == ["torch.bfloat16"]
    assert updates["output_dtypes"]["dp2"] == ["torch.float32"]

