"""LoRA adapters in Megatron distributed checkpoints (2 gloo ranks): saved and loaded at any layout,
resumed exactly.

- Dense (qwen3, gated MLP, distributed optimizer): a reference run at DP=2 takes a perturbed step
  (sigmas and adapters get Adam state), saves, and takes a plain step. A fresh model loading that
  checkpoint at the same layout takes the same next step bit for bit. At TP=2, TP=2 with sequence
  parallel and PP=2 the load gives exactly the reference's full adapters and sigmas and the next step
  moves them as the reference's did (to float-sum order); the checkpoints saved at TP=2 with sequence
  parallel and at PP=2 load back at DP=2 with exactly the tensors gathered before that save.
- MoE (qwen3_moe, experts adapted, plain optimizer): the same exact resume at EP=2 (its own expert
  optimizer); that checkpoint loads at EP=1, and at TP=2 with sequence parallel (expert TP=2), with
  exactly the same full adapters.
- A checkpoint saved without adapters: refused by a LoRA model naming ``base_only``, loaded with
  ``base_only=True`` (base weights from it, adapters as initialised); and a LoRA checkpoint's base
  weights load into a model without adapters.

Usage: torchrun --nproc_per_node 2 check_lora_checkpoint.py WORK_DIR RESULT.json
"""

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import unwrap_model

from common import build, global_name, rank, reinit, tokens
from megatron_alp.config import LoRAConfig, OptimizerConfig, PerturbationConfig
from megatron_alp.models.lora import is_lora_parameter
from megatron_alp.models.sharding import gather_tp, partition_dim_of
from megatron_alp.training.dist_checkpoint import load_checkpoint, save_checkpoint
from megatron_alp.training.optim import build_optimizer, wrap_for_training
from megatron_alp.training.perturbation import next_microbatch, perturbed_step

work, result_path = Path(sys.argv[1]), sys.argv[2]
PERT = PerturbationConfig(enabled=True, layers="1-2", init_std=1e-2, lr=5e-2)
OPT = OptimizerConfig(lr=1e-2, min_lr=1e-3, lr_decay_style="cosine", weight_decay=0.1)
TARGETS = {"qwen3": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
           "qwen3_moe": ["linear_qkv", "linear_proj", "experts"]}
STEP_TOL = 1e-2  # the next step at another layout, relative to its norm (float sums in another order)
R = {"exact_resume": [], "loaded": [], "step_rel_diff": 0.0}


def lora(family: str) -> LoRAConfig:
    return LoRAConfig(enabled=True, rank=4, alpha=8.0, target_modules=TARGETS[family])


def make(family: str, distributed: bool, tp=1, pp=1, sp=False, ep=1, with_lora=True, seed=0):
    par = reinit(tp, pp, sp, ep=ep)
    par.use_distributed_optimizer = distributed
    torch.manual_seed(seed)
    model = wrap_for_training(build(family, par, PERT, lora=lora(family) if with_lora else None), par)
    opt, sched = build_optimizer(model, OPT, PERT, par, total_steps=10)
    return model, opt, sched


def train_step(model, opt, sched, step: int, perturbed: bool) -> None:
    """One optimizer step on a fixed batch through Megatron's schedule, which ends with
    finalize_model_grads (a perturbed step moves the sigmas too)."""
    batch = tokens(b=2, s=8, seed=100 + step)
    pos = torch.arange(8).unsqueeze(0).expand(2, -1)

    def step_fn(data_iter, m):
        next_microbatch(m)

        def loss_fn(logits):
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch.roll(-1, 1)).mean()
            return loss, {"loss": loss.detach()}

        return m(next(data_iter), pos, None), loss_fn

    model.zero_grad_buffer()
    opt.zero_grad()
    with perturbed_step(model, step) if perturbed else contextlib.nullcontext():
        get_forward_backward_func()(forward_step_func=step_fn, data_iterator=iter([batch]), model=[model],
                                    num_microbatches=1, seq_length=8, micro_batch_size=2, forward_only=False)
    assert opt.step()[0]
    sched.step(1)


def _tp_group(name: str):
    return ps.get_expert_tensor_parallel_group() if ".local_experts." in name else ps.get_tensor_model_parallel_group()


def full(model, which: str = "trained") -> dict[str, torch.Tensor]:
    """The whole model's tensors on every rank (TP-gathered, every stage and expert), by single-stage
    name: ``trained`` the adapters and sigmas, ``base`` the rest."""
    inner = unwrap_model(model)
    gated = inner.config.gated_linear_unit
    local = {}
    for name, p in inner.named_parameters():
        trained = is_lora_parameter(p) or getattr(p, "is_alp_sigma", False)
        if trained == (which == "trained"):
            local[global_name(name, inner)] = gather_tp(p.detach(), name, partition_dim_of(p), _tp_group(name),
                                                        gated).clone()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: other tensors ({sorted(set(got) ^ set(want))[:3]})"
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}: {k} differs (max {(got[k] - want[k]).abs().max():.3e})"


