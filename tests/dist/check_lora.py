"""LoRA under tensor/sequence/pipeline/expert parallelism (2 gloo ranks): the adapters' A is the same
under every layout, and the logits, the adapters-off logits and every adapter gradient (after
Megatron DDP's finalize_model_grads, which sums the sequence-parallel partial gradients over TP)
equal the single-rank model's.

Usage: torchrun --nproc_per_node 2 check_lora.py FAMILY RESULT.json
"""

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from common import build, full_state, global_name, load_full_state, pipeline_logits, rank, reinit, tokens
from megatron_alp.config import LoRAConfig
from megatron_alp.models.lora import adapters_disabled, lora_state
from megatron_alp.models.sharding import gather_tp, partition_dim_of, shard
from megatron_alp.training.optim import wrap_for_training

family, result_path = sys.argv[1], sys.argv[2]
MOE = family == "qwen3_moe"
LORA = LoRAConfig(enabled=True, rank=4, alpha=8.0,
                  target_modules=["linear_qkv", "linear_proj"] + (["experts"] if MOE else ["linear_fc1", "linear_fc2"]))
TOL, GRAD_TOL = 2e-5, 1e-4  # fp32; different reduction orders across shards


def tp_of(name: str):
    """(group, rank, size) of the tensor parallelism a parameter is sharded over."""
    if ".local_experts." in name:
        return (ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_world_size())
    return (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size())


def train_step(ddp, batch) -> None:
    """Forward + backward of an LM loss through Megatron's schedule, which ends with
    finalize_model_grads (wrap_for_training sets it)."""
    ddp.zero_grad_buffer()
    b, s = batch.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    labels = torch.roll(batch, -1, dims=1)

    def step_fn(data_iter, m):
        out = m(next(data_iter), pos, None)

        def loss_fn(logits):
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels).mean()
            return loss, {"loss": loss.detach()}

        return out, loss_fn

    get_forward_backward_func()(
        forward_step_func=step_fn, data_iterator=iter([batch]), model=[ddp], num_microbatches=1,
        seq_length=s, micro_batch_size=b, forward_only=False,
    )


def adapter_grads(ddp) -> dict[str, torch.Tensor]:
    """This stage's adapter gradients (DDP's main_grad), TP-gathered, keyed by single-stage names."""
    model = ddp.module
    gated = model.config.gated_linear_unit
    out = {}
    for name, p in lora_state(model).items():
        assert p.grad is None and p.main_grad is not None, name
        out[global_name(name, model)] = gather_tp(p.main_grad.detach(), name, partition_dim_of(p), tp_of(name)[0],
                                                  gated).clone()
    return out


def logits_pair(model, batch):
    adapted = pipeline_logits(model, batch)
    with adapters_disabled(model):
        base = pipeline_logits(model, batch)
    return adapted, base


batch = tokens(b=2, s=12)

# ------------------------------------------------------------------ reference: TP=1, PP=1 (DP=2)
par = reinit(1, 1)
torch.manual_seed(0)
ref = build(family, par, lora=LORA)
g = torch.Generator().manual_seed(3)
with torch.no_grad():
    for name, p in lora_state(ref).items():
        if name.endswith(".B"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
full = full_state(ref)
ref_logits, ref_base = logits_pair(ref, batch)
assert (ref_logits - ref_base).abs().max() > 1e-3, "the adapters did not change the logits"
ref_ddp = wrap_for_training(ref, par)
train_step(ref_ddp, batch)
ref_grads = adapter_grads(ref_ddp)
assert all(v.abs().sum() > 0 for v in ref_grads.values()), "an adapter got no gradient"

layouts = [(2, 1, False, 1), (2, 1, True, 1), (1, 2, False, 1)]
if MOE:  # Megatron requires SP with TP for MoE (expert TP = TP = 2 there); add expert parallel
    layouts = [(2, 1, True, 1), (1, 2, False, 1), (1, 1, False, 2)]
R = {"layouts": [], "max_logit_diff": 0.0, "max_grad_rel_diff": 0.0}
for tp, pp, sp, ep in layouts:
    tag = f"tp{tp}_pp{pp}_sp{int(sp)}_ep{ep}"
    par = reinit(tp, pp, sp, ep=ep)
    torch.manual_seed(0)
    model = build(family, par, lora=LORA)
    gated = model.config.gated_linear_unit
    for name, p in lora_state(model).items():  # A is drawn on its full shape, then sharded
        if name.endswith(".A"):
            _, r, size = tp_of(name)
            want = shard(full[global_name(name, model)], name, partition_dim_of(p), r, size, gated)
            assert torch.equal(p.detach(), want), f"{tag}: {name} differs from the single-rank A"
    load_full_state(model, full)
    logits, base = logits_pair(model, batch)
    if logits is not None:
        diff = max((logits - ref_logits).abs().max().item(), (base - ref_base).abs().max().item())
        assert diff < TOL, f"{tag}: max |logit diff| {diff} >= {TOL}"
        R["max_logit_diff"] = max(R["max_logit_diff"], diff)
    ddp = wrap_for_training(model, par)
    train_step(ddp, batch)
    worst = 0.0
    for key, grad in adapter_grads(ddp).items():
        want = ref_grads[key]
        rel = ((grad - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        assert rel < GRAD_TOL, f"{tag}: {key} gradient differs from the single-rank one (relative {rel:.2e})"
        worst = max(worst, rel)
    worst_t = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
    R["max_grad_rel_diff"] = max(R["max_grad_rel_diff"], worst_t.item())
    R["layouts"].append(tag)
if rank() == 1:
    json.dump(R, open(result_path, "w"))
print("OK", family, R)
