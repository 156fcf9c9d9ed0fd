"""Vocab-parallel logprobs and policy losses under TP=2, and metric reduction over DP=2 (2 gloo ranks).

1. Synthetic logits: each rank takes its vocabulary slice of the same full tensor; TP=2 logprobs,
   entropy, every loss and the gathered logits-gradients equal TP=1 (fused and reference path).
2. A real tiny Megatron model at TP=2 vs TP=1: logprobs, entropy, loss and every parameter's
   gradient agree.
3. TP=1 (so DP=2): each rank holds half the sequences in micro-batches; StepMetrics.reduce over
   the DP group and the summed micro-batch losses equal one process computing on all sequences.

Usage: torchrun --nproc_per_node 2 check_tp_loss.py RESULT.json
Every check asserts; the JSON records the measured differences for the pytest side.
"""

import json
import math
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from common import build, full_state, load_full_state, rank, reinit, tokens
from megatron_alp.config import LossConfig
from megatron_alp.training.logprobs import reference_token_logprobs, token_logprobs
from megatron_alp.training.step_metrics import StepMetrics
from megatron_alp.models.sharding import gather_tp, partition_dim_of
from megatron_alp.algorithms.policy_loss import POLICY_LOSSES, LossInputs, policy_loss

result_path = sys.argv[1]
R = {}
TOL = 1e-5


def max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def loss_cfg(name: str) -> LossConfig:
    return LossConfig(name=name, kl_coef=0.01, entropy_coef=0.01)  # each loss's default clip range


def side_inputs(lp_like: torch.Tensor, seed: int) -> dict:
    """Rollout / old / reference logprobs near ``lp_like``, advantages of both signs, padded mask."""
    g = torch.Generator().manual_seed(seed)
    b, s = lp_like.shape
    base = lp_like.detach()
    mask = torch.ones(b, s)
    for i in range(b):
        mask[i, : 1 + i % 3] = 0  # prompt
        mask[i, s - i % 2:] = 0  # right padding
    return dict(
        rollout_logprobs=base + 0.3 * torch.randn(b, s, generator=g),
        old_logprobs=base + 0.2 * torch.randn(b, s, generator=g),
        ref_logprobs=base + 0.2 * torch.randn(b, s, generator=g),
        advantages=torch.randn(b, generator=g),
        mask=mask,
    )


def tp_gather_last(t: torch.Tensor) -> torch.Tensor:
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def tp_all_equal(t: torch.Tensor) -> bool:
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return all(torch.equal(parts[0], p) for p in parts[1:])


def run_loss(cfg, logits, targets, side, temperature, group=None, fused=True):
    if fused:
        lp, ent = token_logprobs(logits, targets, temperature=temperature, tp_group=group, with_entropy=True,
                                 chunk_tokens=5)
    else:
        lp, ent = reference_token_logprobs(logits, targets, temperature, with_entropy=True)
    loss, _ = policy_loss(cfg, LossInputs(logprobs=lp, entropy=ent, **side))
    loss.backward()
    return lp.detach(), ent.detach(), loss.detach()


# ------------------------------------------------------------ 1. synthetic vocab-parallel logits
par = reinit(tp=2)
group = ps.get_tensor_model_parallel_group()
tp_rank = ps.get_tensor_model_parallel_rank()
B, S, V = 4, 11, 1000
g = torch.Generator().manual_seed(0)
full = torch.randn(B, S, V, generator=g) * 3
targets = torch.randint(0, V, (B, S), generator=g)
lo, hi = tp_rank * V // 2, (tp_rank + 1) * V // 2
worst = {"logprobs": 0.0, "entropy": 0.0, "loss": 0.0, "grad": 0.0, "grad_vs_reference": 0.0}
for temperature in (1.0, 0.7):
    lp_ref, _ = reference_token_logprobs(full, targets, temperature)
    side = side_inputs(lp_ref, seed=1)
    for name in POLICY_LOSSES:
        cfg = loss_cfg(name)
        shard = full[..., lo:hi].clone().requires_grad_()
        lp2, ent2, loss2 = run_loss(cfg, shard, targets, side, temperature, group)
        grad2 = tp_gather_last(shard.grad)
        assert tp_all_equal(lp2) and tp_all_equal(ent2) and tp_all_equal(loss2), f"{name}: TP ranks disagree"
        leaf = full.clone().requires_grad_()
        lp1, ent1, loss1 = run_loss(cfg, leaf, targets, side, temperature)
        leaf_ref = full.clone().requires_grad_()
        run_loss(cfg, leaf_ref, targets, side, temperature, fused=False)
        diffs = {
            "logprobs": max_diff(lp2, lp1), "entropy": max_diff(ent2, ent1), "loss": max_diff(loss2, loss1),
            "grad": max_diff(grad2, leaf.grad), "grad_vs_reference": max_diff(grad2, leaf_ref.grad),
        }
        for k, v in diffs.items():
            assert v < TOL, f"{name} T={temperature}: TP=2 vs TP=1 {k} differ by {v}"
            worst[k] = max(worst[k], v)
        assert leaf.grad.abs().sum() > 0, f"{name}: no gradient reached the logits"
