"""One rank over gloo: the mapping rules of a tiny Qwen3-MoE, and parameters that carry the tensor
parallel attributes Transformer Engine stamps on them (partition_dim=0 on every weight when Megatron
shards the experts itself, i.e. EP > 1 or expert TP > 1): an expert linear_fc2 weight follows its
rule (split along dim 1), a dense weight split against its rule is refused.

Usage: python check_expert_partition.py RESULT.json
"""

import json
import sys

import torch

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
    refusal = str(err)
json.dump({"expert_partition_dim": param.partition_dim, "dense_refusal": refusal}, open(sys.argv[1], "w"))
print("OK")
