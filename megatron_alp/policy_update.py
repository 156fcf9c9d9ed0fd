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
from megatron.core.transformer.module import Float16Module

from megatron_alp.comm import comm_device
from megatron_alp.config import LossConfig
from megatron_alp.logprobs import token_logprobs
from megatron_alp.metrics import StepMetrics
from megatron_alp.perturbation import next_microbatch, perturbed_step
from megatron_alp.policy_loss import LossInputs, policy_loss
from megatron_alp.rl_batch import RLBatch, build_rl_batch, micro_batches
from megatron_alp.rollout.base import Trajectory
from megatron_alp.rollout.weight_sync import mismatch_stats


def _pad_multiple(model_config) -> int:
    return ps.get_tensor_model_parallel_world_size() if model_config.sequence_parallel else 1


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand(tokens.shape[0], -1)


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """This rank's logits ``[b, s, V/tp]`` in the model's own dtype. Megatron's Float16Module
    (bf16/fp16 training) would upcast the whole tensor to fp32 on the last stage, several GiB per
    micro-batch at V = 152k; :func:`token_logprobs` upcasts one chunk at a time instead."""
    wrapped = model
    while not isinstance(wrapped, Float16Module) and hasattr(wrapped, "module"):
        wrapped = wrapped.module
    kwargs = {"fp32_output": False} if isinstance(wrapped, Float16Module) else {}
    return model(tokens, _positions(tokens), None, **kwargs)


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
        logits = _logits(m, mb.tokens)

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


def probe_mismatch(model, trajectories: list[Trajectory]) -> dict:
    """:func:`~megatron_alp.rollout.weight_sync.mismatch_stats` of the engine's logprobs of
    ``trajectories`` against this model's (unperturbed), the same on every rank: the weight-sync
    check of :class:`~megatron_alp.rollout.distributed.DistributedRollout`."""
    batch = build_rl_batch(trajectories, torch.zeros(len(trajectories)), pad_id=0)
    trainer_lp = compute_logprobs(model, batch, micro_batch_size=len(trajectories), temperature=1.0, pad_id=0)
    stats = None
    if ps.is_pipeline_last_stage():
        keep = batch.loss_mask > 0
        stats = mismatch_stats(batch.rollout_logprobs[keep], trainer_lp[keep])
    if ps.get_pipeline_model_parallel_world_size() > 1:
        box = [stats]
        torch.distributed.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                                group=ps.get_pipeline_model_parallel_group())
        stats = box[0]
    return stats


def global_counts(batch: RLBatch) -> tuple[float, float]:
    """Loss tokens and sequences of a mini-batch summed over data-parallel ranks."""
    tokens, seqs = float(batch.loss_mask.sum().item()), float(len(batch))
    if ps.get_data_parallel_world_size() == 1:
        return tokens, seqs
    group = ps.get_data_parallel_group()
    counts = torch.tensor([tokens, seqs], dtype=torch.float64, device=comm_device(group))
    torch.distributed.all_reduce(counts, group=group)
    return tuple(counts.tolist())


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
        logits = _logits(m, mb.tokens)

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
