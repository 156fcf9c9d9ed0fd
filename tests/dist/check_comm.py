"""The collective-device checker of megatron_alp.runtime.comm on 2 gloo ranks, started with
MEGATRON_ALP_CHECK_COLLECTIVE_DEVICES=1 (the trainer's own entry, init_distributed, installs it).

Records, for the test to judge: what the checker says of CPU tensors on groups that are NCCL on a
GPU job and of accelerator tensors on a gloo group (an error), and of tensors built on
``comm_device(group)`` (nothing; they arrive); how tensors are tracked as a GPU job would place
them; and a tensor-parallel (TP=2 + SP) ALP policy update under the checker, which runs our
vocab-parallel logprob reductions and Megatron's TP/SP collectives.

Usage: torchrun --nproc_per_node 2 check_comm.py RESULT.json
"""

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from common import build, reinit
from megatron_alp.runtime.comm import CollectiveDeviceError, comm_device, cpu_group
from megatron_alp.config import LossConfig, OptimizerConfig, PerturbationConfig
from megatron_alp.training.step_metrics import StepMetrics
from megatron_alp.training.optim import build_optimizer, wrap_for_training
from megatron_alp.runtime.platform import check_requested, on_accelerator
from megatron_alp.training.micro_batch import Batching
from megatron_alp.training.policy_update import compute_logprobs, train_mini_batch
from megatron_alp.training.rl_batch import RLBatch


def attempt(fn) -> str:
    """"ok", or the message of the CollectiveDeviceError ``fn`` raised."""
    try:
        fn()
    except CollectiveDeviceError as err:
        return str(err)
    return "ok"


def exchange(t: torch.Tensor) -> None:
    """Rank 0 sends ``t`` (filled with 7) to rank 1, through batch_isend_irecv as Megatron's pipeline does."""
    rank = dist.get_rank()
    if rank == 0:
        t.fill_(7)
    op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, 1 - rank)
    for work in dist.batch_isend_irecv([op]):
        work.wait()


def collectives() -> dict:
    reinit()  # DP=2
    dp = ps.get_data_parallel_group()
    host_group = cpu_group()
    out = {"checker_on": check_requested()}
    out["cpu_on_default_group"] = attempt(lambda: dist.all_reduce(torch.ones(3)))
    out["cpu_on_dp_group"] = attempt(lambda: dist.all_reduce(torch.ones(2, dtype=torch.float64), group=dp))
    accelerator = torch.ones(4, device=comm_device())
    out["gpu_on_cpu_group"] = attempt(lambda: dist.broadcast(accelerator, src=0, group=host_group))
    out["cpu_p2p"] = attempt(lambda: exchange(torch.zeros(2)))

    summed, host = torch.ones(3, device=comm_device(dp)), torch.ones(3, device=comm_device(host_group))
    received = torch.zeros(2, device=comm_device())
    gathered = [None, None]
    out["comm_device_on_dp_group"] = attempt(lambda: dist.all_reduce(summed, group=dp))
    out["comm_device_on_cpu_group"] = attempt(lambda: dist.all_reduce(host, group=host_group))
    out["comm_device_p2p"] = attempt(lambda: exchange(received))
    out["objects"] = attempt(lambda: (dist.broadcast_object_list([{"a": 1}], src=0),
                                      dist.all_gather_object(gathered, dist.get_rank(), group=host_group)))
    out["values"] = [summed.tolist(), host.tolist(), received.tolist(), gathered]
    out["devices"] = {
        "default": str(comm_device()), "dp": str(comm_device(dp)), "cpu_group": str(comm_device(host_group)),
        "megatron_gloo_dp": str(comm_device(ps.get_data_parallel_group_gloo())),
    }
    return out


def tracking() -> dict:
    """Which tensors count as GPU tensors, against what a GPU job does."""
    host = torch.ones(3)
    gpu = torch.ones(3, device="cuda")
    moved = host.to(comm_device())
    back = gpu.cpu()
    into = torch.zeros(3)
    into.copy_(gpu)
    weight = torch.nn.Parameter(torch.ones(3, device=torch.cuda.current_device()))
    (weight * host).sum().backward()
    model = build("qwen2", reinit(), PerturbationConfig(enabled=True))
    sigmas = [p for p in model.parameters() if getattr(p, "is_alp_sigma", False)]
    return {
        "host": on_accelerator(host),
        "cuda_factory": on_accelerator(gpu),
        "reported_device": str(gpu.device),
        "moved_copy": on_accelerator(moved) and moved is not host and not on_accelerator(host),
        "back_copy": not on_accelerator(back) and back is not gpu and on_accelerator(gpu),
        "same_device_as": on_accelerator(torch.empty(2, device=gpu.device)),
        "computed_from": on_accelerator(gpu * host.sum()),
        "in_place_keeps_own": on_accelerator(into),
        "parameter": on_accelerator(weight),
        "gradient": on_accelerator(weight.grad),
        "model_parameters": all(on_accelerator(p) for p in model.parameters()),
        "alp_sigmas": len(sigmas) > 0 and all(on_accelerator(p) for p in sigmas),
    }


def tp2_update() -> dict:
    par = reinit(tp=2, sp=True)
    pert = PerturbationConfig(enabled=True, init_std=1e-3)
    model = wrap_for_training(build("qwen2", par, pert), par)
    optimizer, _ = build_optimizer(model, OptimizerConfig(lr=1e-3, min_lr=1e-3), pert, par, total_steps=1)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 512, (4, 10), generator=g)
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1), value=0)
    mask = torch.zeros(4, 10)
    mask[:, 3:9] = 1
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    batch = RLBatch(tokens, targets, mask, torch.zeros(4, 10), advantages, torch.full((4,), 10))
    batch.old_logprobs = compute_logprobs(model, batch, batching=Batching(size=2), temperature=1.0, pad_id=0)
    batch.rollout_logprobs = batch.old_logprobs * mask
    metrics = StepMetrics()
    stats = train_mini_batch(model, optimizer, batch, loss_cfg=LossConfig(name="alp_token", kl_coef=0.0), step=0,
                             batching=Batching(size=2), temperature=1.0, pad_id=0, metrics=metrics)
    reduced = metrics.reduce(ps.get_data_parallel_group())
    return {"update_ok": bool(stats["update_ok"]), "grad_norm": float(stats["grad_norm"]),
            "ratio_p50": reduced["ratio/p50"]}


def main() -> None:
    results = {"collectives": collectives(), "tracking": tracking(), "tp2_update": tp2_update()}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)


main()
