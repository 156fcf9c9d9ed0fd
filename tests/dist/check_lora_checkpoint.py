"""LoRA adapters in Megatron distributed checkpoints (2 gloo ranks): saved and loaded at any layout,
resumed exactly.

The LoRA models' frozen base is a tiny HF model per family (``WORK/<family>_base``), loaded as a run
loads it; the checkpoints are saved as a run saves them, with ``lora_base`` (no base weights on disk:
every key of their Megatron metadata is an adapter, a sigma, optimizer state or an ``_extra_state``).
Every model that loads one is built with other (random) base weights, as a resume builds it, so the
load must put back the folder's base: checked against a model that loaded the folder itself.

- Dense (qwen3, gated MLP, distributed optimizer): a reference run at DP=2 takes a perturbed step
  (sigmas and adapters get Adam state), saves, and takes a plain step. A fresh model loading that
  checkpoint at the same layout takes the same next step bit for bit. At TP=2, TP=2 with sequence
  parallel and PP=2 the load gives exactly the reference's full adapters and sigmas and the next step
  moves them as the reference's did (to float-sum order); the checkpoints saved at TP=2 with sequence
  parallel (without base weights) and at PP=2 (with them, the earlier format) load back at DP=2 with
  exactly the tensors gathered before that save. The reference checkpoint loads onto a copy of its
  base folder elsewhere (``base_dir``), and is refused, in one line naming the folder and what
  differs, onto a folder of other weights of the same shapes and onto one that is gone.
- MoE (qwen3_moe, experts adapted, plain optimizer): the same exact resume at EP=2 (its own expert
  optimizer); that checkpoint loads at EP=1, and at TP=2 with sequence parallel (expert TP=2), with
  exactly the same full adapters.
- A checkpoint saved without adapters: refused by a LoRA model naming ``base_only``, loaded with
  ``base_only=True`` (base weights from it, adapters as initialised); and a LoRA checkpoint's base
  weights (from its base folder) load into a model without adapters.

Usage: torchrun --nproc_per_node 2 check_lora_checkpoint.py WORK_DIR RESULT.json
"""

import contextlib
import json
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint import FileSystemReader

from common import build, global_name, rank, reinit, tokens
from megatron_alp.config import InputError, LoRAConfig, OptimizerConfig, PerturbationConfig
from megatron_alp.models.hf_weights import load_hf_weights
from megatron_alp.models.lora import is_lora_parameter
from megatron_alp.models.sharding import gather_tp, partition_dim_of
from megatron_alp.models.tiny import make_tiny_model
from megatron_alp.training.dist_checkpoint import load_checkpoint, save_checkpoint
from megatron_alp.training.lora_base import LoRABase
from megatron_alp.training.optim import build_optimizer, wrap_for_training
from megatron_alp.training.perturbation import next_microbatch, perturbed_step

work, result_path = Path(sys.argv[1]), sys.argv[2]
PERT = PerturbationConfig(enabled=True, layers="1-2", init_std=1e-2, lr=5e-2)
OPT = OptimizerConfig(lr=1e-2, min_lr=1e-3, lr_decay_style="cosine", weight_decay=0.1)
TARGETS = {"qwen3": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
           "qwen3_moe": ["linear_qkv", "linear_proj", "experts"]}
STEP_TOL = 1e-2  # the next step at another layout, relative to its norm (float sums in another order)
R = {"exact_resume": [], "loaded": [], "step_rel_diff": 0.0, "adapter_only": [], "with_base": [], "refusals": []}
BASES = {family: work / f"{family}_base" for family in TARGETS}  # the HF folders of the frozen bases
OTHER = work / "qwen3_other"  # qwen3's shapes, other weights
reinit()  # the process group
if rank() == 0:
    for i, (family, folder) in enumerate(BASES.items()):
        make_tiny_model(family, folder, seed=30 + i)
    make_tiny_model("qwen3", OTHER, seed=40)
    shutil.copytree(BASES["qwen3"], work / "qwen3_moved")
dist.barrier()


def lora(family: str) -> LoRAConfig:
    return LoRAConfig(enabled=True, rank=4, alpha=8.0, target_modules=TARGETS[family])


def make(family: str, distributed: bool, tp=1, pp=1, sp=False, ep=1, with_lora=True, seed=0, base=True):
    """A model wrapped for training with its optimizer and scheduler; ``base``: its weights from the
    family's HF folder (as a run starts), else random ones from ``seed`` (as a resume builds it)."""
    par = reinit(tp, pp, sp, ep=ep)
    par.use_distributed_optimizer = distributed
    torch.manual_seed(seed)
    inner = build(family, par, PERT, lora=lora(family) if with_lora else None)
    if base:
        load_hf_weights(inner, BASES[family])
    model = wrap_for_training(inner, par)
    opt, sched = build_optimizer(model, OPT, PERT, par, total_steps=10)
    return model, opt, sched


def save(ckpt: Path, model, opt, sched, family: str, with_base: bool = False) -> None:
    """Save as a LoRA run does (the base folder recorded, no base weights), or ``with_base`` as before."""
    lora_base = None if with_base else LoRABase.of(BASES[family])
    save_checkpoint(ckpt, model, optimizer=opt, opt_param_scheduler=sched, lora_base=lora_base)
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if not re.match(r"(chained_\d+\.)?optimizer\.", k)]
    base = [k for k in model_keys if not k.endswith(("_lora.A", "_lora.B", "log_sigma")) and "._extra_state" not in k]
    assert any(k.endswith("_lora.B") for k in model_keys), f"{ckpt}: no adapter saved"
    if with_base:
        assert "embedding.word_embeddings.weight" in base, f"{ckpt}: saved without its base weights"
        R["with_base"].append(ckpt.name)
    else:
        assert not base, f"{ckpt}: base weights on disk: {base[:3]}"
        R["adapter_only"].append(ckpt.name)


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


