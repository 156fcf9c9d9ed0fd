"""`megatron-alp smoke`: the fastest end-to-end check of an install.

Builds a tiny Megatron-Core model of a registered family on this machine (CPU or GPU), runs one
perturbed policy-update forward/backward and one unperturbed forward, and prints what ALP did:
the logit shift the noise caused and the gradient each sigma received. Library output goes to
``smoke.log`` in the system's temporary folder.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from megatron.core import tensor_parallel

from megatron_alp.commands.context import library_log, one_process
from megatron_alp.config import ModelConfig, ParallelConfig, PerturbationConfig
from megatron_alp.models.families import FAMILIES, hf_to_megatron
from megatron_alp.models.tiny import tiny_hf_config
from megatron_alp.runtime.console import say
from megatron_alp.training.builder import build_gpt_model
from megatron_alp.training.perturbation import gather_sigma_stats, next_microbatch, perturbed_step, sigma_parameters


def add_arguments(parser) -> None:
    parser.add_argument("--family", default="qwen2", choices=sorted(FAMILIES))
    parser.add_argument("--layers", default="all", help="perturbed layers: all, 0-1,3 or logits")
    parser.add_argument("--init-std", type=float, default=1e-2)


def run(args) -> int:
    log = Path(tempfile.gettempdir()) / "megatron-alp" / "smoke.log"
    with library_log(log, None, announce=False), one_process(seed=1):
        model = build_gpt_model(
            hf_to_megatron(tiny_hf_config(args.family)),
            ModelConfig(tiny=args.family, dtype="float32"),
            ParallelConfig(),
            PerturbationConfig(enabled=True, layers=args.layers, init_std=args.init_std),
        )
        dev = next(model.parameters()).device
        tokens = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(0)).to(dev)
        pos = torch.arange(16, device=dev).unsqueeze(0).expand(2, -1)
        with torch.no_grad():
            clean = model(tokens, pos, None)
        with perturbed_step(model, step=0):
            next_microbatch(model)
            logits = model(tokens, pos, None)
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), tokens.roll(-1, 1)).mean()
            loss.backward()
        say(f"family={args.family} layers={args.layers} loss={loss.item():.4f} "
            f"max|perturbed - clean logits|={(logits.detach() - clean).abs().max().item():.3e}")
        for name, p in model.named_parameters():
            if getattr(p, "is_alp_sigma", False):
                say(f"  {name}: sigma={p.exp().mean().item():.2e} grad={p.grad.abs().sum().item():.3e}")
        ok = all(p.grad is not None and p.grad.abs().sum() > 0 for p in sigma_parameters(model))
        say(f"sigma mean {gather_sigma_stats(model).get('sigma/mean', float('nan')):.2e}; "
            f"{'OK' if ok else 'FAILED: a sigma got no gradient'}; library output in {log}")
        return 0 if ok else 1
