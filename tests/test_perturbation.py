"""ALP perturbation: noise statistics, eps regeneration in the backward (bit-identical to the path
that saves eps, no activation-sized tensor kept), and TP/SP/PP/recompute under torchrun.

The single-rank checks build a tiny Megatron GPT in a 1-rank gloo group, which applies the CPU
shims to the whole process; so they run in a one-rank check job (this file run as a script, every
check recorded in a JSON file; helpers.dist_job) and each test below asserts its own check's result.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import dist_job, passed, read_results, record_checks

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ pytest side
SINGLE = dist_job("perturbation_one_rank", "tests/test_perturbation.py", "{dir}/checks.json", nproc=1)
TWO_RANKS = dist_job("perturbation", "check_perturbation.py", "{dir}/r.json")


@pytest.fixture(scope="module")
def single_rank(dist_jobs) -> dict:
    return read_results(dist_jobs.run("perturbation_one_rank") / "checks.json")


@SINGLE
def test_noise_statistics(single_rank):
    """eps ~ N(0, 1) per element: mean 0, std 1 (noise std = sigma per site, per dimension for a vector
    sigma), Gaussian mass within one sigma; uncorrelated between neighbouring positions, batch rows and
    layers; the regenerating path records the same noise bit for bit."""
    r = passed(single_rank, "noise_statistics")
    assert r["worst_std_ratio_error"] < 0.02 and r["worst_corr"] < 0.03, r


@SINGLE
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", ["scalar", "vector"])
def test_site_gradients_bit_identical(single_rank, dtype, shape):
    """One site on a synthetic activation, contiguous and transposed inputs and upstream gradients:
    output, hidden gradient and sigma gradient equal the saved-eps autograd path bit for bit."""
    r = passed(single_rank, f"site_{dtype}_{shape}")
    assert r["cases"] == 4, r


@SINGLE
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", ["scalar", "vector"])
def test_model_gradients_bit_identical(single_rank, dtype, shape):
    """A whole tiny GPT (4 perturbed layers) forward + backward: logits, loss, recorded noise, the
    sigma gradients and every other parameter's gradient equal the saved-eps path bit for bit."""
    r = passed(single_rank, f"model_{dtype}_{shape}")
    assert r["params_compared"] > 10 and r["sigma_grads_nonzero"], r


@SINGLE
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_regenerates_exactly(single_rank, recompute):
    """Megatron activation recomputation re-runs the perturbed forward in the backward: the
    regenerating path still equals the saved-eps path bit for bit and replays each layer's noise."""
    r = passed(single_rank, f"recompute_{recompute}")
    assert r["params_compared"] > 10, r


@SINGLE
def test_no_activation_sized_tensor_saved(single_rank):
    """saved_tensors_hooks over the model's forward: with regeneration ALP adds only the sigma-sized
    exp result per site (and keeps a generator state of a few KiB), while the saved-eps path adds
    one float32 activation per perturbed layer."""
    r = passed(single_rank, "saved_bytes")
    assert r["regen_extra_bytes"] <= r["sites"] * r["sigma_bytes"], r
    assert r["saved_extra_bytes"] >= r["sites"] * r["activation_fp32_bytes"], r
    assert r["max_ctx_state_bytes"] <= 8192 and r["regen_nodes"] == r["sites"], r


@SINGLE
def test_backward_leaves_rng_streams_untouched(single_rank):
    """The backward's redraw uses a private generator: the default generator and every tracker
    stream are exactly as the forward left them, with and without recomputation, and end where the
    saved-eps path ends."""
    passed(single_rank, "rng_untouched")


@TWO_RANKS
def test_perturbation_under_tp_sp_pp_and_recompute(dist_jobs):
    """Replicated noise under TP, per-shard noise under SP, TP=2 == TP=1 perturbed logits and sigma
    grads, bit-identical unperturbed passes, sigma=0 == no perturbation, recompute replays the noise,
    layer ranges / logits-only sites, PP stages own their sigmas, regenerated == saved eps under
    TP/SP/PP/recompute (asserted in the script)."""
    r = read_results(dist_jobs.run("perturbation") / "r.json")
    assert r["tp2_logit_diff"] < 2e-5 and r["ref_logit_shift"] > 1e-3 and r["recompute_sites_replayed"] == 4
    assert r["saved_eps_equal_layouts"] == ["tp1", "recompute", "tp2", "sp", "pp"], r


