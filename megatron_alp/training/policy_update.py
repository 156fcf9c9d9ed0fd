"""Megatron forward/backward passes of the RL step: logprob passes and perturbed policy updates.

Both go through Megatron-Core's pipeline schedules, so TP/PP/SP/EP, recomputation and gradient
reduction are Megatron's own. The training logprob passes (old policy, reference policy) run
outside ``perturbed_step`` and are never perturbed; the update pass runs inside it. Only
diagnostics ask :func:`compute_logprobs` for a perturbed forward (``perturb_step``: sigma
calibration, ``megatron-alp intervene``). On an MoE model each
pass takes a :class:`~megatron_alp.training.routing_replay.PassRouting` (which experts it replays, what it
records; :mod:`megatron_alp.training.routing_replay`).

Loss scaling: each micro-batch's policy loss comes back from :func:`policy_loss` already divided
by the mini-batch's global token/sequence counts (over all micro-batches and data-parallel
ranks). Megatron divides a micro-batch loss by the number of micro-batches and DDP averages
gradients over data-parallel ranks; both are undone here, so the gradient is exactly that of the
mini-batch loss in the configured aggregation mode.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import unwrap_model

from megatron_alp.algorithms.mismatch import mismatch_stats
from megatron_alp.algorithms.policy_loss import LossInputs, loss_counts, policy_loss
from megatron_alp.config import LossConfig
from megatron_alp.data.trajectory import Trajectory
from megatron_alp.models.output_layer import emitting_hidden, output_weight
from megatron_alp.runtime.comm import comm_device
from megatron_alp.training.logprobs import linear_token_logprobs, token_logprobs
from megatron_alp.training.micro_batch import Batching, MicroBatch, micro_batches
from megatron_alp.training.perturbation import next_microbatch, perturbed_step
from megatron_alp.training.rl_batch import RLBatch, build_rl_batch
from megatron_alp.training.routing_replay import PassRouting, routing_pass
from megatron_alp.training.step_metrics import StepMetrics


def _pad_multiple(model_config) -> int:
    return ps.get_tensor_model_parallel_world_size() if model_config.sequence_parallel else 1


def _cut(model, batch: RLBatch, batching: Batching, pad_id: int, thd: bool) -> list[MicroBatch]:
    """Micro-batches for ``model``'s layout: rows padded to the TP size under sequence parallelism;
    packed into one THD row for Transformer Engine (of one length under pipeline parallelism: one
    p2p shape per pass), into masked rows for Megatron's local attention. Under expert parallelism
    every data-parallel rank runs as many micro-batches as the one with the most (each MoE layer's
    all-to-all needs the whole expert-parallel group)."""
    kw = dict(pad_id=pad_id, pad_multiple=_pad_multiple(model.config), one_row=thd,
              equal_length=ps.get_pipeline_model_parallel_world_size() > 1)
    micro = micro_batches(batch, batching, **kw)
    if getattr(model.config, "num_moe_experts", None) and ps.get_expert_model_parallel_world_size() > 1:
        group = ps.get_data_parallel_group()
        count = torch.tensor([len(micro)], dtype=torch.int64, device=comm_device(group))
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=group)
        if int(count.item()) > len(micro):
            micro = micro_batches(batch, batching, min_count=int(count.item()), **kw)
    return micro


def _takes_thd(model) -> bool:
    """Whether the attention takes Megatron's THD packed layout (Transformer Engine); Megatron's
    local DotProductAttention rejects it and gets a block-diagonal mask instead."""
    return not any(isinstance(m, DotProductAttention) for m in unwrap_model(model).modules())


def _forward(model, mb: MicroBatch, thd: bool) -> torch.Tensor:
    """This rank's model output for a micro-batch ``[r, T, ...]`` in the model's own dtype: logits
    ``[.., V/tp]``, or final hidden states ``[.., h]`` inside :func:`emitting_hidden`. Megatron's
    Float16Module (bf16/fp16 training) would upcast the whole output to fp32 on the last stage,
    several GiB per micro-batch at V = 152k; the logprob code upcasts one chunk at a time instead."""
    wrapped = model
    while not isinstance(wrapped, Float16Module) and hasattr(wrapped, "module"):
        wrapped = wrapped.module
    kwargs = {"fp32_output": False} if isinstance(wrapped, Float16Module) else {}
    mask = None
    if mb.packed and thd:
        kwargs["packed_seq_params"] = mb.packed_seq_params()
    elif mb.packed:
        mask = mb.attention_mask()
    return model(mb.tokens, mb.positions, mask, **kwargs)


def _token_logprobs(model, output, mb: MicroBatch, *, fused: bool, temperature: float, with_entropy: bool):
    """Logprobs (and entropy) of ``mb``'s targets, in its padded per-sequence view ``[n, L]``."""
    tp_group = ps.get_tensor_model_parallel_group()
    if fused:
        lp, ent = linear_token_logprobs(output, output_weight(model), mb.targets, temperature=temperature,
                                        tp_group=tp_group, with_entropy=with_entropy)
    else:
        lp, ent = token_logprobs(output, mb.targets, temperature=temperature, tp_group=tp_group,
                                 with_entropy=with_entropy)
    return mb.unpack(lp), (mb.unpack(ent) if ent is not None else None)


def _run(model, micro: list[MicroBatch], step_fn, forward_only: bool):
    return get_forward_backward_func()(
        forward_step_func=step_fn,
        data_iterator=iter(micro),
        model=[model],
        num_microbatches=len(micro),
        seq_length=max(m.tokens.shape[1] for m in micro),
        micro_batch_size=max(m.tokens.shape[0] for m in micro),
        forward_only=forward_only,
    )


