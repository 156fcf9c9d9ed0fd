"""ALP perturbation under tensor/sequence/pipeline parallelism (2 gloo ranks).

Usage: torchrun --nproc_per_node 2 check_perturbation.py RESULT.json
Every check asserts; the JSON records the measured numbers for the pytest side.
"""

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

import megatron_alp.training.perturbation as alp
from common import build, full_state, load_full_state, pipeline_logits, rank, reinit, tokens
from megatron_alp.config import PerturbationConfig
from megatron_alp.training.perturbation import controller_of, next_microbatch, perturbed_step, sigma_parameters

result_path = sys.argv[1]
FAMILY = "qwen3"
R = {}


def pert(**kw) -> PerturbationConfig:
    return PerturbationConfig(**{"enabled": True, "init_std": 0.05, **kw})


def train_step(model, batch, step=0, micro_batches=1, perturb=True):
    """Forward+backward through Megatron's schedule with a vocab-parallel LM loss; returns the
    summed loss on the last stage (None elsewhere)."""
    model.zero_grad()
    b, s = batch.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    labels = torch.roll(batch, -1, dims=1)
    chunks = list(batch.chunk(micro_batches))

    def step_fn(data_iter, m):
        x = next(data_iter)
        next_microbatch(m)
        out = m(x, pos[: x.shape[0]], None)

        def loss_fn(logits):
            lab = labels[: x.shape[0]] if micro_batches == 1 else labels[chunks_idx.pop(0)]
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), lab).mean()
            return loss, {"loss": loss.detach()}

        return out, loss_fn

    chunks_idx = [slice(i * (b // micro_batches), (i + 1) * (b // micro_batches)) for i in range(micro_batches)]
    with (perturbed_step(model, step) if perturb else _null()):
        out = get_forward_backward_func()(
            forward_step_func=step_fn, data_iterator=iter(chunks), model=[model],
            num_microbatches=micro_batches, seq_length=s, micro_batch_size=b // micro_batches, forward_only=False,
        )
    if ps.is_pipeline_last_stage():
        return sum(o["loss"] for o in out).item()
    return None


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def both_paths(tag, model, batch, **kw):
    """train_step with the saved-eps autograd path, then with eps regenerated in the backward (the
    default, whose gradients stay in the model): loss and every gradient bit-identical. The
    recorder, if any, sees only the second run."""
    recorder, controller_of(model).recorder = controller_of(model).recorder, None
    alp.REGENERATE_EPS = False
    try:
        saved_loss = train_step(model, batch, **kw)
    finally:
        alp.REGENERATE_EPS = True
    saved = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    controller_of(model).recorder = recorder
    loss = train_step(model, batch, **kw)
    assert loss == saved_loss, f"{tag}: regenerated-eps loss {loss} != saved-eps {saved_loss}"
    regen = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert regen.keys() == saved.keys() and any("alp_perturbation" in n for n in regen), tag
    for n in regen:
        assert torch.equal(regen[n], saved[n]), f"{tag}: {n} gradient differs between the eps paths"
    R.setdefault("saved_eps_equal_layouts", []).append(tag)
    return loss


def recorded(model):
    c = controller_of(model)
    c.recorder = []
    return c.recorder


def sigma_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if getattr(p, "is_alp_sigma", False)}


def tp_all_equal(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return all(torch.equal(parts[0], p) for p in parts[1:])


batch = tokens(b=4, s=12)

# ---------------------------------------------------------------- reference: TP=1, PP=1 (DP=2)
par = reinit(1, 1)
torch.manual_seed(0)
ref = build(FAMILY, par, pert())
full = full_state(ref)
with perturbed_step(ref, step=5):
    next_microbatch(ref)
    ref_perturbed = pipeline_logits(ref, batch)
ref_clean = pipeline_logits(ref, batch)
assert not torch.equal(ref_perturbed, ref_clean), "perturbation did not change the logits"
ref_loss = both_paths("tp1", ref, batch, step=5)
ref_grads = sigma_grads(ref)
assert all(g.abs().sum() > 0 for g in ref_grads.values()), "sigma got no gradient"
R["ref_logit_shift"] = (ref_perturbed - ref_clean).abs().max().item()

# same (step, micro-batch) -> same noise; next micro-batch -> different noise
rec = recorded(ref)
with perturbed_step(ref, step=5):
    next_microbatch(ref)
    pipeline_logits(ref, batch)
    next_microbatch(ref)
    pipeline_logits(ref, batch)
with perturbed_step(ref, step=5):
    next_microbatch(ref)
    pipeline_logits(ref, batch)
n_sites = len(controller_of(ref).sites)
mb0, mb1, mb0_again = rec[:n_sites], rec[n_sites: 2 * n_sites], rec[2 * n_sites:]
assert all(torch.equal(a[1], b[1]) for a, b in zip(mb0, mb0_again)), "same step/micro-batch gave different noise"
assert not any(torch.equal(a[1], b[1]) for a, b in zip(mb0, mb1)), "two micro-batches shared noise"
assert [layer for layer, _ in mb0] == [0, 1, 2, 3]
controller_of(ref).recorder = None

# perturbation off / outside the step / init 0: bit-identical to the model without perturbation
plain = build(FAMILY, par)
load_full_state(plain, full)
plain.train()
ref.train()
assert torch.equal(pipeline_logits(plain, batch), pipeline_logits(ref, batch)), "unperturbed pass differs"
zero = build(FAMILY, par, pert(init_std=0.0))
load_full_state(zero, {k: v for k, v in full.items() if "alp_perturbation" not in k})
assert all(torch.isneginf(p).all() for p in sigma_parameters(zero))
zero_loss = train_step(zero, batch, step=5)
plain_loss = train_step(plain, batch, perturb=False)
assert zero_loss == plain_loss, f"sigma=0 loss {zero_loss} != unperturbed {plain_loss}"
disabled = build(FAMILY, par, pert(enabled=False))
assert controller_of(disabled) is None and not sigma_parameters(disabled)

# activation recomputation reproduces the noise: same loss and gradients
recomp = build(FAMILY, par, pert(), recompute="full", recompute_num_layers=1)
load_full_state(recomp, full)
rec = recorded(recomp)
recomp_loss = both_paths("recompute", recomp, batch, step=5)
assert recomp_loss == ref_loss, f"recompute loss {recomp_loss} != {ref_loss}"
for (name, g), g_ref in zip(sigma_grads(recomp).items(), ref_grads.values()):
    assert torch.allclose(g, g_ref, rtol=1e-5, atol=1e-9), f"{name}: recompute sigma grad {g} != {g_ref}"
firsts, redo = dict(rec[:n_sites]), dict(rec[n_sites:])  # recomputation runs in reverse layer order
assert len(redo) == n_sites and all(torch.equal(firsts[k], redo[k]) for k in firsts), "recompute drew new noise"
R["recompute_sites_replayed"] = len(redo)

# layer selection
ranged = build(FAMILY, par, pert(layers="1-2"))
logits_only = build(FAMILY, par, pert(layers="logits"))
for m in (ranged, logits_only):
    load_full_state(m, full)
rec_r, rec_l = recorded(ranged), recorded(logits_only)
for m in (ranged, logits_only):
    with perturbed_step(m, step=5):
        next_microbatch(m)
        pipeline_logits(m, batch)
assert [layer for layer, _ in rec_r] == [1, 2], rec_r
assert [layer for layer, _ in rec_l] == [None] and rec_l[0][1].shape[-1] == ranged.config.hidden_size
assert sorted(n for n, _ in ranged.named_parameters() if "alp_perturbation" in n) == [
    "decoder.layers.1.alp_perturbation.log_sigma", "decoder.layers.2.alp_perturbation.log_sigma"]
assert [n for n, _ in logits_only.named_parameters() if "alp_perturbation" in n] == [
    "output_layer.alp_perturbation.log_sigma"]

# ------------------------------------------------- TP=2 without SP: replicated noise, same as TP=1
# The TP=2 job has one data-parallel rank (0), so its noise stream is the TP=1 job's DP rank 0 stream.
dist.broadcast(ref_perturbed, src=0)
for g in ref_grads.values():
    dist.broadcast(g, src=0)
ref_loss_t = torch.tensor([ref_loss])
dist.broadcast(ref_loss_t, src=0)
ref_loss = ref_loss_t.item()
par = reinit(2, 1)
tp2 = build(FAMILY, par, pert())
load_full_state(tp2, full)
rec = recorded(tp2)
with perturbed_step(tp2, step=5):
    next_microbatch(tp2)
    tp2_perturbed = pipeline_logits(tp2, batch)
assert all(tp_all_equal(noise) for _, noise in rec), "TP ranks drew different noise for a replicated activation"
diff = (tp2_perturbed - ref_perturbed).abs().max().item()
assert diff < 2e-5, f"TP=2 perturbed logits differ from TP=1 by {diff}"
controller_of(tp2).recorder = None
tp2_loss = both_paths("tp2", tp2, batch, step=5)
assert abs(tp2_loss - ref_loss) < 1e-5, (tp2_loss, ref_loss)
for (name, g), g_ref in zip(sigma_grads(tp2).items(), ref_grads.values()):
    assert tp_all_equal(g), f"{name}: sigma grad differs across TP ranks"
    assert torch.allclose(g, g_ref, rtol=1e-4, atol=1e-8), f"{name}: TP=2 sigma grad {g} != TP=1 {g_ref}"
R["tp2_logit_diff"] = diff

# ------------------------------------------------- TP=2 with SP: distinct noise per sequence shard
par = reinit(2, 1, sp=True)
sp = build(FAMILY, par, pert())
load_full_state(sp, full)
rec = recorded(sp)
sp_loss = both_paths("sp", sp, batch, step=5)
first = rec[:n_sites]
assert all(noise.shape[0] == batch.shape[1] // 2 for _, noise in first), "SP noise is not per shard"
assert not any(tp_all_equal(noise) for _, noise in first), "SP shards drew identical noise"
grads = sigma_grads(sp)
for p in sigma_parameters(sp):
    assert p.sequence_parallel, "sigma under SP must be marked sequence_parallel for Megatron's TP reduction"
    dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())  # what finalize_model_grads does
assert all(tp_all_equal(p.grad) for p in sigma_parameters(sp))
assert all(g.abs().sum() > 0 for g in grads.values())
R["sp_loss"] = sp_loss

# ------------------------------------------------- PP=2: each stage owns and trains its own sigmas
par = reinit(1, 2)
pp = build(FAMILY, par, pert())
load_full_state(pp, full)
own = sorted(site.layer for site in controller_of(pp).sites)
expected = [0, 1] if ps.get_pipeline_model_parallel_rank() == 0 else [2, 3]
assert own == expected, f"stage {ps.get_pipeline_model_parallel_rank()} owns sigmas of layers {own}"
both_paths("pp", pp, batch, step=5, micro_batches=2)
assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in sigma_parameters(pp)), "PP stage sigma got no grad"

if rank() == 0:
    json.dump(R, open(result_path, "w"))
print("OK", R)
