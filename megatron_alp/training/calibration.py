"""Sigma calibrated from the measured mismatch: ``perturbation.init_std: auto``.

The paper's bound (section 3) models the rollout engine as the training policy with a zero-mean
disturbance zeta on every layer's input and bounds KL(perturbed train || engine) by
``-ln(alpha) + C d E||zeta||^2 / (2 sigma^2)``: sigma must be large enough to cover the engine's
disturbance and small enough to keep the policy. Neither size is known before a run, but both
show up as KL divergences on the first batch of rollouts, so sigma is chosen to match them:

1. the mismatch: the k3 estimate of KL(pi_rollout || pi_train) over the batch's response tokens,
   from the engine's logprobs and the old-policy pass (the trainer's ``mismatch/kl_k3``);
2. each perturbed layer's scale: the RMS of its input hidden states over the batch's tokens
   (padding excluded), so the noise has the same size relative to the activations it is added to
   in every layer, as zeta would. The RMS is the median over hidden dimensions of each dimension's
   RMS: real checkpoints (Qwen) carry a few "massive activation" dimensions thousands of times
   larger than the rest, which would set the overall RMS alone and the noise far above the size
   of every other dimension.
   With ``perturbation.calibration_mode: per_layer`` or ``per_layer_added`` the size of a layer is
   instead a measured drift of the engine from the trainer (:func:`input_divergence`: the same
   robust RMS, of ``h_engine - h_train`` over the tokens of the batch's first sequences, up to
   ``LAYER_PROBE_TOKENS``), so layers where the engine drifts more get more noise, where the global
   mode gives every layer the same noise-to-activation ratio. ``per_layer_added`` is the paper's
   zeta_h: the drift the engine adds before layer h, with the trainer's input of layer h computed
   from the engine's input of the previous perturbed layer (the noise of that layer, carried forward
   by the network, already covers what came before); ``per_layer`` is the cumulative drift at the
   layer's input, larger with depth. Every drift is at least ``DRIFT_FLOOR`` x the largest
   (:func:`floored`): a layer the engine reproduces exactly (drift 0: the embedding, bf16 on both
   sides) gets little noise, scaled with the others, which the search shrinks with the rest;
3. a global scale s, searched (secant steps on log KL against log s, where KL grows like s^2 for
   small s; s at most what puts the noise at ``MAX_SCALE`` x the input RMS in some layer) until the k3 estimate of KL(pi_train || pi_train,sigma) over
   the same tokens, with ``sigma_h = s * scale_h``, is ``calibration_target`` times the mismatch,
   within 2%.

It never ends silently on a bad sigma. A target no scale up to that bound meets within
``ACCEPTED`` (the perturbed KL saturates once the noise swamps the activations) stops the run with
an :class:`~megatron_alp.config.InputError` naming ``perturbation.calibration_target``. A measured
mismatch that is 0 (an engine bit-identical to the trainer) or not finite gives no size to match:
sigma is then ``perturbation.init_std``'s default with a warning (``calibration/fallback`` 1 and
the terminal line), never 0, whose log-sigma would be -inf with a zero gradient forever, turning
ALP silently into Bypass.

Both KLs are estimated on the same tokens (samples of the engine) with the same estimator,
mean(r - 1 - log r), so they compare like with like. A token whose engine or old-policy logprob is
not finite (NaN, -inf) is left out of both and counted (``calibration/bad_tokens``): one bad engine
logprob does not void the others; only a batch with no finite token left falls back. The search's
noise comes from noise-stream steps no update uses (``-(iteration * NOISE_DRAWS + j + 1)``), the
same draws for every candidate s, so KL(s) is a smooth function of s and the search converges. One
draw's KL varies with the draw (by ~15% on 200 tokens, less on more), so a candidate's KL is the
mean over ``NOISE_DRAWS`` draws: the chosen sigma meets the target for the noise the updates will
draw, not for one draw. Cost: KL grows as s^2, so the secant lands within 2% in two or three
candidates of ``NOISE_DRAWS`` forward passes each. Every pass is forward-only; the unperturbed
passes stay unperturbed (noise only exists inside
:func:`~megatron_alp.training.perturbation.perturbed_step`).

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

from megatron_alp.config import InputError, PerturbationConfig
from megatron_alp.models.routing import to_router
from megatron_alp.runtime.comm import comm_device
from megatron_alp.training.micro_batch import Batching, MicroBatch
from megatron_alp.training.perturbation import controller_of, perturbation_sites, set_sigmas
from megatron_alp.training.policy_update import compute_logprobs, from_last_stage, model_chunks
from megatron_alp.training.rl_batch import RLBatch
from megatron_alp.training.routing_replay import PassRouting

TOLERANCE = 0.02  # stop when the perturbed KL is within 2% of the target
ACCEPTED = 0.25  # the best candidate must be within 25% of the target, else the target is out of reach
MAX_EVALUATIONS = 12
FIRST_SCALE = 1e-2  # noise at 1% of each layer's input RMS
MAX_SCALE = 1.0  # noise as large as the activations it is added to: beyond, the policy is noise
NOISE_DRAWS = 4  # the perturbed KL of a candidate scale is the mean over this many noise draws
FALLBACK_STD = PerturbationConfig.model_fields["init_std"].default  # sigma when there is nothing to match
LAYER_PROBE_TOKENS = 512  # per_layer modes: the tokens whose layer inputs the engine and Megatron both show
DRIFT_FLOOR = 1e-3  # per_layer modes: each layer's size is at least this x the largest layer's
SIZES = {"global": "layer-input RMS", "per_layer": "layer-input divergence engine-train",
         "per_layer_added": "drift added before each layer engine-train"}  # sigma_h = s x this, per mode


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
    first; NaN without a masked token; computed on the last pipeline stage, returned on every rank."""
    value = None
    if ps.is_pipeline_last_stage():
        keep = mask > 0
        d = (reference[keep].double() - logprobs[keep].double())
        sums = _all_reduce(torch.stack([(d.exp() - 1 - d).sum(), torch.tensor(float(keep.sum()), dtype=torch.float64)]),
                           tensor_shards=False)
        value = float(sums[0] / sums[1]) if sums[1] > 0 else math.nan
    return from_last_stage(value)