def step_rel_diff(after: dict, before: dict, want_after: dict) -> float:
    """The worst difference between two runs' steps, relative to the step's norm, over all tensors: Adam
    normalises each element, so an element with a gradient at float-noise level may step visibly
    differently (a fresh optimizer state instead of the loaded one differs at order 1)."""
    worst = 0.0
    for k in before:
        step, want = after[k] - before[k], want_after[k] - before[k]
        if want.norm() > 0:
            worst = max(worst, ((step - want).norm() / want.norm()).item())
    return worst


def has_adapters(tensors: dict) -> None:
    assert any(k.endswith("_lora.B") and v.abs().max() > 0 for k, v in tensors.items()), "no trained adapter"


# --------------------------------------------------------------------------- dense, distributed optimizer
family, dist_opt = "qwen3", True
ref = work / "dense_ref"
model, opt, sched = make(family, dist_opt)
train_step(model, opt, sched, 0, perturbed=True)
save_checkpoint(ref, model, optimizer=opt, opt_param_scheduler=sched)
first = full(model)
has_adapters(first)
train_step(model, opt, sched, 1, perturbed=False)
second = full(model)

model, opt, sched = make(family, dist_opt)
load_checkpoint(ref, model, optimizer=opt, opt_param_scheduler=sched)
assert_same(full(model), first, "dense resume at DP2")
train_step(model, opt, sched, 1, perturbed=False)
assert_same(full(model), second, "dense step after resume at DP2")
R["exact_resume"].append("qwen3_dp2_distributed")

for tp, pp, sp in ((2, 1, False), (2, 1, True), (1, 2, False)):
    tag = f"qwen3_tp{tp}_pp{pp}_sp{int(sp)}"
    model, opt, sched = make(family, dist_opt, tp, pp, sp)
    load_checkpoint(ref, model, optimizer=opt, opt_param_scheduler=sched)
    assert_same(full(model), first, f"{tag}: load")
    train_step(model, opt, sched, 1, perturbed=False)
    here = full(model)
    worst = step_rel_diff(here, first, second)
    assert worst < STEP_TOL, f"{tag}: the step after the load differs from the reference's (relative {worst:.2e})"
    R["step_rel_diff"] = max(R["step_rel_diff"], worst)
    if tp > 1 and not sp:  # the same checkpoint layout as with SP
        continue
    save_checkpoint(work / tag, model, optimizer=opt, opt_param_scheduler=sched)
    model, opt, sched = make(family, dist_opt)
    load_checkpoint(work / tag, model, optimizer=opt, opt_param_scheduler=sched)
    assert_same(full(model), here, f"{tag}: saved there, loaded at DP2")
    R["loaded"].append(f"{tag} -> dp2")

# --------------------------------------------------------------------------- MoE, plain optimizer
family, dist_opt = "qwen3_moe", False
ref = work / "moe_ep2"
model, opt, sched = make(family, dist_opt, ep=2)
train_step(model, opt, sched, 0, perturbed=True)
save_checkpoint(ref, model, optimizer=opt, opt_param_scheduler=sched)
first = full(model)
has_adapters({k: v for k, v in first.items() if ".local_experts." in k})
train_step(model, opt, sched, 1, perturbed=False)
second = full(model)

model, opt, sched = make(family, dist_opt, ep=2)
load_checkpoint(ref, model, optimizer=opt, opt_param_scheduler=sched)
assert_same(full(model), first, "moe resume at EP2")
train_step(model, opt, sched, 1, perturbed=False)
assert_same(full(model), second, "moe step after resume at EP2")
R["exact_resume"].append("qwen3_moe_ep2_plain")

for tp, sp in ((1, False), (2, True)):  # the experts' optimizer state cannot leave EP>1: weights only
    tag = f"qwen3_moe_ep2 -> tp{tp}_sp{int(sp)}_ep1"
    model, _, _ = make(family, dist_opt, tp, 1, sp)
    load_checkpoint(ref, model)
    assert_same(full(model), first, tag)
    R["loaded"].append(tag)

# --------------------------------------------------------------------------- base weights alone
family = "qwen3"
base_model, _, _ = make(family, True, with_lora=False)
save_checkpoint(work / "base", base_model)
base_full = full(base_model, "base")
model, _, _ = make(family, True, tp=2, seed=1)  # other base weights than the checkpoint's
init = full(model)
try:
    load_checkpoint(work / "base", model)
    raise AssertionError("a checkpoint without adapters loaded strictly into a LoRA model")
except ValueError as err:
    assert "holds no LoRA adapters" in str(err) and "base_only=True" in str(err), err
    R["refusal"] = str(err)
load_checkpoint(work / "base", model, base_only=True)
assert_same(full(model, "base"), base_full, "base_only: base weights")
assert_same(full(model), init, "base_only: adapters and sigmas keep their initial values")
plain, _, _ = make(family, True, tp=2, with_lora=False, seed=1)
load_checkpoint(work / "dense_ref", plain, base_only=True)
assert_same(full(plain, "base"), base_full, "base_only: a LoRA checkpoint's base into a model without adapters")
R["base_only"] = True

if rank() == 0:
    Path(result_path).write_text(json.dumps(R))
print("OK", R)
