"""Megatron forward/backward passes of the RL step: logprob passes and perturbed policy updates.

Both go through Megatron-Core's pipeline schedules, so TP/PP/SP/EP, recomputation and gradient
reduction are Megatron's own. Logprob passes (old policy, reference policy) run outside
``perturbed_step`` and are never perturbed; the update pass runs inside it.

Loss scaling: each micro-batch's policy loss comes back from :func:`policy_loss` already divided
by the mini-batch's global token/sequence counts (over all micro-batches and data-parallel
ranks). Megatron divides a micro-batch loss by the number of micro-batches and DDP averages
gradients over data-parallel ranks; both are undone here, so the gradient is exactly that of the
mini-batch loss in the configured aggregation mode.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_alp.config import LossConfig
from megatron_alp.logprobs import token_logprobs
from megatron_alp.metrics import StepMetrics
from megatron_alp.perturbation import next_microbatch, perturbed_step
from megatron_alp.policy_loss import LossInputs, policy_loss
from megatron_alp.rl_batch import RLBatch, micro_batches


def _pad_multiple(model_config) -> int:
    return ps.get_tensor_model_parallel_world_size() if model_config.sequence_parallel else 1


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand(tokens.shape[0], -1)


def _run(model, micro: list[RLBatch], step_fn, forward_only: bool):
    return get_forward_backward_func()(
        forward_step_func=step_fn,
        data_iterator=iter(micro),
        model=[model],
        num_microbatches=len(micro),
        seq_length=max(m.tokens.shape[1] for m in micro),
        micro_batch_size=max(len(m) for m in micro),
        forward_only=forward_only,
    )


@torch.no_grad()
def compute_logprobs(
    model, batch: RLBatch, *, micro_batch_size: int, temperature: float, pad_id: int
) -> Optional[torch.Tensor]:
    """Unperturbed logprobs of ``batch.targets`` [N, L] (same order and width as ``batch``) on the
    last pipeline stage; None on the other stages."""
    model.eval()
    device = next(model.parameters()).device
    order = torch.argsort(batch.lengths, descending=True, stable=True)
    micro = micro_batches(batch, micro_batch_size, _pad_multiple(model.config), pad_id)
    tp_group = ps.get_tensor_model_parallel_group()

    def step_fn(data_iter, m):
        mb = next(data_iter).to(device)
        logits = m(mb.tokens, _positions(mb.tokens), None)

        def collect(output):
            lp, _ = token_logprobs(output, mb.targets, temperature=temperature, tp_group=tp_group)
            return output.new_zeros(()), {"logprobs": lp.float().cpu()}

        return logits, collect

    outs = _run(model, micro, step_fn, forward_only=True)
    model.train()
    if not ps.is_pipeline_last_stage():
        return None
    result = torch.zeros(batch.tokens.shape, dtype=torch.float32)
    for rows, out in zip(order.split(micro_batch_size), outs):
        lp = out["logprobs"]
        result[rows, : min(lp.shape[1], result.shape[1])] = lp[:, : result.shape[1]]
    return result


def global_counts(batch: RLBatch) -> tuple[float, float]:
    """Loss tokens and sequences of a mini-batch summed over data-parallel ranks."""
    counts = torch.tensor([batch.loss_mask.sum().item(), float(len(batch))], dtype=torch.float64)
    if ps.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(counts, group=ps.get_data_parallel_group())
    return counts[0].item(), counts[1].item()


def train_mini_batch(
    model,
    optimizer,
    batch: RLBatch,
    *,
    loss_cfg: LossConfig,
    step: int,
    micro_batch_size: int,
    temperature: float,
    pad_id: int,
    metrics: StepMetrics,
) -> dict:
    """One optimizer step on a mini-batch with the perturbed policy forward; returns step stats."""
    model.train()
    device = next(model.parameters()).device
    micro = micro_batches(batch, micro_batch_size, _pad_multiple(model.config), pad_id)
    tokens, seqs = global_counts(batch)
    scale = len(micro) * ps.get_data_parallel_world_size()
    tp_group = ps.get_tensor_model_parallel_group()

    def step_fn(data_iter, m):
        mb = next(data_iter).to(device)
        next_microbatch(m)
        logits = m(mb.tokens, _positions(mb.tokens), None)

        def loss_fn(output):
            lp, ent = token_logprobs(
                output, mb.targets, temperature=temperature, tp_group=tp_group, with_entropy=True
            )
            inputs = LossInputs(
                logprobs=lp,
                rollout_logprobs=mb.rollout_logprobs,
                advantages=mb.advantages,
                mask=mb.loss_mask,
                old_logprobs=mb.old_logprobs,
                ref_logprobs=mb.ref_logprobs,
                entropy=ent,
                global_tokens=tokens,
                global_seqs=seqs,
            )
            loss, loss_metrics = policy_loss(loss_cfg, inputs)
            metrics.add(inputs, loss_metrics)
            return loss * scale, {"loss": loss.detach()}

        return logits, loss_fn

    for chunk in model_chunks(model):
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    with perturbed_step(model, step):
        _run(model, micro, step_fn, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    return {"update_ok": bool(ok), "grad_norm": float(grad_norm) if grad_norm is not None else float("nan")}


def model_chunks(model) -> list:
    return model if isinstance(model, list) else [model]
