"""Sigma's own optimizer group under Megatron DDP + optimizer (bf16 model, 2 data-parallel ranks).

Usage: torchrun --nproc_per_node 2 check_optimizer.py RESULT.json
"""

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from common import build, rank, reinit, tokens
from megatron_alp.config import OptimizerConfig, PerturbationConfig
from megatron_alp.training.optim import build_optimizer, learning_rates, wrap_for_training
from megatron_alp.training.perturbation import next_microbatch, perturbed_step, sigma_parameters

par = reinit(1, 1)
pert = PerturbationConfig(enabled=True, init_std=1e-2, lr=5e-2, lr_schedule="constant")
opt_cfg = OptimizerConfig(lr=1e-3, min_lr=1e-5, lr_decay_style="cosine", weight_decay=0.1)
model = wrap_for_training(build("qwen2", par, pert, dtype="bfloat16"), par)
optimizer, scheduler = build_optimizer(model, opt_cfg, pert, par, total_steps=4)

sig = sigma_parameters(model)
assert sig and all(p.dtype == torch.float32 for p in sig), "sigma must stay float32 in a bf16 model"
assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if "alp" not in n)
groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}

batch = tokens(b=4, s=10, seed=rank())  # different data per DP rank
pos = torch.arange(10).unsqueeze(0).expand(4, -1)
lrs = []
start = [p.detach().clone() for p in sig]
for step in range(4):
    model.zero_grad_buffer()
    optimizer.zero_grad()
    with perturbed_step(model, step):
        next_microbatch(model)
        logits = model(batch, pos, None)
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch.roll(-1, 1)).mean()
        loss.backward()
    model.finish_grad_sync()
    ok, grad_norm, _ = optimizer.step()
    scheduler.step(1)
    lrs.append(learning_rates(optimizer))
    assert ok

# sigma's LR stays at its own constant value while the weights' LR decays
assert all(abs(lr["lr/sigma"] - 5e-2) < 1e-12 for lr in lrs), lrs
assert lrs[-1]["lr"] < lrs[0]["lr"] <= 1e-3, lrs
sigma_groups = [g for g in optimizer.param_groups if any(getattr(p, "is_alp_sigma", False) for p in g["params"])]
assert all(g["wd_mult"] == 0.0 for g in sigma_groups)
# trained, and identical on both data-parallel ranks (DDP averaged their different gradients)
for p, s0 in zip(sig, start):
    assert not torch.equal(p.detach(), s0), "sigma did not move"
    other = p.detach().clone()
    dist.broadcast(other, src=0)
    assert torch.equal(other, p.detach()), "sigma differs across data-parallel ranks"
if rank() == 0:
    json.dump({"lrs": lrs, "sigma": [p.exp().mean().item() for p in sig]}, open(sys.argv[1], "w"))
print("OK", lrs[-1])
