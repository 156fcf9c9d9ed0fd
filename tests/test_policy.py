"""The policy's construction: weights loaded from a checkpoint reach the optimizer, and a resume reads no HF
weights (torchrun, gloo)."""

import pytest
from helpers import dist_job, read_results

# its own launch: Megatron state another job leaves in a shared process breaks its checkpoint validation
pytestmark = dist_job("policy_load", "check_policy_load.py", "{dir}", "{dir}/r.json",
                      env={"MEGATRON_ALP_JOB": "policy_load"})


@pytest.fixture(scope="module")
def results(dist_jobs):
    return read_results(dist_jobs.run("policy_load") / "r.json")


def test_a_bf16_policy_started_from_a_checkpoint_trains_from_its_weights(results):
    """``model.load`` into a bf16 model with the distributed optimizer: one step at learning rate 0
    leaves every parameter at the checkpoint's value (before the fix the optimizer's fp32 main
    parameters still held the HF weights the model was built with, and the step put those back)."""
    assert results["params"] > 30 and results["moved"] == [], results["moved"][:5]


def test_a_resumed_policy_reads_no_hf_weights_and_takes_every_value_from_the_checkpoint(results):
    """``build_policy(..., resuming=True)`` with the HF loader refusing: it builds, and once the run's checkpoint
    (weights and optimizer state) is loaded, one step at learning rate 0 leaves every parameter at the saved
    value; a policy built without resuming reads the HF weights."""
    assert results["fresh_reads_hf"] and results["resumed_moved"] == [], results["resumed_moved"][:5]