def assert_base(model, family: str, what: str) -> None:
    """``model``'s frozen base is exactly the family's HF folder's (a later pipeline stage's copy of a
    tied embedding too)."""
    got, want = full(model, "base"), base_of[family]
    if "output_layer.weight" in got and "output_layer.weight" not in want:
        assert torch.equal(got.pop("output_layer.weight"), want["embedding.word_embeddings.weight"]), what
    assert_same(got, want, what)


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
base_of = {family: full(model, "base")}
train_step(model, opt, sched, 0, perturbed=True)
save(ref, model, opt, sched, family)
first = full(model)
has_adapters(first)
train_step(model, opt, sched, 1, perturbed=False)
second = full(model)

model, opt, sched = make(family, dist_opt, base=False)
load_checkpoint(ref, model, optimizer=opt, opt_param_scheduler=sched)
assert_base(model, family, "dense resume at DP2: the base from its folder")
assert_same(full(model), first, "dense resume at DP2")
train_step(model, opt, sched, 1, perturbed=False)
assert_same(full(model), second, "dense step after resume at DP2")
R["exact_resume"].append("qwen3_dp2_distributed")

for tp, pp, sp in ((2, 1, False), (2, 1, True), (1, 2, False)):
    tag = f"qwen3_tp{tp}_pp{pp}_sp{int(sp)}"
    model, opt, sched = make(family, dist_opt, tp, pp, sp, base=False)
    load_checkpoint(ref, model, optimizer=opt, opt_param_scheduler=sched)
    assert_base(model, family, f"{tag}: the base from its folder")
    assert_same(full(model), first, f"{tag}: load")
    train_step(model, opt, sched, 1, perturbed=False)
    here = full(model)
    worst = step_rel_diff(here, first, second)
    assert worst < STEP_TOL, f"{tag}: the step after the load differs from the reference's (relative {worst:.2e})"
    R["step_rel_diff"] = max(R["step_rel_diff"], worst)
    if tp > 1 and not sp:  # the same checkpoint layout as with SP
        continue
    save(work / tag, model, opt, sched, family, with_base=pp > 1)
    model, opt, sched = make(family, dist_opt, base=False)
    load_checkpoint(work / tag, model, optimizer=opt, opt_param_scheduler=sched)
    assert_base(model, family, f"{tag}: saved there, loaded at DP2: base")
    assert_same(full(model), here, f"{tag}: saved there, loaded at DP2")
    R["loaded"].append(f"{tag} -> dp2")

model, opt, sched = make(family, dist_opt, base=False)  # the base folder moved: named by base_dir
load_checkpoint(ref, model, optimizer=opt, opt_param_scheduler=sched, base_dir=work / "qwen3_moved")
assert_base(model, family, "base_dir: the base from the moved folder")
assert_same(full(model), first, "base_dir: the adapters")
R["moved_base"] = True
for folder, problem in ((OTHER, "holds other weights than the adapters were trained on: the same "),
                        (work / "nowhere", "is gone;")):
    try:
        load_checkpoint(ref, model, optimizer=opt, opt_param_scheduler=sched, base_dir=folder)
        raise AssertionError(f"{ref} loaded onto the base {folder}")
    except InputError as err:
        assert str(err).startswith(f"{ref}: its LoRA base {folder} {problem}") and "\n" not in str(err), err
        R["refusals"].append(str(err))

# --------------------------------------------------------------------------- MoE, plain optimizer
family, dist_opt = "qwen3_moe", False
ref = work / "moe_ep2"
model, opt, sched = make(family, dist_opt, ep=2)
base_of[family] = full(model, "base")
train_step(model, opt, sched, 0, perturbed=True)
save(ref, model, opt, sched, family)
first = full(model)
has_adapters({k: v for k, v in first.items() if ".local_experts." in k})
train_step(model, opt, sched, 1, perturbed=False)
second = full(model)

model, opt, sched = make(family, dist_opt, ep=2, base=False)
load_checkpoint(ref, model, optimizer=opt, opt_param_scheduler=sched)
assert_base(model, family, "moe resume at EP2: the base from its folder")
assert_same(full(model), first, "moe resume at EP2")
train_step(model, opt, sched, 1, perturbed=False)
assert_same(full(model), second, "moe step after resume at EP2")
R["exact_resume"].append("qwen3_moe_ep2_plain")

for tp, sp in ((1, False), (2, True)):  # the experts' optimizer state cannot leave EP>1: weights only
    tag = f"qwen3_moe_ep2 -> tp{tp}_sp{int(sp)}_ep1"
    model, _, _ = make(family, dist_opt, tp, 1, sp, base=False)
    load_checkpoint(ref, model)
    assert_base(model, family, f"{tag}: base")
    assert_same(full(model), first, tag)
    R["loaded"].append(tag)

# --------------------------------------------------------------------------- base weights alone
family = "qwen3"
base_model, _, _ = make(family, True, with_lora=False)
save_checkpoint(work / "base", base_model)
base_full = full(base_model, "base")
model, _, _ = make(family, True, tp=2, seed=1, base=False)  # other base weights than the checkpoint's
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
plain, _, _ = make(family, True, tp=2, with_lora=False, seed=1, base=False)
load_checkpoint(work / "dense_ref", plain, base_only=True)
assert_same(full(plain, "base"), base_full, "base_only: a LoRA checkpoint's base into a model without adapters")
R["base_only"] = True

if rank() == 0:
    Path(result_path).write_text(json.dumps(R))
print("OK", R)