def finite_tokens(batch: RLBatch) -> tuple[torch.Tensor, float]:
    """The loss mask less the tokens whose engine or old-policy logprob is not finite, so that one bad
    engine logprob leaves that token out instead of voiding the measured KL, and how many tokens
    that leaves out on all data-parallel ranks (returned on every rank)."""
    if not ps.is_pipeline_last_stage():
        return batch.loss_mask, from_last_stage(None)
    finite = batch.rollout_logprobs.isfinite() & batch.old_logprobs.isfinite()
    bad = _all_reduce(((batch.loss_mask > 0) & ~finite).sum().double().reshape(1), tensor_shards=False)
    return batch.loss_mask * finite, from_last_stage(float(bad[0]))


def real_positions(mb: MicroBatch, sequence_parallel: bool) -> torch.Tensor:
    """``[tokens * rows]`` bool in the order of a layer's flattened input ``[tokens, rows, h]`` (this
    rank's sequence shard): True on the sequences' own tokens, False on padding and on a filler."""
    b = mb.batch
    inside = torch.arange(b.tokens.shape[1], device=b.tokens.device) < b.lengths.to(b.tokens.device).unsqueeze(1)
    return to_router(mb.layout(inside & (not mb.filler), fill=False), sequence_parallel)


def robust_rms(sums: torch.Tensor) -> list[float]:
    """Per site, from ``[sites, h + 1]`` rows of per-dimension sums of squares and the token count:
    the median over dimensions of each dimension's RMS (a few massive dimensions move it by a few
    ranks of the median, not by their size)."""
    per_dimension = sums[:, :-1] / sums[:, -1:].clamp(min=1)
    return per_dimension.median(dim=1).values.sqrt().tolist()


