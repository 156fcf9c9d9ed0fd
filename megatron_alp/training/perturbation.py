"""Adaptive Layerwise Perturbation (ALP), paper section 2.2.

During the policy-update forward only, the input hidden states of every chosen transformer
layer h get ``delta_h ~ N(0, sigma_h^2 I)``, drawn independently per token position, with a
learnable ``sigma_h`` (stored as log-sigma so it stays positive). The noise is added before the
layer takes its residual, so it flows through both the residual stream and the attention/MLP
branch. The ``logits`` selection instead perturbs only the final hidden state entering the
output layer (the paper's "logits only" ablation).

Only the training forward is perturbed. Noise is added exclusively inside
``with perturbed_step(model, step):`` -- rollout, old/reference logprob and evaluation passes run
outside it and are bit-identical to the unperturbed model. ``model.training`` is deliberately
not used as the switch, since logprob passes may run in train mode.

Parallelism:
- Sites live on the module they perturb, so each pipeline stage owns the sigmas of its own
  layers, and sigmas are saved with the model's (distributed) checkpoint.
- Noise comes from a dedicated stream of Megatron's RNG tracker, reseeded for every micro-batch
  from (seed, step, micro-batch, data-parallel rank, pipeline rank); layers draw from it in
  order. Megatron's activation recomputation saves and restores tracker states, so a recomputed
  forward sees exactly the same noise.
- Without sequence parallelism the activation is replicated over tensor-parallel ranks and the
  stream ignores the TP rank, so all TP ranks add identical noise and get identical sigma
  gradients. Under sequence parallelism each TP rank holds a different sequence shard: the TP rank
  enters the seed (distinct noise per shard) and sigma is marked ``sequence_parallel`` so
  Megatron's ``finalize_model_grads`` sums its gradient over the TP group, like norm weights.
- Data-parallel reduction is the ordinary DDP gradient reduction.

Precision: noise is sampled in float32 and cast to the activation dtype. In bf16 an increment of
~1e-4 is below the resolution of O(1) activations, as in the bf16 reference setups; sigma still
receives its reparameterised gradient ``sum(dL/dx * eps)`` (dL/dx upcast to float32).

Memory: a perturbed layer keeps no activation-sized tensor for its backward. Instead of letting
autograd save the float32 ``eps`` (4 bytes per element of every perturbed activation), the site
(:class:`_RegeneratedNoise`) keeps the noise stream's generator state from just before the draw
(a few KiB on the CPU, 16 bytes on a GPU) and draws ``eps`` again in the backward from a private
generator set to that state, so the backward reads and advances no global or tracker stream. The
forward output, the noise and the gradients of hidden and sigma are bit-identical to the plain
autograd graph of ``hidden + (sigma * eps).to(dtype)``, whose path :data:`REGENERATE_EPS` keeps
for tests and benchmarks. The price is a second draw of ``eps`` per perturbed layer in the backward.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.utils import unwrap_model

from megatron_alp.config import PerturbationConfig, parse_layer_selection
from megatron_alp.runtime.platform import has_gpu
from megatron_alp.runtime.seeding import derive_seed

NOISE_STREAM = "alp-perturbation-noise"

#: Sigma of every site under ``init_std: auto`` until :mod:`megatron_alp.training.calibration` sets it (the
#: default init_std): a model built for a checkpoint or a converter is then a valid ALP model.
AUTO_PLACEHOLDER = 1e-4

#: True (the default): sites regenerate ``eps`` in the backward (:class:`_RegeneratedNoise`). False:
#: the original autograd graph, which saves ``eps``. Same noise and bit-identical gradients either
#: way; the switch exists for the equality tests and ``benchmarks/bench_alp_overhead.py``, not as a
#: setting.
REGENERATE_EPS = True


def _noise_stream_state(device: torch.device) -> torch.Tensor:
    """The state of the generator a draw on ``device`` uses, inside the noise stream's fork: the
    CUDA device's (seed, offset) on a GPU, the CPU default generator's under the CPU shims (see
    :class:`megatron_alp.runtime.platform._RngShim`)."""
    return torch.cuda.get_rng_state(device) if has_gpu() else torch.get_rng_state()


def _redraw_eps(state: torch.Tensor, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """``eps`` as drawn from a generator in ``state``, from a private generator: the default
    generators and the tracker's streams are neither read nor advanced."""
    if has_gpu():
        gen = torch.Generator(device=device)
        gen.set_state(state)
        return torch.randn(shape, device=device, dtype=torch.float32, generator=gen)
    gen = torch.Generator()
    gen.set_state(state)
    return torch.randn(shape, dtype=torch.float32, generator=gen)


