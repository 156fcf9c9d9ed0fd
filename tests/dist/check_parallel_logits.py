"""TP=2 (with and without sequence parallel) and PP=2 give the TP=1/PP=1 logits.

Usage: torchrun --nproc_per_node 2 check_parallel_logits.py FAMILY RESULT.json
"""

import json
import sys

import torch

from common import build, full_state, load_full_state, pipeline_logits, rank, reinit, tokens

family, result_path = sys.argv[1], sys.argv[2]
TOL = 2e-5  # fp32; different reduction orders across shards

par = reinit(1, 1)
torch.manual_seed(0)
ref_model = build(family, par)
full = full_state(ref_model)
batch = tokens()
ref = pipeline_logits(ref_model, batch)
results = {}
layouts = [(2, 1, False, 1), (2, 1, True, 1), (1, 2, False, 1)]
if family == "qwen3_moe":  # Megatron requires SP with TP for MoE; add expert parallel
    layouts = [(2, 1, True, 1), (1, 2, False, 1), (1, 1, False, 2)]
for tp, pp, sp, ep in layouts:
    par = reinit(tp, pp, sp, ep=ep)
    model = build(family, par)
    load_full_state(model, full)
    logits = pipeline_logits(model, batch)
    if logits is not None:
        diff = (logits - ref).abs().max().item()
        results[f"tp{tp}_pp{pp}_sp{int(sp)}_ep{ep}"] = diff
        assert diff < TOL, f"{family} tp={tp} pp={pp} sp={sp} ep={ep}: max |logit diff| {diff} >= {TOL}"
        assert logits.shape == ref.shape
if rank() == 1:
    json.dump(results, open(result_path, "w"))
print("OK", family, results)
