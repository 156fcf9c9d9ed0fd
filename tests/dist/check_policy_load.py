"""A bf16 policy started from a checkpoint (``model.load``) trains from the checkpoint's weights, not
from the HF weights it was built with: the optimizer's fp32 main parameters follow the load
(2 gloo ranks, distributed optimizer over DP=2). A policy built to resume a run reads no HF weights,
and the run's checkpoint (with its optimizer state) gives it every weight and main parameter.

Usage: torchrun --nproc_per_node 2 check_policy_load.py WORK RESULT.json
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from common import tokens
from megatron_alp.models.families import hf_to_megatron, load_hf_config
from megatron_alp.models.tiny import make_tiny_model
from megatron_alp.resolve import config_from_dict
from megatron_alp.runtime.parallel import init_distributed
from megatron_alp.training import policy as policy_module
from megatron_alp.training.dist_checkpoint import load_checkpoint, save_checkpoint
from megatron_alp.training.perturbation import next_microbatch, perturbed_step
from megatron_alp.training.policy import build_policy

work, result = Path(sys.argv[1]), sys.argv[2]


def config(load=None):
    return config_from_dict({
        "model": {"tiny": "qwen2", "dtype": "bfloat16", "layer_spec": "local", "load": load},
        "parallel": {"use_distributed_optimizer": True},
        "optimizer": {"lr": 0.0, "min_lr": 0.0, "weight_decay": 0.0},
        "perturbation": {"enabled": True, "init_std": 1e-4, "lr": 0.0},
    })


def step(policy) -> None:
    """One optimizer step at learning rate 0: the weights become the optimizer's main parameters."""
    batch = tokens(b=2, s=10, seed=dist.get_rank())
    pos = torch.arange(10).unsqueeze(0).expand(2, -1)
    policy.model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    with perturbed_step(policy.model, 0):
        next_microbatch(policy.model)
        logits = policy.model(batch, pos, None)
        tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch.roll(-1, 1)).mean().backward()
    policy.model.finish_grad_sync()
    ok, _, _ = policy.optimizer.step()
    assert ok


cfg = config()
init_distributed(cfg.parallel, seed=1)
hf_dir = work / "hf"
if dist.get_rank() == 0:
    make_tiny_model("qwen2", hf_dir, seed=3)
dist.barrier()
args = hf_to_megatron(load_hf_config(hf_dir))
first = build_policy(args, cfg, hf_dir, total_steps=4)
with torch.no_grad():
    for p in first.module.parameters():
        p.add_(0.25)  # weights no HF file holds
saved = {n: p.detach().clone() for n, p in first.module.named_parameters()}
ckpt = work / "ckpt"
save_checkpoint(ckpt, first.module, extra={"iteration": 0})

loaded = build_policy(args, config(load=str(ckpt)), hf_dir, total_steps=4)
step(loaded)
moved = [n for n, p in loaded.module.named_parameters() if not torch.equal(p.detach(), saved[n])]

# a run's checkpoint with optimizer state, then a resume with the HF weights unreadable
run_ckpt = work / "run_ckpt"
save_checkpoint(run_ckpt, loaded.module, optimizer=loaded.optimizer, opt_param_scheduler=loaded.scheduler,
                extra={"iteration": 1})


def no_hf_read(model, source):
    raise RuntimeError(f"HF weights read from {source}")


policy_module.load_hf_weights = no_hf_read
try:
    build_policy(args, cfg, hf_dir, total_steps=4)
    fresh_reads_hf = False
except RuntimeError:
    fresh_reads_hf = True
resumed = build_policy(args, cfg, hf_dir, total_steps=4, resuming=True)
load_checkpoint(run_ckpt, resumed.module, optimizer=resumed.optimizer, opt_param_scheduler=resumed.scheduler)
step(resumed)
resumed_moved = [n for n, p in resumed.module.named_parameters() if not torch.equal(p.detach(), saved[n])]
if dist.get_rank() == 0:
    json.dump({"params": len(saved), "moved": moved, "fresh_reads_hf": fresh_reads_hf,
               "resumed_moved": resumed_moved}, open(result, "w"))