class _RegeneratedNoise(torch.autograd.Function):
    """``hidden + (sigma * eps).to(hidden.dtype)`` keeping only the noise stream's state for the
    backward.

    Forward: the same draw from the same stream and the same arithmetic as the autograd path
    (in place where that cannot change a bit), so output and noise are bit-identical. Backward:
    what autograd does for that graph -- the add passes ``grad`` to hidden unchanged; the cast's
    backward upcasts it to float32; the broadcasting multiply gives ``grad * eps`` and the engine
    reduces it to sigma's shape with ``sum_to`` (``Tensor.sum_to_size``) -- with ``eps`` redrawn.
    Activation recomputation re-runs this forward with the tracker states restored, so it
    snapshots the same state and the backward redraws the same noise.

    On a GPU the issue's target is one fused draw-scale-add kernel (and a fused draw-multiply-
    reduce in the backward); this is written with torch ops (randn, mul, add, sum) because the
    machines it is developed on have no GPU to test a kernel with.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, sigma: torch.Tensor, site: "PerturbationSite") -> torch.Tensor:
        tracker = mcore_random.get_cuda_rng_tracker()
        with tracker.fork(NOISE_STREAM):
            ctx.state = _noise_stream_state(hidden.device)
            eps = torch.randn(hidden.shape, device=hidden.device, dtype=torch.float32)
        ctx.shape, ctx.device, ctx.sigma_shape = hidden.shape, eps.device, sigma.shape
        noise = eps.mul_(sigma)  # == sigma * eps elementwise, without a second float32 buffer
        site.controller.record(site, noise)
        cast = noise.to(hidden.dtype)  # the same tensor when hidden is float32
        if hidden.is_contiguous():
            return cast.add_(hidden)  # == hidden + cast (addition commutes; same contiguous layout)
        return hidden + cast

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_sigma = None
        if ctx.needs_input_grad[1]:
            eps = _redraw_eps(ctx.state, ctx.shape, ctx.device)
            g = grad.to(torch.float32)  # _to_copy's backward, ``grad.to(noise's options)``; a no-op in fp32
            if g.is_contiguous():
                prod = eps.mul_(g)  # == g * eps elementwise, in the same contiguous layout
            else:  # autograd's out-of-place product, whose layout (and so sum order) follows g
                prod = g * eps
            grad_sigma = prod.sum_to_size(ctx.sigma_shape)
        return (grad if ctx.needs_input_grad[0] else None), grad_sigma, None


class PerturbationSite(torch.nn.Module):
    """The learnable sigma of one perturbed activation, and its noise."""

    def __init__(self, controller: "PerturbationController", hidden_size: int, layer: Optional[int]):
        super().__init__()
        cfg = controller.cfg
        n = hidden_size if cfg.shape == "vector" else 1
        std = AUTO_PLACEHOLDER if cfg.init_std == "auto" else cfg.init_std
        init = math.log(std) if std > 0 else float("-inf")
        self.log_sigma = torch.nn.Parameter(torch.full((n,), init, dtype=torch.float32))
        # Attributes read by Megatron (grad reduction, grad-norm dedup) and by our optimizer groups.
        self.log_sigma.is_alp_sigma = True
        self.log_sigma.sequence_parallel = controller.sequence_parallel
        self.log_sigma.tensor_model_parallel = False
        self.layer = layer  # 0-based global layer index; None for the logits site
        self._controller = [controller]  # a list, so the controller is not registered as a child

    @property
    def controller(self) -> "PerturbationController":
        return self._controller[0]

    def sigma(self) -> torch.Tensor:
        return self.log_sigma.float().exp()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden + sigma * eps`` with eps ~ N(0, I) per position from the noise stream."""
        if REGENERATE_EPS:
            return _RegeneratedNoise.apply(hidden, self.sigma().to(hidden.device), self)
        # The autograd path: its multiply saves eps (float32, activation-sized) for sigma's gradient.
        tracker = mcore_random.get_cuda_rng_tracker()
        with tracker.fork(NOISE_STREAM):
            eps = torch.randn(hidden.shape, device=hidden.device, dtype=torch.float32)
        sigma = self.sigma().to(hidden.device)
        noise = sigma * eps
        self.controller.record(self, noise)
        return hidden + noise.to(hidden.dtype)