@torch.no_grad()
def compute_logprobs(
    model, batch: RLBatch, *, batching: Batching, temperature: float, pad_id: int, fused: bool = True,
    routing: Optional[PassRouting] = None, perturb_step: Optional[int] = None,
    on_micro_batch: Optional[Callable[[MicroBatch], None]] = None,
) -> Optional[torch.Tensor]:
    """Unperturbed logprobs of ``batch.targets`` [N, L] (same order and width as ``batch``) on the
    last pipeline stage; None on the other stages. ``fused``: from hidden states and the output
    weight (:func:`~megatron_alp.training.logprobs.linear_token_logprobs`), never materialising the logits.
    ``routing`` (MoE): the experts the pass replays and what it records (into ``batch``).
    ``perturb_step``: instead, the ALP-perturbed logprobs with the noise of that optimizer step's
    update (forward only; diagnostics and benchmarks). ``on_micro_batch(mb)`` is called before each
    micro-batch's forward on this stage (the calibration's hooks learn which positions are padding)."""
    model.eval()
    device = next(model.parameters()).device
    thd = _takes_thd(model)
    micro = _cut(model, batch, batching, pad_id, thd)
    perturbed = perturbed_step(model, perturb_step) if perturb_step is not None else contextlib.nullcontext()

    def step_fn(data_iter, m):
        mb = next(data_iter).to(device)
        begin_routing(mb)
        if on_micro_batch is not None:
            on_micro_batch(mb)
        next_microbatch(m)
        output = _forward(m, mb, thd)

        def collect(out):
            lp, _ = _token_logprobs(m, out, mb, fused=emits, temperature=temperature, with_entropy=False)
            return out.new_zeros(()), {"logprobs": lp.float().cpu()}

        return output, collect

    with perturbed, routing_pass(model, batch, routing, training=False) as begin_routing, \
            emitting_hidden(model, fused) as emits:
        outs = _run(model, micro, step_fn, forward_only=True)
    model.train()
    if not ps.is_pipeline_last_stage():
        return None
    result = torch.zeros(batch.tokens.shape, dtype=torch.float32)
    for mb, out in zip(micro, outs):
        if mb.filler:
            continue
        lp = out["logprobs"]
        result[mb.rows, : lp.shape[1]] = lp
    return result


def probe_mismatch(model, trajectories: list[Trajectory]) -> dict:
    """:func:`~megatron_alp.algorithms.mismatch.mismatch_stats` of the engine's logprobs of
    ``trajectories`` against this model's (unperturbed), the same on every rank: the weight-sync
    check of :class:`~megatron_alp.rollout.distributed.DistributedRollout`."""
    batch = build_rl_batch(trajectories, torch.zeros(len(trajectories)), pad_id=0)
    trainer_lp = compute_logprobs(model, batch, batching=Batching(size=len(trajectories)), temperature=1.0, pad_id=0)
    stats = None
    if ps.is_pipeline_last_stage():
        keep = batch.loss_mask > 0
        stats = mismatch_stats(batch.rollout_logprobs[keep], trainer_lp[keep])
    return from_last_stage(stats)


def from_last_stage(value):
    """The last pipeline stage's ``value`` (a picklable object: loss metrics live there) on every
    rank of its pipeline group."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                            group=ps.get_pipeline_model_parallel_group())
    return box[0]


def global_counts(batch: RLBatch) -> tuple[float, float]:
    """Loss tokens and sequences with loss tokens (:func:`loss_counts`) of a mini-batch, summed over
    data-parallel ranks."""
    tokens, seqs = loss_counts(batch.loss_mask)
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
    batching: Batching,
    temperature: float,
    pad_id: int,
    metrics: StepMetrics,
    fused: bool = True,
    routing: Optional[PassRouting] = None,
) -> dict:
    """One optimizer step on a mini-batch with the perturbed policy forward; returns step stats
    (``computed_tokens`` counts pad tokens too, ``tokens`` only the sequences'). ``routing`` (MoE):
    the experts the pass replays (:mod:`megatron_alp.training.routing_replay`)."""
    model.train()
    device = next(model.parameters()).device
    thd = _takes_thd(model)
    micro = _cut(model, batch, batching, pad_id, thd)
    tokens, seqs = global_counts(batch)
    scale = len(micro) * ps.get_data_parallel_world_size()

    def step_fn(data_iter, m):
        mb = next(data_iter).to(device)
        begin_routing(mb)
        next_microbatch(m)
        output = _forward(m, mb, thd)

        def loss_fn(out):
            lp, ent = _token_logprobs(m, out, mb, fused=emits, temperature=temperature, with_entropy=True)
            b = mb.batch
            inputs = LossInputs(
                logprobs=lp,
                rollout_logprobs=b.rollout_logprobs,
                advantages=b.advantages,
                mask=b.loss_mask,
                old_logprobs=b.old_logprobs,
                ref_logprobs=b.ref_logprobs,
                entropy=ent,
                global_tokens=tokens,
                global_seqs=seqs,
            )
            loss, loss_metrics = policy_loss(loss_cfg, inputs)
            metrics.add(inputs, loss_metrics)
            return loss * scale, {"loss": loss.detach()}

        return output, loss_fn

    for chunk in model_chunks(model):
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    with perturbed_step(model, step), routing_pass(model, batch, routing, training=True) as begin_routing, \
            emitting_hidden(model, fused) as emits:
        _run(model, micro, step_fn, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    return {
        "update_ok": bool(ok),
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "micro_batches": len(micro),
        "computed_tokens": sum(m.computed_tokens for m in micro),
        "tokens": int(batch.lengths.sum().item()),
    }


def model_chunks(model) -> list:
    return model if isinstance(model, list) else [model]
