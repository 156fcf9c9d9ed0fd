"""HF weight mapping of Megatron parameters: how each local parameter is split over tensor parallelism;
the HF-tensor gather that delivers only to the ranks that ask for it."""

from __future__ import annotations

import pytest
from helpers import dist_job, read_results

# One rank over gloo (tests/dist/check_expert_partition.py): the mapping rules of a tiny Qwen3-MoE, and
# parameters that carry the tensor parallel attributes Transformer Engine stamps on them.
EXPERT_PARTITION = dist_job("expert_partition", "check_expert_partition.py", "{dir}/result.json", nproc=1)
# under the collective-device checker: the point-to-point buckets sit where NCCL takes them on a GPU job
HF_GATHER = dist_job("hf_gather", "check_hf_gather.py", "{dir}/result.json",
                     env={"MEGATRON_ALP_CHECK_COLLECTIVE_DEVICES": "1"})


@EXPERT_PARTITION
def test_expert_weights_follow_the_rule_not_te_attributes(dist_jobs):
    """MoE + TE spec + EP > 1: TE marks expert linear_fc2 weights partition_dim=0 while Megatron splits
    them along dim 1 (row parallel); the mapping must not refuse them. Dense weights stay checked."""
    r = read_results(dist_jobs.run("expert_partition") / "result.json")
    assert r["expert_partition_dim"] == 1 and "along dim 0, the weight mapping says 1" in r["dense_refusal"], r


@pytest.fixture(scope="module")
def receiver_gathers(dist_jobs) -> dict:
    return read_results(dist_jobs.run("hf_gather") / "result.json")


@HF_GATHER
@pytest.mark.parametrize("layout, family", [("tp2", "qwen3"), ("pp2", "qwen3"), ("ep2", "qwen3_moe")])
def test_only_receivers_get_the_tensors_of_the_everyone_gather(receiver_gathers, layout, family):
    """Two gloo ranks, receivers [0] then [1]: the receiver yields every HF tensor, bit for bit those
    of the gather to every rank (checked in the script), and receives what that gather brought it;
    the other rank yields nothing and receives only its TP all-gather share (none without TP)."""
    from megatron_alp.models.families import hf_to_megatron
    from megatron_alp.models.tiny import tiny_hf_config
    from megatron_alp.models.weight_mapping import WeightMapping

    hf_tensors = len(WeightMapping.from_args(hf_to_megatron(tiny_hf_config(family))).hf_names())
    for receiver in (0, 1):
        got = receiver_gathers[f"{layout}_to{receiver}_rank{receiver}"]
        other = receiver_gathers[f"{layout}_to{receiver}_rank{1 - receiver}"]
        assert got["tensors"] == got["everyone_tensors"] == hf_tensors
        assert got["received"] == got["everyone_received"] > 0
        assert other["tensors"] == other["bytes"] == 0
        assert other["received"] == (other["everyone_received"] if layout == "tp2" else 0)