def _layer_pre_hook(module, args, kwargs):
    site: PerturbationSite = module.alp_perturbation
    if not site.controller.active:
        return None
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = site(kwargs["hidden_states"])
    else:
        args = (site(args[0]),) + tuple(args[1:])
    return args, kwargs


def _output_pre_hook(module, args, kwargs):
    site: PerturbationSite = module.alp_perturbation
    if not site.controller.active:
        return None
    return (site(args[0]),) + tuple(args[1:]), kwargs


class PerturbationController:
    """Owns the switch, the noise stream and the sites of one model chunk."""

    def __init__(self, cfg: PerturbationConfig, sequence_parallel: bool):
        self.cfg = cfg
        self.sequence_parallel = sequence_parallel
        self.sites: list[PerturbationSite] = []
        self.active = False
        self.step = 0
        self.microbatch = 0
        self.recorder: Optional[list] = None

    def begin_microbatch(self) -> None:
        """Reseed the noise stream for the next micro-batch of the current step."""
        shard = ps.get_tensor_model_parallel_rank() if self.sequence_parallel else 0
        seed = derive_seed(
            self.cfg.seed,
            self.step,
            self.microbatch,
            ps.get_data_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            shard,
        )
        _set_tracker_seed(NOISE_STREAM, seed)
        self.microbatch += 1

    def record(self, site: PerturbationSite, noise: torch.Tensor) -> None:
        if self.recorder is not None:
            self.recorder.append((site.layer, noise.detach().clone()))


def _set_tracker_seed(name: str, seed: int) -> None:
    """Point tracker stream ``name`` at a fresh generator state seeded with ``seed``."""
    tracker = mcore_random.get_cuda_rng_tracker()
    if torch.cuda.is_available():
        orig = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)
        state = torch.cuda.get_rng_state()
        mcore_random._set_cuda_rng_state(orig)
    else:
        gen = torch.Generator().manual_seed(seed)
        state = gen.get_state()
    tracker.states_[name] = state


def attach_perturbation(model: torch.nn.Module, cfg: PerturbationConfig) -> PerturbationController:
    """Add perturbation sites to the selected layers of a (single-stage) Megatron GPTModel."""
    config = model.config
    controller = PerturbationController(cfg, sequence_parallel=config.sequence_parallel)
    selected = parse_layer_selection(cfg.layers, config.num_layers)
    if selected is None:
        if getattr(model, "post_process", False):
            site = PerturbationSite(controller, config.hidden_size, layer=None)
            model.output_layer.alp_perturbation = site
            model.output_layer.register_forward_pre_hook(_output_pre_hook, with_kwargs=True)
            controller.sites.append(site)
    else:
        for layer in model.decoder.layers:
            index = layer.layer_number - 1
            if index in selected:
                site = PerturbationSite(controller, config.hidden_size, layer=index)
                layer.alp_perturbation = site
                layer.register_forward_pre_hook(_layer_pre_hook, with_kwargs=True)
                controller.sites.append(site)
    model.alp_controller = controller
    return controller