R["synthetic"] = worst

# ------------------------------------------------------------------ 2. real Megatron model
FAMILY = "qwen2"
batch = tokens(b=3, s=10)
model_targets = torch.roll(batch, -1, dims=1)
pos = torch.arange(batch.shape[1]).unsqueeze(0).expand(batch.shape[0], -1)
cfg = loss_cfg("alp_token")


def model_pass(model, side=None):
    model.zero_grad()
    logits = model(batch, pos, None)
    lp, ent = token_logprobs(logits, model_targets, temperature=0.8, tp_group=ps.get_tensor_model_parallel_group(),
                             with_entropy=True)
    side = side or side_inputs(lp, seed=2)
    loss, _ = policy_loss(cfg, LossInputs(logprobs=lp, entropy=ent, **side))
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = gather_tp(p.grad.detach(), name, partition_dim_of(p), ps.get_tensor_model_parallel_group(),
                                model.config.gated_linear_unit).clone()
    return lp.detach(), ent.detach(), loss.detach(), side, grads


par = reinit(tp=1)
torch.manual_seed(0)
ref_model = build(FAMILY, par)
weights = full_state(ref_model)
lp1, ent1, loss1, side, grads1 = model_pass(ref_model)
par = reinit(tp=2)
tp_model = build(FAMILY, par)
load_full_state(tp_model, weights)
lp2, ent2, loss2, _, grads2 = model_pass(tp_model, side)
model_diffs = {"logprobs": max_diff(lp2, lp1), "entropy": max_diff(ent2, ent1), "loss": max_diff(loss2, loss1)}
for k, v in model_diffs.items():
    assert v < 2e-5, f"model TP=2 vs TP=1: {k} differ by {v}"
assert grads1.keys() == grads2.keys()
rel = max(max_diff(grads2[k], grads1[k]) / max(grads1[k].abs().max().item(), 1e-12) for k in grads1)
assert rel < 1e-4, f"model TP=2 vs TP=1: parameter gradients differ (max relative {rel})"
assert all(g.abs().sum() > 0 for g in grads1.values()), "a parameter got no gradient"
model_diffs["grad_rel"] = rel
R["model"] = model_diffs

# -------------------------------------------------- 3. StepMetrics over DP=2 (TP=1, world 2)
par = reinit(tp=1)
dp_group, dp_rank, dp = ps.get_data_parallel_group(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
assert dp == 2
NSEQ, T = 8, 9
g = torch.Generator().manual_seed(3)
cur = -torch.rand(NSEQ, T, generator=g) * 3
side = side_inputs(cur, seed=4)
side["old_logprobs"] = cur + 0.8 * torch.randn(NSEQ, T, generator=g)  # exercise MIS masking
entropy = torch.rand(NSEQ, T, generator=g) * 2
tokens_all, seqs_all = float(side["mask"].sum()), float(NSEQ)


def rows(index):
    return LossInputs(logprobs=cur[index], entropy=entropy[index], global_tokens=tokens_all, global_seqs=seqs_all,
                      **{k: v[index] for k, v in side.items()})


dp_results = {}
for name in ("token_mis", "alp_seq"):
    cfg = loss_cfg(name)
    whole = StepMetrics()
    full_loss, stats = policy_loss(cfg, rows(slice(None)))
    whole.add(rows(slice(None)), stats)
    expected = whole.reduce(None)
    mine = torch.arange(dp_rank, NSEQ, dp)
    split = StepMetrics()
    local_loss = torch.zeros(())
    for micro in mine.split(2):
        loss, stats = policy_loss(cfg, rows(micro))
        split.add(rows(micro), stats)
        local_loss += loss.detach()
    got = split.reduce(dp_group)
    dist.all_reduce(local_loss, group=dp_group)
    assert abs(local_loss.item() - full_loss.item()) < 1e-6, f"{name}: DP-summed loss {local_loss} != {full_loss}"
    assert got.keys() == expected.keys()
    for k in expected:
        a, b = got[k], expected[k]
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-9 + 1e-6 * abs(b), f"{name} {k}: DP {a} != {b}"
    assert expected["mask/frac"] > 0 if name == "token_mis" else expected["mask/frac"] == 0
    dp_results[name] = {"loss": full_loss.item(), **got}
R["dp_metrics"] = dp_results

if rank() == 0:
    json.dump(R, open(result_path, "w"))
print("OK", json.dumps({k: v for k, v in R.items() if k != "dp_metrics"}))