# ---------------------------------------------------------------------- the subprocess (one rank)
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def _setup():
    global torch, alp, par, build, tokens, tensor_parallel
    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    import torch
    from common import build, tokens
    from megatron.core import tensor_parallel

    import megatron_alp.training.perturbation as alp
    from megatron_alp.config import ParallelConfig
    from megatron_alp.runtime.parallel import init_distributed

    par = ParallelConfig()
    init_distributed(par)


def _pert(**kw):
    from megatron_alp.config import PerturbationConfig

    return PerturbationConfig(**{"enabled": True, "init_std": 0.05, **kw})


def _model(dtype="float32", shape="scalar", **kw):
    torch.manual_seed(0)
    model = build("qwen3", par, _pert(shape=shape), dtype=dtype, **kw)
    model.train()
    if shape == "vector":  # distinct sigma per dimension and site
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in alp.sigma_parameters(model):
                p.copy_(torch.empty_like(p).uniform_(-4.0, -2.0, generator=g))
    return model


def _backward(loss) -> None:
    """The autograd engine called directly, as Megatron's schedule does (``custom_backward``):
    ``loss.backward()`` and ``torch.autograd.backward`` enter through the CPU shim's torch-function
    mode, which is off while its handler runs, so a forward recomputed inside that backward would
    allocate Megatron's ``device="cuda"`` masks without the shim and fail."""
    from torch.autograd import Variable

    Variable._execution_engine.run_backward(
        tensors=(loss,), grad_tensors=(torch.ones_like(loss),), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True,
    )


def _step(model, batch, regenerate: bool, step: int = 7, backward: bool = True, record: bool = True):
    """One perturbed forward (+ backward of an LM loss); returns logits, loss, recorded noise, grads."""
    alp.REGENERATE_EPS = regenerate
    controller = alp.controller_of(model)
    controller.recorder = [] if record else None
    model.zero_grad()
    b, s = batch.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    try:
        with alp.perturbed_step(model, step):
            alp.next_microbatch(model)
            logits = model(batch, pos, None)
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), torch.roll(batch, -1, 1)).mean()
            if backward:
                _backward(loss)
    finally:
        alp.REGENERATE_EPS = True
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), controller.recorder, grads


def _assert_same(a, b, what: str) -> int:
    """Bit equality of two _step results; returns the number of parameter gradients compared."""
    (la, lossa, reca, ga), (lb, lossb, recb, gb) = a, b
    assert torch.equal(la, lb), f"{what}: logits differ"
    assert torch.equal(lossa, lossb), f"{what}: loss {lossa} != {lossb}"
    assert len(reca) == len(recb) > 0 and all(
        la_ == lb_ and torch.equal(na, nb) for (la_, na), (lb_, nb) in zip(reca, recb)
    ), f"{what}: recorded noise differs"
    assert ga.keys() == gb.keys(), f"{what}: different parameters got gradients"
    for name in ga:
        assert torch.equal(ga[name], gb[name]), (
            f"{what}: {name} gradient differs, max {(ga[name] - gb[name]).abs().max().item():.3e}")
    return len(ga)


def _corr(x, y) -> float:
    x, y = x.flatten().double(), y.flatten().double()
    x, y = x - x.mean(), y - y.mean()
    return abs((x @ y / (x.norm() * y.norm())).item())


