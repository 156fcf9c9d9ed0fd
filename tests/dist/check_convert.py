"""HF -> Megatron (TP=2 and PP=2, EP=2 for MoE) gives transformers' logits; the export back is
bit-exact; a distributed checkpoint saved under one layout loads under another, sigmas included.

Usage: torchrun --nproc_per_node 2 check_convert.py WORK_DIR RESULT.json FAMILY...
(WORK_DIR/<family>: the tiny HF model of each family, made here (seed SEEDS[family]) unless there.)
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from common import pipeline_logits, rank, reinit, tokens
from megatron_alp.config import ModelConfig, PerturbationConfig
from megatron_alp.training.dist_checkpoint import load_checkpoint, save_checkpoint
from megatron_alp.training.builder import build_gpt_model
from megatron_alp.models.families import hf_to_megatron, load_hf_config
from megatron_alp.models.hf_weights import iter_hf_weights, load_hf_weights
from megatron_alp.models.tiny import make_tiny_model
from megatron_alp.training.perturbation import controller_of

TOL = 1e-4  # fp32 logits vs transformers: different kernels and reduction orders

SEEDS = {"qwen2": 10, "qwen3": 11, "llama": 12, "qwen3_moe": 13}
work, result_path, families = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
results = {}
reinit()
if rank() == 0:
    for family in families:
        if not (work / family).exists():
            make_tiny_model(family, work / family, seed=SEEDS[family])
dist.barrier()


def hf_logits(hf_dir: Path, batch: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=batch).logits.float()


def build(hf_dir: Path, par, pert=None):
    args = hf_to_megatron(load_hf_config(hf_dir))
    return build_gpt_model(args, ModelConfig(hf_path=str(hf_dir), dtype="float32", layer_spec="local"), par, pert)


def check_export(model, reference: dict, what: str) -> int:
    """iter_hf_weights gives every HF tensor, bit-exactly, in a deterministic order, on every rank."""
    seen = []
    for name, tensor in iter_hf_weights(model, bucket_bytes=64 << 10):
        assert "alp_perturbation" not in name, f"{what}: sigma {name} exported"
        assert name in reference, f"{what}: exported unknown tensor {name}"
        assert tensor.dtype == reference[name].dtype, f"{what}: {name} dtype {tensor.dtype}"
        assert torch.equal(tensor, reference[name]), f"{what}: {name} differs after the round trip"
        seen.append(name)
    assert len(seen) == len(set(seen)), f"{what}: duplicates in export"
    assert set(seen) == set(reference), f"{what}: missing {sorted(set(reference) - set(seen))[:5]}"
    return len(seen)


for family in families:
    hf_dir = work / family
    reference = load_file(hf_dir / "model.safetensors")
    batch = tokens(b=2, s=12)
    ref_logits = hf_logits(hf_dir, batch)
    layouts = [(2, 1, 1), (1, 2, 1)]
    if family == "qwen3_moe":
        layouts.append((1, 1, 2))
    res = results.setdefault(family, {})
    for tp, pp, ep in layouts:
        par = reinit(tp, pp, sp=(family == "qwen3_moe" and tp > 1), ep=ep)
        model = build(hf_dir, par)
        load_hf_weights(model, hf_dir)
        logits = pipeline_logits(model, batch)
        tag = f"tp{tp}_pp{pp}_ep{ep}"
        if logits is not None:
            diff = (logits - ref_logits).abs().max().item()
            res[f"{tag}_logit_diff"] = diff
            assert diff < TOL, f"{family} {tag}: max |logit diff| vs transformers {diff} >= {TOL}"
        res[f"{tag}_exported"] = check_export(model, reference, f"{family} {tag}")
        if family == "qwen3_moe":
            experts = [n for n in reference if ".mlp.experts." in n]
            res["expert_tensors"] = len(experts)
            assert len(experts) == 4 * 4 * 3  # layers x experts x (gate, up, down)

    # Save at TP=2 (with ALP sigmas on layers 1 and 3, distinct values), load at PP=2: sigma i stays on
    # layer i, weights stay bit-exact; a model without perturbation loads the same checkpoint.
    ckpt = work / f"{family}_ckpt"
    pert = PerturbationConfig(enabled=True, layers="1,3", init_std=1e-3)
    par = reinit(2, 1, sp=(family == "qwen3_moe"))
    model = build(hf_dir, par, pert)
    load_hf_weights(model, hf_dir)
    with torch.no_grad():
        for site in controller_of(model).sites:
            site.log_sigma.fill_(-1.0 - site.layer)
    save_checkpoint(ckpt, model, extra={"iteration": 3}, hf_config=load_hf_config(hf_dir))
    par = reinit(1, 2)
    model = build(hf_dir, par, PerturbationConfig(enabled=True, layers="1,3", init_std=0.5))
    extra = load_checkpoint(ckpt, model)
    assert extra == {"iteration": 3}, extra
    sites = controller_of(model).sites
    assert len(sites) == 1, [s.layer for s in sites]  # one selected layer per stage
    for site in sites:
        assert site.log_sigma.item() == -1.0 - site.layer, (site.layer, site.log_sigma.item())
    res[f"pp_stage{rank()}_sigma_layers"] = [s.layer for s in sites]
    res["tp2_to_pp2_exported"] = check_export(model, reference, f"{family} tp2 -> pp2 checkpoint")
    model = build(hf_dir, par)  # no perturbation: sigmas in the checkpoint are ignored
    load_checkpoint(ckpt, model)
    check_export(model, reference, f"{family} checkpoint into an unperturbed model")

parts = [None] * dist.get_world_size()
dist.all_gather_object(parts, results)  # the last pipeline stage's logit diffs live on rank 1
merged = {f: {k: v for part in parts for k, v in part[f].items()} for f in results}
if rank() == 0:
    json.dump(merged, open(result_path, "w"), indent=1)
print("OK", json.dumps(merged))
