"""A checkpoint saved at one parallel layout loads at another with every tensor intact.

Three jobs share WORK_DIR (run in this order by tests/test_dist_checkpoint.py):
- ``seed`` (1 rank): a dense and an MoE model train two ALP steps (plain and distributed
  optimizer) and save: ``one/<family>_<optimizer>``.
- ``wide`` (2 ranks): each of those loads at DP=2, TP=2, PP=2 (dense) or EP=2 (MoE) and is saved
  again from that layout: ``wide/<layout>_<optimizer>``. The MoE model's optimizer state cannot
  move between EP=1 and EP>1 (Megatron chains a second optimizer for the experts at EP>1): that
  load must be refused naming the key, and its weights move without optimizer. Also: what a DP=2
  load of the distributed optimizer asks each rank to read (``kept.json``).
- ``narrow`` (1 rank): each wide checkpoint loads on one rank and is saved again:
  ``narrow/<layout>_<optimizer>``. Then every wide and narrow checkpoint must hold exactly the
  tensors (weights, sigmas, Adam moments, fp32 main parameters) and the common state (optimizer
  param groups and steps, LR schedule) of the one it came from, read back with torch's own DCP
  reader. Also: a distributed-optimizer checkpoint refused by a plain-optimizer job (naming the
  key), and the startup line of a resume at another layout.

Usage: torchrun --nproc_per_node N check_reshard.py seed|wide|narrow WORK_DIR [RESULT.json]
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from common import build, rank, reinit, tokens
from megatron.core import tensor_parallel
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_alp.config import InputError, OptimizerConfig, PerturbationConfig
from megatron_alp.training.dist_checkpoint import (
    OPTIMIZER_METADATA,
    _optimizer_state_io,
    _prepare_optimizer_for_load,
    current_layout,
    load_checkpoint,
    model_sharded_state_dict,
    read_metadata,
    relayout_line,
    save_checkpoint,
)
from megatron_alp.training.optim import build_optimizer, wrap_for_training
from megatron_alp.training.perturbation import next_microbatch, perturbed_step

mode, work = sys.argv[1], Path(sys.argv[2])
PERT = PerturbationConfig(enabled=True, layers="1-3", init_std=1e-2, lr=5e-2)
OPT = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_decay_style="cosine", weight_decay=0.1)
OPTIMIZERS = {"plain": False, "distributed": True}
LAYOUTS = {  # name: (family, tp, pp, ep)
    "dp2": ("qwen2", 1, 1, 1), "tp2": ("qwen2", 2, 1, 1), "pp2": ("qwen2", 1, 2, 1), "ep2": ("qwen3_moe", 1, 1, 2),
}
EXTRA = {"iteration": 2, "step": 2}
refusals = {}  # optimizer loads refused, by checkpoint


def make(family: str, optimizer: str, tp: int = 1, pp: int = 1, ep: int = 1):
    par = reinit(tp, pp, ep=ep)
    par.use_distributed_optimizer = OPTIMIZERS[optimizer]
    model = wrap_for_training(build(family, par, PERT), par)
    opt, sched = build_optimizer(model, OPT, PERT, par, total_steps=10)
    return model, opt, sched


def train_step(model, opt, sched, step: int) -> None:
    batch = tokens(b=2, s=10, seed=100 + step)
    pos = torch.arange(10).unsqueeze(0).expand(2, -1)
    model.zero_grad_buffer()
    opt.zero_grad()
    with perturbed_step(model, step):
        next_microbatch(model)
        loss = tensor_parallel.vocab_parallel_cross_entropy(model(batch, pos, None).float(), batch.roll(-1, 1)).mean()
        loss.backward()
    model.finish_grad_sync()
    assert opt.step()[0]
    sched.step(1)


def resave(src: Path, dst: Path, family: str, optimizer: str, **layout) -> str | None:
    """Load ``src`` at ``layout`` and save it again to ``dst``; the resume line of that load. Across
    EP=1 <-> EP=2 the optimizer must be refused and the weights move alone."""
    model, opt, sched = make(family, optimizer, **layout)
    if family == "qwen3_moe":
        if read_metadata(src)["has_optimizer"]:
            try:
                load_checkpoint(src, model, optimizer=opt, opt_param_scheduler=sched)
                refusals[f"{family}_{optimizer}"] = None
            except InputError as err:
                refusals[f"{family}_{optimizer}"] = str(err)
        opt = sched = None
    assert load_checkpoint(src, model, optimizer=opt, opt_param_scheduler=sched) == EXTRA
    line = relayout_line(src, read_metadata(src)["layout"], current_layout(opt), perturbed=True)
    save_checkpoint(dst, model, optimizer=opt, opt_param_scheduler=sched, extra=EXTRA)
    return line


def contents(ckpt: Path, scratch: Path) -> tuple[dict, dict]:
    """Every tensor of ``ckpt`` as a full (unsharded) tensor, and its common state."""
    dcp_to_torch_save(ckpt, scratch)
    return torch.load(scratch, weights_only=False), torch.load(ckpt / "common.pt", weights_only=False)


def same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def differences(a: Path, b: Path) -> list[str]:
    """What differs between two checkpoints (their weights only when ``b`` holds no optimizer)."""
    (ta, ca), (tb, cb) = contents(a, work / "a.pt"), contents(b, work / "b.pt")
    if not read_metadata(b)["has_optimizer"]:
        ta = {k: v for k, v in ta.items() if not k.startswith("optimizer.")}
        ca = cb
    out = [f"only in one: {k}" for k in sorted(set(ta) ^ set(tb))]
    out += [f"{k} differs" for k in sorted(set(ta) & set(tb)) if not same(ta[k], tb[k])]
    return out + (["common state differs"] if ca != cb else [])


def family_of(layout: str) -> str:
    return LAYOUTS[layout][0]


def kept_on_load() -> dict:
    """The dense model's distributed optimizer at DP=2: the parameters whose state this rank's load
    reads, against those whose buffer range meets its shard of a bucket (each bucket split evenly over
    the DP ranks), and how many of them it reads as the main replica."""
    model, opt, _ = make("qwen2", "distributed")
    _prepare_optimizer_for_load(opt)  # as load_checkpoint does
    with _optimizer_state_io(opt, loading=True):
        state = opt.sharded_state_dict(model_sharded_state_dict(model), is_loading=True, metadata=OPTIMIZER_METADATA)
    (sub,) = getattr(opt, "chained_optimizers", [opt])
    (buffer,) = sub.buffers
    dp, r = dist.get_world_size(), dist.get_rank()
    expected = 0
    for start, end, bucket_id in buffer.param_index_map.values():
        bucket = buffer.buckets[bucket_id]
        size = bucket.grad_data.numel() // dp
        expected += start < bucket.offset + (r + 1) * size and end > bucket.offset + r * size
    kept = state["param_state"]
    main = sum(all(i == 0 for i in t["param"].replica_id) for t in kept.values())
    counts = torch.tensor([main])
    dist.all_reduce(counts)
    return {"kept": len(kept), "expected": expected, "total": len(buffer.param_index_map), "main": int(counts[0])}


if mode == "seed":
    reinit()
    for family in ("qwen2", "qwen3_moe"):
        for optimizer in OPTIMIZERS:
            model, opt, sched = make(family, optimizer)
            for step in range(2):
                train_step(model, opt, sched, step)
            save_checkpoint(work / "one" / f"{family}_{optimizer}", model, optimizer=opt, opt_param_scheduler=sched,
                            extra=EXTRA)
elif mode == "wide":
    reinit()
    for name, (family, tp, pp, ep) in LAYOUTS.items():
        for optimizer in OPTIMIZERS:
            resave(work / "one" / f"{family}_{optimizer}", work / "wide" / f"{name}_{optimizer}", family, optimizer,
                   tp=tp, pp=pp, ep=ep)
    (work / "refusals.json").write_text(json.dumps(refusals))
    kept = [None] * dist.get_world_size()
    dist.all_gather_object(kept, kept_on_load())
    if rank() == 0:
        (work / "kept.json").write_text(json.dumps(kept))
else:
    reinit()
    results = {"lines": {}, "differences": {}}
    for name in LAYOUTS:
        for optimizer in OPTIMIZERS:
            tag = f"{name}_{optimizer}"
            results["lines"][tag] = resave(work / "wide" / tag, work / "narrow" / tag, family_of(name), optimizer)
            one = work / "one" / f"{family_of(name)}_{optimizer}"
            results["differences"][f"wide/{tag}"] = differences(one, work / "wide" / tag)
            results["differences"][f"narrow/{tag}"] = differences(one, work / "narrow" / tag)
    model, opt, sched = make("qwen2", "plain")
    try:
        load_checkpoint(work / "one" / "qwen2_distributed", model, optimizer=opt, opt_param_scheduler=sched)
        results["refusal"] = None
    except InputError as err:
        results["refusal"] = str(err)
    results["moe_refusals"] = json.loads((work / "refusals.json").read_text())
    results["kept"] = json.loads((work / "kept.json").read_text())
    if rank() == 0:
        Path(sys.argv[3]).write_text(json.dumps(results, indent=1))
dist.barrier()
