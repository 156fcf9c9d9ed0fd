"""Sigma calibrated from the measured mismatch: ``perturbation.init_std: auto``.

The paper's bound (section 3) models the rollout engine as the training policy with a zero-mean
disturbance zeta on every layer's input and bounds KL(perturbed train || engine) by
``-ln(alpha) + C d E||zeta||^2 / (2 sigma^2)``: sigma must be large enough to cover the engine's
disturbance and small enough to keep the policy. Neither size is known before a run, but both
show up as KL divergences on the first batch of rollouts, so sigma is chosen to match them:

1. the mismatch: the k3 estimate of KL(pi_rollout || pi_train) over the batch's response tokens,
   from the engine's logprobs and the old-policy pass (the trainer's ``mismatch/kl_k3``);
2. each perturbed layer's scale: the RMS of its input hidden states over the batch (so the noise
   has the same size relative to the activations it is added to in every layer, as zeta would);
3. a global scale s, searched (secant steps on log KL against log s, where KL grows like s^2 for
   small s) until the k3 estimate of KL(pi_train || pi_train,sigma) over the same tokens, with
   ``sigma_h = s * RMS_h``, is ``calibration_target`` times the mismatch, within 2%.

Both KLs are estimated on the same tokens (samples of the engine) with the same estimator,
mean(r - 1 - log r), so they compare like with like. The search's noise comes from noise-stream
steps no update uses (``-(iteration * NOISE_DRAWS + j + 1)``), the same draws for every candidate
s, so KL(s) is a smooth function of s and the search converges. One draw's KL varies with the
draw (by ~15% on 200 tokens, less on more), so a candidate's KL is the mean over ``NOISE_DRAWS``
draws: the chosen sigma meets the target for the noise the updates will draw, not for one draw.
Cost: KL grows as s^2, so the secant lands within 2% in two or three candidates of
``NOISE_DRAWS`` forward passes each. Every pass is forward-only; the unperturbed passes stay
unperturbed (noise only exists inside :func:`~megatron_alp.training.perturbation.perturbed_step`).

Every rank computes the same statistics (sums reduced over data-parallel ranks, over the
tensor-parallel group for sequence-parallel shards, and the KL broadcast from the last pipeline
stage), so all ranks choose the same s; each stage sets the sigmas of its own layers, in place
(the optimizer's fp32 main copy of a sigma is the parameter itself or a view of it).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core import parallel_state as ps

from megatron_alp.config import PerturbationConfig
from megatron_alp.runtime.comm import comm_device
from megatron_alp.training.micro_batch import Batching
from megatron_alp.training.perturbation import controller_of, perturbation_sites, set_sigmas
from megatron_alp.training.policy_update import compute_logprobs, from_last_stage, model_chunks
from megatron_alp.training.rl_batch import RLBatch
from megatron_alp.training.routing_replay import PassRouting

TOLERANCE = 0.02  # stop when the perturbed KL is within 2% of the target
MAX_EVALUATIONS = 12
FIRST_SCALE = 1e-2  # noise at 1% of each layer's input RMS
NOISE_DRAWS = 4  # the perturbed KL of a candidate scale is the mean over this many noise draws


def calibration_due(cfg: PerturbationConfig, iteration: int) -> bool:
    """Whether the iteration starts with a calibration: the first, and every ``calibrate_every``."""
    if cfg.init_std != "auto":
        return False
    return iteration == 0 or bool(cfg.calibrate_every and iteration % cfg.calibrate_every == 0)


def _hosts(model) -> list:
    """The modules whose input a site perturbs (the layers, or the output layer)."""
    return [m for chunk in model_chunks(model) for m in chunk.modules() if hasattr(m, "alp_perturbation")]


def _all_reduce(values: torch.Tensor, tensor_shards: bool) -> torch.Tensor:
    """Sum over data-parallel ranks (and over the TP group when each TP rank holds a shard)."""
    groups = [ps.get_data_parallel_group()] if ps.get_data_parallel_world_size() > 1 else []
    if tensor_shards and ps.get_tensor_model_parallel_world_size() > 1:
        groups.append(ps.get_tensor_model_parallel_group())
    for group in groups:
        moved = values.to(comm_device(group))
        torch.distributed.all_reduce(moved, group=group)
        values = moved.cpu()
    return values


def k3_kl(logprobs: Optional[torch.Tensor], reference: Optional[torch.Tensor], mask: torch.Tensor) -> float:
    """mean(r - 1 - log r) with log r = reference - logprobs over the masked tokens of all
    data-parallel ranks: the k3 estimate of KL(pi_logprobs || pi_reference) on samples of the
    first; computed on the last pipeline stage, returned on every rank."""
    value = None
    if ps.is_pipeline_last_stage():
        keep = mask > 0
        d = (reference[keep].double() - logprobs[keep].double())
        sums = _all_reduce(torch.stack([(d.exp() - 1 - d).sum(), torch.tensor(float(keep.sum()), dtype=torch.float64)]),
                           tensor_shards=False)
        value = float(sums[0] / sums[1].clamp(min=1))
    return from_last_stage(value)


def layer_input_rms(model, batch: RLBatch, passes: dict) -> list[float]:
    """RMS of the input of every perturbed site of this rank (in
    :func:`~megatron_alp.training.perturbation.perturbation_sites` order) over one unperturbed forward of
    ``batch`` (padding positions included). The squares are summed on the activations' device,
    without an upcast copy or a host sync per layer."""
    hosts = _hosts(model)
    squares: list = [0.0] * len(hosts)
    counts = [0] * len(hosts)

    def hook(index):
        def record(module, args, kwargs):
            hidden = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach()
            squares[index] = squares[index] + torch.linalg.vector_norm(hidden, dtype=torch.float32) ** 2
            counts[index] += hidden.numel()
        return record

    handles = [h.register_forward_pre_hook(hook(i), with_kwargs=True) for i, h in enumerate(hosts)]
    try:
        compute_logprobs(model, batch, **passes)
    finally:
        for h in handles:
            h.remove()
    sequence_parallel = any(c.sequence_parallel for m in model_chunks(model) if (c := controller_of(m)) is not None)
    sums = torch.tensor([[float(q), float(n)] for q, n in zip(squares, counts)], dtype=torch.float64)
    sums = _all_reduce(sums, tensor_shards=sequence_parallel)
    rms = (sums[:, 0] / sums[:, 1].clamp(min=1)).sqrt().tolist()
    by_host = {id(h.alp_perturbation): r for h, r in zip(hosts, rms)}
    return [by_host[id(s)] for s in perturbation_sites(model_chunks(model))]


def _next_scale(history: list[tuple[float, float]], target: float) -> float:
    """Secant step on log KL(log s); KL ~ s^2 at first. A draw too small to move any logprob
    (KL 0) grows s tenfold; one so large that the logprobs overflow (KL inf or nan) shrinks it tenfold."""
    s, kl = history[-1]
    if not math.isfinite(kl):
        return s / 10
    if kl <= 0:
        return s * 10
    positive = [(a, b) for a, b in history if 0 < b < math.inf]
    slope = 2.0
    if len(positive) >= 2:
        (s0, k0), (s1, k1) = positive[-2], positive[-1]
        if s0 != s1 and k0 != k1:
            slope = min(max(math.log(k1 / k0) / math.log(s1 / s0), 0.5), 4.0)
    factor = (target / kl) ** (1.0 / slope)
    return s * min(max(factor, 1e-3), 1e3)


def calibrate_sigma(model, batch: RLBatch, cfg: PerturbationConfig, *, iteration: int, batching: Batching,
                    temperature: float, pad_id: int, fused: bool, replay: Optional[str] = None) -> dict[str, float]:
    """Set every site's sigma from ``batch`` (with ``old_logprobs``): see the module docstring.
    ``replay``: the routing field the update pass replays on an MoE model. Returns the
    ``calibration/*`` metrics; the sigmas of the chosen scale are set on return."""
    passes = dict(batching=batching, temperature=temperature, pad_id=pad_id, fused=fused,
                  routing=PassRouting(replay=replay) if replay else None)
    measured = k3_kl(batch.rollout_logprobs, batch.old_logprobs, batch.loss_mask)
    target = cfg.calibration_target * measured
    rms = layer_input_rms(model, batch, passes)
    if not target > 0:  # engine and trainer agree to the last bit: nothing to cover
        set_sigmas(model, [0.0] * len(rms))
        return {"calibration/train_engine_kl": measured, "calibration/target_kl": 0.0,
                "calibration/perturbed_kl": 0.0, "calibration/scale": 0.0, "calibration/evaluations": 0.0}
    history: list[tuple[float, float]] = []
    scale = FIRST_SCALE
    for _ in range(MAX_EVALUATIONS):
        set_sigmas(model, [scale * r for r in rms])
        draws = [compute_logprobs(model, batch, perturb_step=-(iteration * NOISE_DRAWS + j + 1), **passes)
                 for j in range(NOISE_DRAWS)]
        history.append((scale, sum(k3_kl(batch.old_logprobs, d, batch.loss_mask) for d in draws) / NOISE_DRAWS))
        if abs(history[-1][1] / target - 1) <= TOLERANCE:
            break
        scale = _next_scale(history, target)
    scale, kl = min(history, key=lambda h: abs(math.log(h[1] / target)) if 0 < h[1] < math.inf else math.inf)
    set_sigmas(model, [scale * r for r in rms])
    return {"calibration/train_engine_kl": measured, "calibration/target_kl": target,
            "calibration/perturbed_kl": kl, "calibration/scale": scale, "calibration/evaluations": float(len(history))}


def calibration_line(cal: dict, sigmas: dict, target: float, iteration: int) -> str:
    """What a calibration chose, for the run's terminal: ``cal`` is :func:`calibrate_sigma`'s result
    and ``sigmas`` the model's :func:`~megatron_alp.training.perturbation.gather_sigma_stats`."""
    layers = [v for k, v in sigmas.items() if k.endswith("/mean") and k != "sigma/mean"]
    return (f"sigma calibrated at iteration {iteration}: {cal['calibration/scale']:.3g} x layer-input RMS = "
            f"{min(layers):.3g}..{max(layers):.3g}; KL(train || perturbed) {cal['calibration/perturbed_kl']:.3g} "
            f"for a target of {cal['calibration/target_kl']:.3g} ({target:g} x the engine-train KL "
            f"{cal['calibration/train_engine_kl']:.3g}), {int(cal['calibration/evaluations'])} perturbed passes")