def controller_of(model: torch.nn.Module) -> Optional[PerturbationController]:
    """The controller of a model, looking through DDP / Float16Module wrappers; None if none."""
    return getattr(unwrap_model(model), "alp_controller", None)


@contextlib.contextmanager
def perturbed_step(models, step: int) -> Iterator[None]:
    """Perturb every forward of ``models`` inside this block: one optimizer step's micro-batch
    forwards, backwards and recomputations. Call :func:`next_microbatch` before each micro-batch's
    forward. Models without perturbation are left alone."""
    controllers = [c for c in (controller_of(m) for m in _as_list(models)) if c is not None]
    for c in controllers:
        c.active, c.step, c.microbatch = True, step, 0
    try:
        yield
    finally:
        for c in controllers:
            c.active = False


def next_microbatch(model) -> None:
    """Start the next micro-batch's noise (no-op without perturbation or outside a step)."""
    c = controller_of(model)
    if c is not None and c.active:
        c.begin_microbatch()


def perturbation_sites(models) -> list[PerturbationSite]:
    """The sites of ``models`` (this rank's chunks), in order."""
    return [s for m in _as_list(models) if (c := controller_of(m)) is not None for s in c.sites]


def set_sigmas(models, sigmas: list[float]) -> None:
    """Set the sigma of every site (in :func:`perturbation_sites` order) in place: the optimizer's
    fp32 copy of a sigma is the parameter itself or a view of it, so it follows."""
    sites = perturbation_sites(models)
    if len(sigmas) != len(sites):
        raise ValueError(f"set_sigmas: {len(sigmas)} values for {len(sites)} perturbation sites")
    with torch.no_grad():
        for site, sigma in zip(sites, sigmas):
            site.log_sigma.fill_(math.log(sigma) if sigma > 0 else float("-inf"))


def sigma_parameters(models) -> list[torch.nn.Parameter]:
    return [p for m in _as_list(models) for p in m.parameters() if getattr(p, "is_alp_sigma", False)]


def sigma_stats(models) -> dict[str, float]:
    """Per-site sigma mean/min/max of this rank's sites, keyed ``sigma/layer_03/mean`` (or
    ``sigma/logits/...``). :func:`gather_sigma_stats` merges the pipeline stages and adds the
    mean over all sites (``sigma/mean``)."""
    out: dict[str, float] = {}
    for m in _as_list(models):
        c = controller_of(m)
        if c is None:
            continue
        for site in c.sites:
            s = site.sigma().detach().float()
            name = "logits" if site.layer is None else f"layer_{site.layer:02d}"
            out[f"sigma/{name}/mean"] = s.mean().item()
            out[f"sigma/{name}/min"] = s.min().item()
            out[f"sigma/{name}/max"] = s.max().item()
    return out


def gather_sigma_stats(models) -> dict[str, float]:
    """:func:`sigma_stats` merged over pipeline stages (every rank gets the full dict)."""
    local = sigma_stats(models)
    if ps.get_pipeline_model_parallel_world_size() == 1:
        merged = local
    else:
        parts: list = [None] * ps.get_pipeline_model_parallel_world_size()
        torch.distributed.all_gather_object(parts, local, group=ps.get_pipeline_model_parallel_group())
        merged = {k: v for p in parts for k, v in p.items()}
    site_means = [v for k, v in merged.items() if k.endswith("/mean")]
    if site_means:
        merged["sigma/mean"] = sum(site_means) / len(site_means)
    return merged


def _as_list(models) -> list:
    return list(models) if isinstance(models, (list, tuple)) else [models]
