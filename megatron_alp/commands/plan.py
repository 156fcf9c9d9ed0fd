"""`megatron-alp plan CONFIG [--gpus N] [--gpu-mem GIB]`: what a run does (its shape: models,
passes, when calibration, validation and checkpoints come; :mod:`megatron_alp.plan.shape`), the
per-GPU memory of every phase it runs (:mod:`megatron_alp.plan.memory`), and whether it fits;
refuses a layout that does not, naming the keys to change."""

from __future__ import annotations

import argparse

from megatron_alp.config import ConfigError
from megatron_alp.plan.layout import default_gpus
from megatron_alp.plan.memory import DEFAULT_GPU_MEM_GIB, memory_plan
from megatron_alp.plan.shape import RunShape
from megatron_alp.resolve import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (see docs/configuration.md)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides, e.g. trainer.micro_batch_size=2")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs of the job; with rollout.placement: separate the trainer's GPUs (its world "
                        "size), the engines' rollout.gpus of each node come on top (default: the fewest the "
                        "config's parallel layout runs on)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="rollout.placement: separate: trainer ranks per node (torchrun --nproc_per_node; "
                        "default: the GPUs below the first of rollout.gpus, at most --gpus)")
    parser.add_argument("--gpu-mem", type=float, default=DEFAULT_GPU_MEM_GIB,
                        help=f"memory of one GPU in GiB (default {DEFAULT_GPU_MEM_GIB:g}: H100 80GB)")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides, gpu=True)  # a plan is for GPUs, whatever runs it
    gpus = args.gpus if args.gpus is not None else default_gpus(cfg)
    plan = memory_plan(cfg, gpus, args.gpu_mem, nproc_per_node=args.nproc_per_node)
    print("\n".join(["what the run does:", *(f"  {line}" for line in RunShape.of(cfg).describe()), ""]), flush=True)
    print(plan.report(), flush=True)
    if not plan.fits:
        raise ConfigError(plan.refusal())
    return 0