def layer_input_rms(model, batch: RLBatch, passes: dict) -> list[float]:
    """Robust RMS of the input of every perturbed site of this rank (in
    :func:`~megatron_alp.training.perturbation.perturbation_sites` order) over one unperturbed forward of
    ``batch``: the median over hidden dimensions of each dimension's RMS over the real tokens
    (padding and filler micro-batches excluded; see the module docstring). Squares are summed per
    dimension on the activations' device, without an upcast copy or a host sync per layer."""
    hosts = _hosts(model)
    squares: list = [0.0] * len(hosts)
    counts: list = [0.0] * len(hosts)
    sequence_parallel = any(c.sequence_parallel for m in model_chunks(model) if (c := controller_of(m)) is not None)
    real: dict = {}  # the current micro-batch's real positions

    def begin(mb: MicroBatch) -> None:
        real["keep"] = real_positions(mb, sequence_parallel)

    def hook(index):
        def record(module, args, kwargs):
            hidden = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach()
            tokens = hidden.reshape(-1, hidden.shape[-1])[real["keep"].to(hidden.device)]
            squares[index] = squares[index] + torch.linalg.vector_norm(tokens, dim=0, dtype=torch.float32) ** 2
            counts[index] += tokens.shape[0]
        return record

    handles = [h.register_forward_pre_hook(hook(i), with_kwargs=True) for i, h in enumerate(hosts)]
    try:
        compute_logprobs(model, batch, on_micro_batch=begin, **passes)
    finally:
        for h in handles:
            h.remove()
    sums = torch.stack([torch.cat([torch.as_tensor(q, dtype=torch.float64).cpu().reshape(-1),
                                   torch.tensor([float(n)], dtype=torch.float64)]) for q, n in zip(squares, counts)])
    rms = robust_rms(_all_reduce(sums, tensor_shards=sequence_parallel))
    by_host = {id(h.alp_perturbation): r for h, r in zip(hosts, rms)}
    return [by_host[id(s)] for s in perturbation_sites(model_chunks(model))]


def probe_sequences(sequences: list[list[int]], budget: int = LAYER_PROBE_TOKENS) -> list[list[int]]:
    """The per-layer probe: the first of ``sequences`` (token ids), ``budget`` tokens in all, the
    last one cut short (a layer's states at a token depend on the tokens before it only)."""
    probe, total = [], 0
    for sequence in sequences:
        take = min(len(sequence), budget - total)
        if take < 1:
            break
        probe.append(list(sequence[:take]))
        total += take
    return probe


def site_layers(model) -> list[int]:
    """The decoder layer (0-based, as ``model.layers.<i>`` of the checkpoint) whose input each
    perturbed site perturbs, in :func:`~megatron_alp.training.perturbation.perturbation_sites` order."""
    by_site = {id(h.alp_perturbation): getattr(h, "layer_number", None) for h in _hosts(model)}
    layers = [by_site[id(s)] for s in perturbation_sites(model_chunks(model))]
    if None in layers:
        raise InputError("perturbation.calibration_mode: per_layer needs decoder-layer sites (not layers: logits)")
    return [n - 1 for n in layers]


def input_divergence(engine: list[dict[str, torch.Tensor]], train: list[dict[str, torch.Tensor]],
                     layers: list[int]) -> list[float]:
    """Per layer in ``layers``: the robust RMS (:func:`robust_rms`) over all tokens of the probe of
    ``h_engine - h_train`` at the layer's input (the ``input`` states of both sides, ``[layers,
    tokens, hidden]`` per sequence)."""
    for i, (e, t) in enumerate(zip(engine, train)):
        if e["input"].shape != t["input"].shape:
            raise ValueError(f"layer probe sequence {i}: the engine's layer inputs are {tuple(e['input'].shape)}, "
                               f"Megatron's {tuple(t['input'].shape)} ([layers, tokens, hidden]): not the same model")
    rows = []
    for layer in layers:
        squares = sum((e["input"][layer].double() - t["input"][layer].double()).square().sum(dim=0)
                      for e, t in zip(engine, train))
        tokens = sum(t["input"].shape[1] for t in train)
        rows.append(torch.cat([squares, torch.tensor([float(tokens)], dtype=torch.float64)]))
    return robust_rms(torch.stack(rows))


