"""Packed, token-budget and fused-linear passes give the padded pass's logprobs, losses, gradients
and updates, on every layout (2 gloo ranks: DP=2, TP=2, TP=2 with sequence parallel, PP=2; or
1 rank).

Per layout, one fixed batch of 8 sequences of different lengths goes through the old-logprob pass
and one optimizer step in five ways: padded rows of 2 with Megatron's output layer making the
logits (the reference), the same with the fused linear logprob path, padded rows under a token
budget, packed rows under a token budget (block-diagonal mask, the local spec's layout), and one
packed row per micro-batch (Transformer Engine's THD layout; here under the mask, with equal
lengths under pipeline parallelism). The optimizer's step is
intercepted to record each rank's reduced gradients (``main_grad``) before it applies them.
ALP runs with ``perturbation.init_std: 0``, so its forward is the unperturbed one and the four
ways must agree (the noise itself depends on the activation layout).

Usage: torchrun --nproc_per_node N check_packing.py RESULT.json LAYOUT [LAYOUT...]
"""

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from common import build, full_state, load_full_state, reinit
from megatron_alp.algorithms.balance import sequence_cost
from megatron_alp.config import LossConfig, OptimizerConfig, PerturbationConfig
from megatron_alp.training.step_metrics import StepMetrics
from megatron_alp.training.micro_batch import Batching
from megatron_alp.training.optim import build_optimizer, wrap_for_training
from megatron_alp.training import policy_update
from megatron_alp.training.policy_update import compute_logprobs, train_mini_batch
from megatron_alp.training.rl_batch import RLBatch, dp_assignment, dp_shard

LAYOUTS = {
    "single": dict(tp=1, pp=1),
    "dp2": dict(tp=1, pp=1),
    "tp2": dict(tp=2, pp=1),
    "tp2_sp": dict(tp=2, pp=1, sp=True),
    "pp2": dict(tp=1, pp=2),
}
WAYS = {
    "padded": (Batching(size=2), False),
    "padded_fused": (Batching(size=2), True),
    "budget": (Batching(max_tokens=40), True),
    "packed": (Batching(max_tokens=40, pack=True), True),
    "packed_one_row": (Batching(max_tokens=40, pack=True), True),
}
CUT = policy_update._cut


def one_row_cut(model, batch, batching, pad_id, thd):
    """The one-row (THD) layout of Transformer Engine, run under the local spec's mask."""
    return CUT(model, batch, batching, pad_id, True)
LOSSES = ("grpo", "alp_seq")
ROWS, VOCAB = 8, 512


def fixed_batch() -> RLBatch:
    g = torch.Generator().manual_seed(11)
    prompts = torch.randint(2, 6, (ROWS,), generator=g)
    responses = torch.randint(1, 14, (ROWS,), generator=g)
    lengths = prompts + responses
    width = int(lengths.max())
    tokens = torch.zeros(ROWS, width, dtype=torch.long)
    mask = torch.zeros(ROWS, width)
    for i in range(ROWS):
        tokens[i, : lengths[i]] = torch.randint(3, VOCAB, (int(lengths[i]),), generator=g)
        mask[i, prompts[i] - 1: lengths[i] - 1] = 1
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1), value=0)
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(ROWS)])
    noise = 0.05 * torch.randn(ROWS, width, generator=g) * mask
    return RLBatch(tokens, targets, mask, noise, adv, lengths)


class RecordingOptimizer:
    """Delegates to Megatron's optimizer; keeps the reduced gradients of the last step."""

    def __init__(self, optimizer, model):
        self.optimizer, self.model, self.grads = optimizer, model, None

    def zero_grad(self):
        return self.optimizer.zero_grad()

    def step(self):
        self.grads = {n: p.main_grad.detach().clone() for n, p in self.model.named_parameters()}
        return self.optimizer.step()


def run_way(layout: str, loss: str, way: str, init: dict, batch: RLBatch) -> dict:
    spec = LAYOUTS[layout]
    par = reinit(tp=spec["tp"], pp=spec["pp"], sp=spec.get("sp", False))
    pert = PerturbationConfig(enabled=True, init_std=0.0) if loss == "alp_seq" else None
    model = build("qwen2", par, pert)
    load_full_state(model, init)
    model = wrap_for_training(model, par)
    optimizer, _ = build_optimizer(model, OptimizerConfig(lr=1e-3, min_lr=1e-3, weight_decay=0.0),
                                   pert or PerturbationConfig(), par, total_steps=1)
    recorder = RecordingOptimizer(optimizer, model)
    batching, fused = WAYS[way]
    policy_update._cut = one_row_cut if way == "packed_one_row" else CUT
    local = RLBatch(**{k: (v.clone() if torch.is_tensor(v) else v) for k, v in vars(batch).items()})
    lp = compute_logprobs(model, local, batching=batching, temperature=1.0, pad_id=0, fused=fused)
    local.old_logprobs = lp if lp is not None else torch.zeros(local.tokens.shape)
    local.rollout_logprobs = (local.old_logprobs + local.rollout_logprobs) * local.loss_mask
    metrics = StepMetrics()
    stats = train_mini_batch(model, recorder, local, loss_cfg=LossConfig(name=loss, kl_coef=0.0, entropy_coef=0.001),
                             step=0, batching=batching, temperature=1.0, pad_id=0, metrics=metrics, fused=fused)
    assert stats["update_ok"], (layout, loss, way, stats)
    reduced = metrics.reduce(ps.get_data_parallel_group()) if ps.is_pipeline_last_stage() else {}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"logprobs": lp, "grads": recorder.grads, "weights": weights, "loss": reduced.get("loss/total"),
            "computed_tokens": stats["computed_tokens"], "micro_batches": stats["micro_batches"]}


def max_rel(a: dict, b: dict) -> float:
    scale = max(v.abs().max().item() for v in a.values()) or 1.0
    return max((a[k] - b[k]).abs().max().item() for k in a) / scale


def main() -> None:
    out_path, layouts = sys.argv[1], sys.argv[2:]
    reinit()
    init = full_state(build("qwen2", reinit()))
    full = fixed_batch()
    results = {}
    for layout in layouts:
        for loss in LOSSES:
            reinit(tp=LAYOUTS[layout]["tp"], pp=LAYOUTS[layout]["pp"], sp=LAYOUTS[layout].get("sp", False))
            dp = ps.get_data_parallel_world_size()
            costs = [sequence_cost(n, 64) for n in full.lengths.tolist()]
            batch, _ = dp_shard(full, dp_assignment(ROWS, dp, 1, costs), ps.get_data_parallel_rank())
            runs = {way: run_way(layout, loss, way, init, batch) for way in WAYS}
            ref = runs["padded"]
            for way, r in runs.items():
                row = {"computed_tokens": r["computed_tokens"], "micro_batches": r["micro_batches"],
                       "grad_rel": max_rel(ref["grads"], r["grads"]),
                       "weight_abs": max((ref["weights"][k] - r["weights"][k]).abs().max().item() for k in ref["weights"])}
                if r["logprobs"] is not None:
                    keep = batch.loss_mask > 0
                    row["logprob_abs"] = (r["logprobs"] - ref["logprobs"])[keep].abs().max().item()
                    row["loss_abs"] = abs(r["loss"] - ref["loss"])
                results[f"{layout}/{loss}/{way}/rank{dist.get_rank()}"] = row
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        merged = {k: v for part in gathered for k, v in part.items()}
        with open(out_path, "w") as f:
            json.dump(merged, f, indent=1)


main()