@check
def check_noise_statistics():
    batch = tokens(b=8, s=128)
    worst_std, worst_corr = 0.0, 0.0
    for shape in ("scalar", "vector"):
        model = _model(shape=shape)
        saved = _step(model, batch, regenerate=False, backward=False)[2]
        regen = _step(model, batch, regenerate=True, backward=False)[2]
        assert [layer for layer, _ in regen] == [0, 1, 2, 3]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(saved, regen)), "regenerating path drew other noise"
        sigmas = [site.sigma().detach() for site in alp.controller_of(model).sites]
        eps_all = []
        for (layer, noise), sigma in zip(regen, sigmas):
            s, b, h = noise.shape
            assert noise.dtype == torch.float32 and (s, b, h) == (128, 8, model.config.hidden_size)
            eps = noise / sigma  # standardised per dimension
            n = eps.numel()
            assert abs(eps.mean().item()) < 5 / n ** 0.5, f"layer {layer}: mean {eps.mean().item()}"
            worst_std = max(worst_std, abs(eps.std().item() - 1.0))
            assert abs((eps.abs() < 1).double().mean().item() - 0.6827) < 0.01, f"layer {layer}: not Gaussian"
            if shape == "vector":  # each dimension's std is its own sigma (8 * 128 samples each)
                per_dim = noise.reshape(-1, h).std(0) / sigma
                assert (per_dim - 1).abs().max() < 0.2, f"layer {layer}: per-dimension std off"
            else:
                assert abs(noise.std().item() / sigma.item() - 1) < 0.02
            # independent per position: neighbouring tokens, batch rows; no repeated vector
            worst_corr = max(worst_corr, _corr(eps[1:], eps[:-1]), _corr(eps[:, 1:], eps[:, :-1]))
            assert torch.unique(eps.reshape(-1, h), dim=0).shape[0] == s * b, "repeated noise vector"
            eps_all.append(eps)
        for i in range(len(eps_all)):  # independent per layer
            for j in range(i + 1, len(eps_all)):
                worst_corr = max(worst_corr, _corr(eps_all[i], eps_all[j]))
        assert worst_corr < 5 / eps_all[0].numel() ** 0.5, worst_corr
    assert worst_std < 0.02, worst_std
    return {"worst_std_ratio_error": worst_std, "worst_corr": worst_corr}