def probe_routing(batch: RLBatch, sequences: list[list[int]], replay: Optional[str]
                  ) -> Optional[list[torch.Tensor]]:
    """The experts the probe's Megatron forward replays for ``sequences`` (the first rows of
    ``batch``, cut short): the engine's (``batch.rollout_routing``) where the update pass replays
    them (``replay``: R3), so that the measured drift has no routing flip the update never sees.
    None otherwise: under R2 the update replays the old-policy pass's choice, which is what the
    probe's own unperturbed router chooses."""
    if replay != "rollout_routing":
        return None
    if batch.rollout_routing is None:
        raise RuntimeError("layer probe under moe.routing_replay=r3: the batch carries no engine routing "
                           "(rollout.return_routed_experts)")
    return [batch.rollout_routing[i, : len(s)] for i, s in enumerate(sequences)]


def batch_probe(batch: RLBatch) -> list[list[int]]:
    """:func:`probe_sequences` of ``batch``'s rows (the same on every rank): the sequences whose
    layer inputs the layer probe compares, engine against trainer."""
    return probe_sequences([row[:n] for row, n in zip(batch.tokens.tolist(), batch.lengths.tolist())])


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


def floored(sizes: list[float]) -> list[float]:
    """Each site's size, at least ``DRIFT_FLOOR`` x the largest: a site that does not drift (or far
    less than the others) gets little noise that scales with everyone's, so the search can shrink
    it with the rest, and never sigma 0 (log-sigma -inf, its gradient dead: ALP silently Bypass)."""
    floor = DRIFT_FLOOR * max(sizes)
    return [max(d, floor) for d in sizes]


def _sizes(rms: list[float], divergence: Optional[list[float]], mode: str, measured: float) -> list[float]:
    """Per site, what sigma is ``scale x``: the input RMS (global mode, this pipeline stage's sites; an
    input all zeros, which no trained model has, at the floor), or the :func:`floored` drift of every
    site (per_layer modes, one stage). None is 0, so that no sigma is."""
    if divergence is None:
        return [r if r > 0 else DRIFT_FLOOR * max(rms) for r in rms]
    if not any(d > 0 for d in divergence):
        raise InputError(f"perturbation.calibration_mode: {mode}: the engine-train KL is {measured:.3g} "
                         "but no perturbed layer's input differs between the engine and the trainer on the probe, "
                         "so there is no layer size to scale; use perturbation.calibration_mode: global")
    return floored(divergence)


def _search(model, batch: RLBatch, mask: torch.Tensor, sizes: list[float], target: float, *, scale: float,
            most: float, iteration: int, passes: dict) -> list[tuple[float, float]]:
    """The candidate scales tried and their perturbed KL (the mean over ``NOISE_DRAWS`` draws), until
    one is within ``TOLERANCE`` of ``target`` or ``most`` falls short of it."""
    history: list[tuple[float, float]] = []
    for _ in range(MAX_EVALUATIONS):
        set_sigmas(model, [scale * d for d in sizes])
        draws = [compute_logprobs(model, batch, perturb_step=-(iteration * NOISE_DRAWS + j + 1), **passes)
                 for j in range(NOISE_DRAWS)]
        history.append((scale, sum(k3_kl(batch.old_logprobs, d, mask) for d in draws) / NOISE_DRAWS))
        kl = history[-1][1]
        if abs(kl / target - 1) <= TOLERANCE or (scale >= most and math.isfinite(kl) and kl < target):
            break
        scale = min(_next_scale(history, target), most)
    return history


