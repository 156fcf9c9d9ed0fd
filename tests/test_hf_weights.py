"""HF weight mapping of Megatron parameters: how each local parameter is split over tensor parallelism;
the HF-tensor gather that delivers only to the ranks that ask for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_results, torchrun

ROOT = Path(__file__).resolve().parents[1]

# One rank over gloo: the mapping rules of a tiny Qwen3-MoE, and parameters that carry the tensor
# parallel attributes Transformer Engine stamps on them (partition_dim=0 on every weight when Megatron
# shards the experts itself, i.e. EP > 1 or expert TP > 1).
SCRIPT = """
import os, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
from megatron_alp.config import ParallelConfig
from megatron_alp.models.families import hf_to_megatron
from megatron_alp.models.hf_weights import _Param
from megatron_alp.models.tiny import tiny_hf_config
from megatron_alp.models.weight_mapping import WeightMapping
from megatron_alp.runtime.parallel import init_distributed

init_distributed(ParallelConfig())
mapping = WeightMapping.from_args(hf_to_megatron(tiny_hf_config("qwen3_moe")))

def te_stamped(shape, dim):
    p = torch.nn.Parameter(torch.zeros(shape))
    p.tensor_model_parallel, p.partition_dim = True, dim
    return p

expert = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
param = _Param(expert, te_stamped((8, 4), 0), mapping.match(expert))
assert param.expert and param.partition_dim == 1, (param.expert, param.partition_dim)
dense = "decoder.layers.0.self_attention.linear_proj.weight"
try:
    _Param(dense, te_stamped((8, 4), 0), mapping.match(dense))
    raise SystemExit("a dense weight split against its rule was accepted")
except ValueError as err:
    assert "along dim 0, the weight mapping says 1" in str(err), err
print("OK")
"""


def test_expert_weights_follow_the_rule_not_te_attributes():
    """MoE + TE spec + EP > 1: TE marks expert linear_fc2 weights partition_dim=0 while Megatron splits
    them along dim 1 (row parallel); the mapping must not refuse them. Dense weights stay checked."""
    from megatron_alp.runtime.parallel import free_port

    env = {**os.environ, "PYTHONPATH": str(ROOT), "PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def receiver_gathers(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("hf_gather") / "result.json"
    # under the collective-device checker: the point-to-point buckets sit where NCCL takes them on a GPU job
    torchrun("check_hf_gather.py", str(path), env={"MEGATRON_ALP_CHECK_COLLECTIVE_DEVICES": "1"})
    return read_results(path)


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