def _site_check(dtype_name: str, shape: str):
    from megatron_alp.training.perturbation import PerturbationController, PerturbationSite

    dtype = getattr(torch, dtype_name)
    h = 64
    controller = PerturbationController(_pert(shape=shape), sequence_parallel=False)
    site = PerturbationSite(controller, h, layer=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        site.log_sigma.copy_(torch.empty_like(site.log_sigma).uniform_(-3.0, -1.0, generator=g))
    base = torch.randn(24, 3, h, generator=g).to(dtype)
    upstream = torch.randn(24, 3, h, generator=g).to(dtype)
    cases = 0
    for transpose_input in (False, True):
        for transpose_grad in (False, True):
            runs = []
            for regenerate in (False, True):
                alp.REGENERATE_EPS = regenerate
                hidden = (base.transpose(0, 1).contiguous().transpose(0, 1) if transpose_input else base.clone())
                hidden.requires_grad_(True)
                site.log_sigma.grad = None
                controller.step, controller.microbatch = 5, 0
                controller.begin_microbatch()
                out = site(hidden)
                up = upstream.transpose(0, 1).contiguous().transpose(0, 1) if transpose_grad else upstream
                assert up.is_contiguous() != transpose_grad and hidden.is_contiguous() != transpose_input
                out.backward(up)
                runs.append((out.detach(), hidden.grad, site.log_sigma.grad.clone()))
            alp.REGENERATE_EPS = True
            (o0, h0, s0), (o1, h1, s1) = runs
            tag = f"{dtype_name}/{shape} input {'T' if transpose_input else 'C'} grad {'T' if transpose_grad else 'C'}"
            assert o0.dtype == o1.dtype == dtype and torch.equal(o0, o1), f"{tag}: output differs"
            assert o0.stride() == o1.stride(), f"{tag}: output layout {o1.stride()} != {o0.stride()}"
            assert torch.equal(h0, h1), f"{tag}: hidden grad differs"
            assert torch.equal(s0, s1), f"{tag}: sigma grad {s1} != {s0}"
            assert s0.abs().sum() > 0
            cases += 1
    return {"cases": cases}


def _model_check(dtype: str, shape: str):
    batch = tokens(b=2, s=32)
    model = _model(dtype=dtype, shape=shape)
    saved = _step(model, batch, regenerate=False)
    regen = _step(model, batch, regenerate=True)
    n = _assert_same(saved, regen, f"{dtype}/{shape}")
    sigma = {k: v for k, v in regen[3].items() if "alp_perturbation" in k}
    assert len(sigma) == 4
    assert regen[0].dtype == getattr(torch, dtype)
    return {"params_compared": n, "sigma_grads_nonzero": all(bool(v.abs().sum() > 0) for v in sigma.values())}


for _dt in ("float32", "bfloat16"):
    for _sh in ("scalar", "vector"):
        CHECKS[f"site_{_dt}_{_sh}"] = (lambda d, s: lambda: _site_check(d, s))(_dt, _sh)
        CHECKS[f"model_{_dt}_{_sh}"] = (lambda d, s: lambda: _model_check(d, s))(_dt, _sh)


def _recompute_check(granularity: str):
    batch = tokens(b=2, s=32)
    kw = {"recompute": granularity}
    if granularity == "full":
        kw["recompute_num_layers"] = 1
    model = _model(**kw)
    saved = _step(model, batch, regenerate=False)
    regen = _step(model, batch, regenerate=True)
    n = _assert_same(saved, regen, f"recompute {granularity}")
    rec = regen[2]
    if granularity == "full":  # every layer ran twice: forward, then recomputed in reverse order
        assert len(rec) == 8, [layer for layer, _ in rec]
        firsts, redo = dict(rec[:4]), dict(rec[4:])
        assert all(torch.equal(firsts[k], redo[k]) for k in firsts), "recompute drew new noise"
    plain = _step(_model(), batch, regenerate=True)  # no recomputation: same loss
    assert torch.equal(plain[1], regen[1]), "recomputed loss differs from the plain one"
    return {"params_compared": n}


CHECKS["recompute_full"] = lambda: _recompute_check("full")
CHECKS["recompute_selective"] = lambda: _recompute_check("selective")


@check
def check_saved_bytes():
    batch = tokens(b=4, s=64)
    model = _model()
    h = model.config.hidden_size
    totals = {}
    for variant in ("off", "saved", "regen"):
        alp.REGENERATE_EPS = variant != "saved"
        model.zero_grad()
        nbytes = [0]

        def pack(t):
            nbytes[0] += t.numel() * t.element_size()
            return t

        pos = torch.arange(batch.shape[1]).unsqueeze(0).expand(batch.shape[0], -1)
        ctx = alp.perturbed_step(model, 3) if variant != "off" else _Null()
        with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            alp.next_microbatch(model)
            loss = model(batch, pos, None).float().square().mean()
        alp.REGENERATE_EPS = True
        totals[variant] = nbytes[0]
        if variant == "regen":
            nodes, seen, todo = [], set(), [loss.grad_fn]
            while todo:
                node = todo.pop()
                if node is None or node in seen:
                    continue
                seen.add(node)
                if type(node).__name__ == "_RegeneratedNoiseBackward":
                    nodes.append(node)
                todo.extend(n for n, _ in node.next_functions)
            assert all(len(n.saved_tensors) == 0 for n in nodes)
            state_bytes = max(n.state.numel() * n.state.element_size() for n in nodes)
            regen_nodes = len(nodes)
        _backward(loss)
    sites = len(alp.controller_of(model).sites)
    return {
        "sites": sites, "sigma_bytes": 4, "activation_fp32_bytes": batch.numel() * h * 4, "totals": totals,
        "regen_extra_bytes": totals["regen"] - totals["off"], "saved_extra_bytes": totals["saved"] - totals["off"],
        "max_ctx_state_bytes": state_bytes, "regen_nodes": regen_nodes,
    }


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _rng_snapshot():
    from megatron.core.tensor_parallel import random as mcore_random

    states = {k: (v.clone() if torch.is_tensor(v) else v.get_state())
              for k, v in mcore_random.get_cuda_rng_tracker().get_states().items()}
    out = {"cpu": torch.get_rng_state(), **{f"tracker/{k}": v for k, v in states.items()}}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _same_rng(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@check
def check_rng_untouched():
    batch = tokens(b=2, s=32)
    pos = torch.arange(32).unsqueeze(0).expand(2, -1)
    ends = {}
    for kw in ({}, {"recompute": "full", "recompute_num_layers": 1}):
        model = _model(**kw)
        for regenerate in (False, True):
            alp.REGENERATE_EPS = regenerate
            torch.manual_seed(11)
            with alp.perturbed_step(model, 4):
                alp.next_microbatch(model)
                loss = model(batch, pos, None).float().square().mean()
                before = _rng_snapshot()
                _backward(loss)
                after = _rng_snapshot()
            alp.REGENERATE_EPS = True
            assert _same_rng(before, after), f"backward moved an RNG stream ({kw}, regenerate={regenerate})"
            gen = torch.Generator().manual_seed(0)
            gen.set_state(before["cpu"])
            assert torch.equal(torch.randn(16), torch.randn(16, generator=gen)), "default generator moved"
            ends[(bool(kw), regenerate)] = after
        assert _same_rng(ends[(bool(kw), False)], ends[(bool(kw), True)]), "paths end in different RNG states"
    return {}


if __name__ == "__main__":
    _setup()
    record_checks(CHECKS, sys.argv[1])