def calibrate_sigma(model, batch: RLBatch, cfg: PerturbationConfig, *, iteration: int, batching: Batching,
                    temperature: float, pad_id: int, fused: bool, replay: Optional[str] = None,
                    divergence: Optional[list[float]] = None) -> dict[str, float]:
    """Set every site's sigma from ``batch`` (with ``old_logprobs``): see the module docstring.
    ``replay``: the routing field the update pass replays on an MoE model. ``divergence``: per site,
    :func:`input_divergence` of the layer probe (the per_layer modes); None: the layer-input RMS.
    Returns the ``calibration/*`` metrics; the sigmas of the chosen scale are set on return. Raises
    :class:`~megatron_alp.config.InputError` when ``calibration_target`` is out of reach."""
    passes = dict(batching=batching, temperature=temperature, pad_id=pad_id, fused=fused,
                  routing=PassRouting(replay=replay) if replay else None)
    mask, bad = finite_tokens(batch)
    measured = k3_kl(batch.rollout_logprobs, batch.old_logprobs, mask)
    rms = layer_input_rms(model, batch, passes)
    if not (math.isfinite(measured) and measured > 0):  # nothing to match: never sigma 0 (log-sigma -inf)
        set_sigmas(model, [FALLBACK_STD] * len(rms))
        return {"calibration/train_engine_kl": measured, "calibration/target_kl": 0.0,
                "calibration/perturbed_kl": 0.0, "calibration/scale": 0.0, "calibration/evaluations": 0.0,
                "calibration/fallback": 1.0, "calibration/bad_tokens": bad}
    sizes = _sizes(rms, divergence, cfg.calibration_mode, measured)
    target = cfg.calibration_target * measured
    # noise at most as large as the activations it is added to, in every layer
    most = min(MAX_SCALE * r / d for r, d in zip(rms, sizes) if r > 0)
    first = FIRST_SCALE if divergence is None else 1.0  # per layer: first, noise the size of zeta_h
    history = _search(model, batch, mask, sizes, target, scale=min(first, most), most=most, iteration=iteration,
                      passes=passes)
    scale, kl = min(history, key=lambda h: abs(math.log(h[1] / target)) if 0 < h[1] < math.inf else math.inf)
    if not (0 < kl < math.inf and abs(kl / target - 1) <= ACCEPTED):
        raise InputError(
            f"perturbation.calibration_target: {cfg.calibration_target:g} x the engine-train KL {measured:.3g} is out "
            f"of reach: the closest of {len(history)} noise scales (noise at most {MAX_SCALE:g} x each layer's input RMS) gives "
            f"KL {kl:.3g} for {target:.3g}; lower perturbation.calibration_target or set perturbation.init_std to a number")
    set_sigmas(model, [scale * d for d in sizes])
    return {"calibration/train_engine_kl": measured, "calibration/target_kl": target,
            "calibration/perturbed_kl": kl, "calibration/scale": scale, "calibration/evaluations": float(len(history)),
            "calibration/fallback": 0.0, "calibration/per_layer": float(divergence is not None),
            "calibration/bad_tokens": bad}


def calibration_line(cal: dict, sigmas: dict, cfg: PerturbationConfig, iteration: int) -> str:
    """What a calibration chose, for the run's terminal: ``cal`` is :func:`calibrate_sigma`'s result
    and ``sigmas`` the model's :func:`~megatron_alp.training.perturbation.gather_sigma_stats`."""
    layers = [v for k, v in sigmas.items() if k.endswith("/mean") and k != "sigma/mean"]
    bad = int(cal["calibration/bad_tokens"])
    left = f"; {bad} tokens with a non-finite logprob left out" if bad else ""
    if cal.get("calibration/fallback"):
        return (f"WARNING: sigma not calibrated at iteration {iteration}: the engine-train KL is "
                f"{cal['calibration/train_engine_kl']:.3g}, no mismatch to match{left}; every sigma set to "
                f"perturbation.init_std's default {FALLBACK_STD:g}")
    size = SIZES[cfg.calibration_mode]
    return (f"sigma calibrated at iteration {iteration}: {cal['calibration/scale']:.3g} x {size} = "
            f"{min(layers):.3g}..{max(layers):.3g}; KL(train || perturbed) {cal['calibration/perturbed_kl']:.3g} "
            f"for a target of {cal['calibration/target_kl']:.3g} ({cfg.calibration_target:g} x the engine-train KL "
            f"{cal['calibration/train_engine_kl']:.3g}), {int(cal['calibration/evaluations'])} perturbed passes{left}")
