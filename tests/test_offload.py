"""Offloading Megatron's training state for a colocated rollout: the round trip is bit-identical and
really releases the storage (torchrun, gloo; the same code moves GPU state to pinned host memory), and
a phase that needs the policy's weights without the reference model leaves the reference away."""

from __future__ import annotations

import pytest
import torch
from helpers import dist_job, read_results

from megatron_alp.trainer.phases import PhaseRunner
from megatron_alp.training.offload import TrainingStateOffloader


OFFLOAD = dist_job("offload", "check_offload.py", "{dir}/result.json")


@pytest.fixture(scope="module")
def results(dist_jobs):
    return read_results(dist_jobs.run("offload") / "result.json")


@OFFLOAD
@pytest.mark.parametrize("layout", ["dp2_bf16_distopt", "pp2_fp32"])
def test_offload_round_trip_is_bit_identical(results, layout):
    r = results[layout]
    assert r["released"] and r["grads_released"], r
    assert r["identical"], "weights or optimizer state changed in the round trip"
    assert r["same_training"], "the next step differs from a run that never offloaded"
    assert r["offload/bytes_moved"] > 0 and r["reload/bytes_moved"] == r["offload/bytes_moved"]
    assert r["offload/bytes_freed"] > r["offload/bytes_moved"]  # gradients are freed without a copy


def test_the_checkpoint_save_leaves_the_reference_offloaded():
    """The save needs the policy's weights and its optimizer state, not the reference model: entered from the
    weight sync (which holds both models' weights) it releases the reference and the gradients and keeps the
    policy's weights as they were; the reference comes back unchanged for the next logprob pass."""
    torch.manual_seed(0)
    policy, reference = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32).requires_grad_(False)
    optimizer = torch.optim.Adam(policy.parameters())
    policy(torch.randn(2, 32)).sum().backward()
    optimizer.step()
    offloader = TrainingStateOffloader([policy], optimizer, reference=[reference])
    runner = PhaseRunner()
    runner.attach(offloader=offloader)
    policy_before, reference_before = ([p.detach().clone() for p in m.parameters()] for m in (policy, reference))

    def resident(tensors) -> list[bool]:
        return [t.untyped_storage().nbytes() > 0 for t in tensors]

    runner.enter("weight_sync")
    assert all(resident(policy.parameters())) and all(resident(reference.parameters()))
    runner.enter("checkpoint_save")
    assert all(resident(policy.parameters())) and not any(resident(reference.parameters()))
    assert not any(resident(p.grad for p in policy.parameters()))
    moments = [v for state in optimizer.state.values() for v in state.values() if v.numel() > 1]
    assert len(moments) == 4 and all(resident(moments))
    assert all(torch.equal(a, b) for a, b in zip(policy_before, policy.parameters()))
    runner.enter("rollout")
    runner.enter("logprob")
    assert all(resident(reference.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(reference_before, reference.parameters()))
