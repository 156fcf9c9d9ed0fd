"""One policy update on a fixed batch moves the policy the way the advantages say, for every loss
and layout (2 gloo ranks): DP=2, TP=2, PP=2, and DP=2 with full activation recomputation.

The updates use the fused linear logprob path (hidden states + output weight; the logits path is
compared with it in check_packing.py). The bf16 layout also records the dtype of the hidden states
the logprob code receives: the model's own (Megatron's Float16Module would upcast them to fp32).

The batch: 8 random prompt+response sequences of a tiny Qwen2; advantages +1 on even rows, -1 on
odd rows; rollout logprobs are the model's own plus small noise (so MIS/TIS weights stay near 1
but are not exactly 1); kl and entropy terms off. To first order one optimizer step raises
J = sum_i A_i log pi(y_i), and with unrelated random responses each group moves its own way.
Recomputation must not change the update at all.

Usage: torchrun --nproc_per_node 2 check_policy_update.py RESULT.json
"""

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from common import build, full_state, load_full_state, reinit
from megatron_alp.config import LossConfig, OptimizerConfig, PerturbationConfig
from megatron_alp.training.step_metrics import StepMetrics
from megatron_alp.training.optim import build_optimizer, wrap_for_training
from megatron_alp.algorithms.policy_loss import get_policy_loss
from megatron_alp.training import policy_update
from megatron_alp.training.logprobs import linear_token_logprobs, token_logprobs
from megatron_alp.training.micro_batch import Batching
from megatron_alp.training.policy_update import compute_logprobs, train_mini_batch
from megatron_alp.training.rl_batch import RLBatch, dp_assignment, dp_shard

LOSSES = ("alp_token", "alp_seq", "grpo", "gspo", "token_mis", "seq_mis", "token_tis", "seq_bypass")
LAYOUTS = {
    "dp2": dict(tp=1, pp=1),
    "tp2": dict(tp=2, pp=1),
    "pp2": dict(tp=1, pp=2),
    "dp2_recompute": dict(tp=1, pp=1, recompute="full"),
    "dp2_bf16": dict(tp=1, pp=1, dtype="bfloat16"),
}
OUTPUT_DTYPES: dict[str, set] = {}  # layout -> dtypes of the model outputs the logprob code received
ROWS, PROMPT, RESPONSE, VOCAB = 8, 4, 6, 512


def fixed_batch() -> RLBatch:
    g = torch.Generator().manual_seed(7)
    length = PROMPT + RESPONSE
    tokens = torch.randint(3, VOCAB, (ROWS, length), generator=g)
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1), value=0)
    mask = torch.zeros(ROWS, length)
    mask[:, PROMPT - 1: length - 1] = 1
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(ROWS)])
    noise = 0.02 * torch.randn(ROWS, length, generator=g)  # rollout = model + noise, set once logprobs are known
    return RLBatch(tokens, targets, mask, noise, adv, torch.full((ROWS,), length))


def seq_logprobs(model, batch: RLBatch, lp=False) -> list[float] | None:
    """Per-row sum of response logprobs (``lp``, or computed now), all rows of the global batch, on
    every rank (None off the last stage)."""
    if lp is False:
        lp = compute_logprobs(model, batch, batching=Batching(size=2), temperature=1.0, pad_id=0)
    local = None if lp is None else (lp * batch.loss_mask).sum(-1).tolist()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ps.get_data_parallel_rank(), ps.is_pipeline_last_stage(), local))
    rows = {}
    for dp_rank, last, values in gathered:
        if last:
            rows[dp_rank] = values
    return [v for r in sorted(rows) for v in rows[r]]


def recording(fn):
    def record(output, *args, **kwargs):
        OUTPUT_DTYPES.setdefault(CURRENT_LAYOUT[0], set()).add(output.dtype)
        return fn(output, *args, **kwargs)
    return record


CURRENT_LAYOUT = [""]
policy_update.token_logprobs = recording(token_logprobs)
policy_update.linear_token_logprobs = recording(linear_token_logprobs)


def one_update(layout: str, name: str, init: dict) -> dict:
    CURRENT_LAYOUT[0] = layout
    spec = LAYOUTS[layout]
    par = reinit(tp=spec["tp"], pp=spec["pp"])
    perturbed = get_policy_loss(name).perturbed
    pert = PerturbationConfig(enabled=True, init_std=1e-3) if perturbed else None
    kw = {k: spec[k] for k in ("recompute", "dtype") if k in spec}
    model = build("qwen2", par, pert, **kw)
    load_full_state(model, init)
    model = wrap_for_training(model, par)
    optimizer, _ = build_optimizer(model, OptimizerConfig(lr=1e-3, min_lr=1e-3, weight_decay=0.0),
                                   pert or PerturbationConfig(), par, total_steps=1)
    batch, _ = dp_shard(fixed_batch(), dp_assignment(ROWS, ps.get_data_parallel_world_size()),
                        ps.get_data_parallel_rank())
    lp = compute_logprobs(model, batch, batching=Batching(size=2), temperature=1.0, pad_id=0)
    before = seq_logprobs(model, batch, lp)  # the old-policy pass is the policy before the update
    if lp is None:  # only the last stage computes logprobs; the earlier stage's values are unused
        lp = torch.zeros(batch.tokens.shape)
    batch.old_logprobs = lp
    batch.rollout_logprobs = (lp + batch.rollout_logprobs) * batch.loss_mask
    cfg = LossConfig(name=name, kl_coef=0.0, entropy_coef=0.0)
    stats = train_mini_batch(model, optimizer, batch, loss_cfg=cfg, step=0, batching=Batching(size=2),
                             temperature=1.0, pad_id=0, metrics=StepMetrics())
    after = seq_logprobs(model, batch)
    assert stats["update_ok"], (layout, name, stats)
    return {"before": before, "after": after}


def main() -> None:
    reinit()
    init = full_state(build("qwen2", reinit()))  # one set of weights for every layout and loss
    results = {}
    for layout in LAYOUTS:
        for name in LOSSES:
            results[f"{layout}/{name}"] = one_update(layout, name, init)
    results["output_dtypes"] = {k: sorted(str(d) for d in v) for k, v in OUTPUT_DTYPES.items()}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)


main()
