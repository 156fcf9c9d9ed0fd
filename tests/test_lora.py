"""LoRA on the Megatron model (issue 27, model side): B = 0 is the base model bit for bit, the adapted
model equals the merged weights W + s B A, only adapters (and ALP's sigmas) train, adapters off is
the base model, and bad config is refused naming the key; TP/SP/PP/EP under torchrun.

The single-rank checks build tiny Megatron GPTs in a 1-rank gloo group, which applies the CPU shims to
the whole process; so they run in a one-rank check job (this file run as a script, every check
recorded in a JSON file; helpers.dist_job) and each test below asserts its own check's result, as
tests/test_perturbation.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import dist_job, passed, read_results, record_checks
from safetensors import safe_open

from megatron_alp.config import ConfigError, LoRAConfig, validate_schema

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ pytest side
SINGLE = dist_job("lora_one_rank", "tests/test_lora.py", "{dir}/checks.json", nproc=1)
LAYOUTS = [dist_job(f"lora_{family}", "check_lora.py", family, "{dir}/result.json")
           for family in ("qwen3", "qwen3_moe")]
CHECKPOINTS = dist_job("lora_checkpoint", "check_lora_checkpoint.py", "{dir}", "{dir}/result.json")


@pytest.fixture(scope="module")
def single_rank(dist_jobs) -> dict:
    return read_results(dist_jobs.run("lora_one_rank") / "checks.json")


@SINGLE
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_zero_b_is_the_base_model(single_rank, family):
    """B starts at 0: the adapted model's logits equal the un-adapted model's bit for bit."""
    r = passed(single_rank, f"zero_b_{family}")
    assert r["adapters"] > 0, r


@SINGLE
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_adapted_equals_merged_weights(single_rank, family):
    """With random B the output of one layer is W x + s B A x (plain torch), and the whole model's logits
    equal an un-adapted model loaded with the merged weights W + s B A (experts included for MoE)."""
    r = passed(single_rank, f"merged_{family}")
    assert r["layer_diff"] < 1e-5 and r["logit_diff"] < 1e-4 and r["logit_shift"] > 1e-3, r


@SINGLE
def test_only_adapters_and_sigmas_train(single_rank):
    """Every base parameter is frozen; adapters and ALP's sigmas train; a perturbed forward + backward
    gives gradients to exactly those, and a nonzero one to every A and B."""
    r = passed(single_rank, "trainable")
    assert r["trainable"] == r["adapter_params"] + r["sigmas"] and r["sigmas"] == 4, r


@SINGLE
def test_frozen_base_has_no_grad_buffer_or_optimizer_state(single_rank):
    """Under Megatron DDP and optimizer the gradient buffers and the parameter groups hold exactly the
    adapters and sigmas (sigma in its own group); a step moves them and leaves every base weight as it was."""
    r = passed(single_rank, "optimizer")
    assert r["in_buffers"] == r["in_optimizer"] == r["trainable"] and r["sigma_groups"] == 1, r


@SINGLE
def test_full_recompute_trains_every_adapter(single_rank):
    """Full activation recomputation (reentrant checkpoints of one layer each) with a frozen embedding
    still gives every adapter, the first layer's included, the gradients of the plain backward."""
    r = passed(single_rank, "recompute")
    assert r["max_grad_diff"] < 1e-6, r


@SINGLE
def test_adapters_disabled_is_the_base_model(single_rank):
    """Inside adapters_disabled the logits are the base model's bit for bit; after it, the adapted ones."""
    passed(single_rank, "disabled")


@SINGLE
def test_model_side_refusals(single_rank):
    """A listed target the model lacks is refused naming lora.target_modules; the default list skips the
    dense MLP of an MoE model."""
    r = passed(single_rank, "model_refusals")
    assert r["moe_default_kinds"] == ["linear_proj", "linear_qkv"], r


@pytest.mark.parametrize("lora, expected", [
    ({"rank": 0}, "lora.rank: Input should be greater than 0 (got 0)"),
    ({"rank": -1}, "lora.rank: Input should be greater than 0 (got -1)"),
    ({"target_modules": ["q_proj", "attn"]}, "lora.target_modules: unknown module 'attn'; expected Megatron names "
                                              "linear_qkv, linear_proj, linear_fc1, linear_fc2, experts or Hugging "
                                              "Face names q_proj"),
    ({"target_modules": []}, "lora.target_modules: the list is empty"),
    ({"dropout": 1.0}, "lora.dropout: Input should be less than 1"),
    ({"alpha": 0}, "lora.alpha: Input should be greater than 0"),
])
def test_config_refusals_name_the_key(lora, expected):
    with pytest.raises(ConfigError) as err:
        validate_schema({"model": {"tiny": "qwen3"}, "lora": lora})
    assert expected in str(err.value)
    assert sum(line.startswith("  lora.") for line in str(err.value).splitlines()) == 1


def test_config_names_and_scaling():
    """HF names map onto Megatron's fused layers; alpha defaults to 2 * rank."""
    cfg = LoRAConfig(target_modules=["q_proj", "v_proj", "up_proj", "gate_proj", "down_proj", "linear_qkv"])
    assert cfg.target_modules == ["linear_qkv", "linear_fc1", "linear_fc2"]
    assert LoRAConfig().target_modules == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert LoRAConfig(rank=8).scaling == 2.0 and LoRAConfig(rank=16, alpha=8).scaling == 0.5


@pytest.mark.parametrize("extra,expected", [
    ({"model": {"tiny": "qwen3", "load": "/ckpt/iter_0000010"}},
     "lora.enabled with model.load=/ckpt/iter_0000010: adapters train on a Hugging Face base model"),
    ({"lora": {"enabled": True, "sync": "adapter"}, "rollout": {"engine": "sglang"}},
     "lora.sync: adapter with rollout.engine=sglang, which cannot apply LoRA adapters itself (engines that can: vllm)"),
])
def test_runs_refuse_what_cannot_carry_adapters(extra, expected):
    """A run's config is refused in one line naming the key: adapters on a Megatron checkpoint's base
    (the engine loads the HF base), adapter-only sync to an engine without LoRA support."""
    from megatron_alp.resolve import config_from_dict

    data = {"model": {"tiny": "qwen3"}, "lora": {"enabled": True}}
    for key, section in extra.items():
        data[key] = {**data.get(key, {}), **section}
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert expected in str(err.value), str(err.value)


@LAYOUTS[0]
@LAYOUTS[1]
def test_lora_under_tp_sp_pp_ep(dist_jobs):
    """TP=2 with and without sequence parallel and PP=2 (dense); TP=2 with SP (expert TP 2), PP=2 and EP=2
    (MoE): logits, adapters-off logits and every adapter gradient after Megatron DDP's
    finalize_model_grads equal the single-rank model's (asserted in the script)."""
    for family in ("qwen3", "qwen3_moe"):
        r = read_results(dist_jobs.run(f"lora_{family}") / "result.json")
        assert len(r["layouts"]) == 3 and r["max_logit_diff"] < 2e-5 and r["max_grad_rel_diff"] < 1e-4, r


@CHECKPOINTS
def test_lora_distributed_checkpoints(dist_jobs):
    """Adapters in Megatron distributed checkpoints, saved without the frozen base (its HF folder
    recorded) as a LoRA run saves them: a save/resume takes the uninterrupted run's next step bit for bit
    (dense with the distributed optimizer at DP=2, MoE with the plain one at EP=2), its base read back
    from the folder; a checkpoint loads at TP=2 (with and without SP), PP=2, EP=1 and expert TP=2 with
    exactly the saved full adapters and sigmas and the folder's base, and the next step there is the
    reference's to float-sum order; saved at TP=2+SP (adapters only) or PP=2 (with the base, the earlier
    format) it loads back at DP=2 exactly; it loads onto a copy of its base elsewhere and is refused, in
    one line, onto other weights or a folder that is gone; a checkpoint without adapters loads into a
    LoRA model only with base_only=True (asserted in the script)."""
    work = dist_jobs.run("lora_checkpoint")
    r = read_results(work / "result.json")
    assert len(r["exact_resume"]) == 2 and len(r["loaded"]) == 4 and r["base_only"] and r["moved_base"], r
    assert r["step_rel_diff"] < 1e-2 and "base_only=True" in r["refusal"], r
    assert r["adapter_only"] == ["dense_ref", "qwen3_tp2_pp1_sp1", "moe_ep2"], r
    assert r["with_base"] == ["qwen3_tp1_pp2_sp0"], r
    with safe_open(str(work / "qwen3_base" / "model.safetensors"), framework="pt") as f:
        tensors = len(list(f.keys()))
    other, gone = r["refusals"]
    assert f"qwen3_other holds other weights than the adapters were trained on: the same {tensors} tensors" in other
    assert "nowhere is gone; the checkpoint holds the adapters alone" in gone, gone


# ---------------------------------------------------------------------- the subprocess (one rank)
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def _setup():
    global torch, F, lora, par, build, full_state, load_full_state, tokens, tensor_parallel
    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    import torch
    import torch.nn.functional as F
    from common import build, full_state, load_full_state, tokens
    from megatron.core import tensor_parallel

    import megatron_alp.models.lora as lora
    from megatron_alp.config import ParallelConfig
    from megatron_alp.runtime.parallel import init_distributed

    par = ParallelConfig()
    init_distributed(par)


TARGETS = {"qwen3": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
           "qwen3_moe": ["linear_qkv", "linear_proj", "experts"]}


def _lora_cfg(family="qwen3", **kw):
    return LoRAConfig(**{"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": TARGETS[family], **kw})


def _pair(family, **kw):
    """A base model and a LoRA model on the same base weights."""
    torch.manual_seed(0)
    base = build(family, par)
    full = full_state(base)
    model = build(family, par, lora=_lora_cfg(family), **kw)
    load_full_state(model, full)
    return base, model, full


def _logits(model, batch):
    pos = torch.arange(batch.shape[1]).unsqueeze(0).expand(batch.shape[0], -1)
    return model(batch, pos, None).detach()


def _randomize_b(model, seed=3, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.lora_state(model).items():
            if name.endswith(".B"):
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def _backward(loss) -> None:
    """The autograd engine called directly, as Megatron's schedule does (see tests/test_perturbation.py:
    a recomputed forward inside ``loss.backward()`` would miss the CPU shim)."""
    from torch.autograd import Variable

    Variable._execution_engine.run_backward(
        tensors=(loss,), grad_tensors=(torch.ones_like(loss),), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True,
    )


def _lm_loss(model, batch):
    pos = torch.arange(batch.shape[1]).unsqueeze(0).expand(batch.shape[0], -1)
    logits = model(batch, pos, None)
    return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), torch.roll(batch, -1, 1)).mean()


def _zero_b(family):
    base, model, _ = _pair(family)
    batch = tokens(b=2, s=16)
    assert torch.equal(_logits(model, batch), _logits(base, batch)), "B = 0 changed the logits"
    return {"adapters": len(lora.adapters(model))}


@check
def check_zero_b_qwen3():
    return _zero_b("qwen3")


@check
def check_zero_b_qwen3_moe():
    return _zero_b("qwen3_moe")


def _merged(family):
    base, model, full = _pair(family)
    _randomize_b(model)
    batch = tokens(b=2, s=16)
    # one layer against plain torch: W x + s B A x
    attn = model.decoder.layers[0].self_attention
    x = torch.randn(16, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    out, _ = attn.linear_qkv(x)
    a, b = attn.linear_qkv_lora.A, attn.linear_qkv_lora.B
    expected = F.linear(x, attn.linear_qkv.weight) + 2.0 * F.linear(F.linear(x, a), b)
    layer_diff = (out - expected).abs().max().item()
    # the whole model against the merged weights
    merged = build(family, par)
    load_full_state(merged, {**full, **lora.merged_weights(model)})
    adapted = _logits(model, batch)
    logit_diff = (adapted - _logits(merged, batch)).abs().max().item()
    if family == "qwen3_moe":
        assert any(".experts.local_experts." in n for n in lora.merged_weights(model)), "no expert adapted"
    return {"layer_diff": layer_diff, "logit_diff": logit_diff,
            "logit_shift": (adapted - _logits(base, batch)).abs().max().item()}


@check
def check_merged_qwen3():
    return _merged("qwen3")


@check
def check_merged_qwen3_moe():
    return _merged("qwen3_moe")


@check
def check_trainable():
    from megatron_alp.config import PerturbationConfig
    from megatron_alp.training.perturbation import next_microbatch, perturbed_step

    torch.manual_seed(0)
    model = build("qwen3", par, PerturbationConfig(enabled=True, init_std=0.05), lora=_lora_cfg())
    model.train()
    _randomize_b(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adapter_params = set(lora.lora_state(model))
    sigmas = {n for n, p in model.named_parameters() if getattr(p, "is_alp_sigma", False)}
    assert trainable == adapter_params | sigmas, sorted(trainable ^ (adapter_params | sigmas))
    assert len(adapter_params) == 2 * 4 * model.config.num_layers
    with perturbed_step(model, 1):
        next_microbatch(model)
        _backward(_lm_loss(model, tokens(b=2, s=16)))
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == trainable, sorted(with_grad ^ trainable)
    zero = [n for n in adapter_params if not model.get_parameter(n).grad.abs().sum() > 0]
    assert not zero, f"adapter parameters with a zero gradient: {zero}"
    return {"trainable": len(trainable), "adapter_params": len(adapter_params), "sigmas": len(sigmas)}


@check
def check_optimizer():
    from megatron_alp.config import OptimizerConfig, PerturbationConfig
    from megatron_alp.training.optim import build_optimizer, wrap_for_training
    from megatron_alp.training.perturbation import next_microbatch, perturbed_step

    torch.manual_seed(0)
    pert = PerturbationConfig(enabled=True, init_std=0.05)
    model = build("qwen3", par, pert, lora=_lora_cfg())
    ddp = wrap_for_training(model, par)
    optimizer, _ = build_optimizer(ddp, OptimizerConfig(lr=1e-2, weight_decay=0.1), pert, par, total_steps=2)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    in_buffers = {id(p) for b in ddp.buffers + ddp.expert_parallel_buffers for p in b.params}
    groups = optimizer.param_groups
    in_optimizer = {id(p) for g in groups for p in g["params"]}
    assert in_buffers == trainable and in_optimizer == trainable
    assert not any(hasattr(p, "main_grad") for p in model.parameters() if not p.requires_grad)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    with perturbed_step(ddp, 0):
        next_microbatch(ddp)
        _backward(_lm_loss(ddp, tokens(b=2, s=16)))
    ddp.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok
    for n, p in model.named_parameters():
        moved = not torch.equal(p.detach(), before[n])
        assert moved == p.requires_grad, f"{n}: moved={moved}, trainable={p.requires_grad}"
    return {"trainable": len(trainable), "in_buffers": len(in_buffers), "in_optimizer": len(in_optimizer),
            "sigma_groups": sum(any(getattr(p, "is_alp_sigma", False) for p in g["params"]) for g in groups)}


@check
def check_recompute():
    batch = tokens(b=2, s=16)
    grads = []
    for kw in ({}, {"recompute": "full", "recompute_num_layers": 1}):
        _, model, _ = _pair("qwen3", **kw)
        model.train()
        _randomize_b(model)
        _backward(_lm_loss(model, batch))
        grads.append({n: p.grad for n, p in lora.lora_state(model).items()})
    plain, recomputed = grads
    missing = [n for n in plain if recomputed[n] is None or not recomputed[n].abs().sum() > 0]
    assert not missing, f"no gradient under full recompute: {missing}"
    return {"max_grad_diff": max((plain[n] - recomputed[n]).abs().max().item() for n in plain)}


@check
def check_disabled():
    base, model, _ = _pair("qwen3")
    _randomize_b(model)
    batch = tokens(b=2, s=16)
    adapted = _logits(model, batch)
    with lora.adapters_disabled(model):
        off = _logits(model, batch)
    assert torch.equal(off, _logits(base, batch)), "adapters_disabled is not the base model"
    assert torch.equal(_logits(model, batch), adapted), "the adapters did not come back"
    assert not torch.equal(adapted, off)
    return {}


@check
def check_model_refusals():
    torch.manual_seed(0)
    for family, targets, message in [
        ("qwen3", ["linear_qkv", "experts"], "lora.target_modules: experts not in this dense model"),
        ("qwen3_moe", ["linear_fc1"], "lora.target_modules: linear_fc1 not in this mixture-of-experts model"),
    ]:
        try:
            build(family, par, lora=LoRAConfig(enabled=True, target_modules=targets))
        except ConfigError as err:
            assert str(err).startswith(message) and "\n" not in str(err), str(err)
        else:
            raise AssertionError(f"{family} with {targets} was not refused")
    model = build("qwen3_moe", par, lora=LoRAConfig(enabled=True))
    kinds = sorted({n.split(".")[-2].removesuffix("_lora") for n in lora.lora_state(model)})
    return {"moe_default_kinds": kinds}


if __name__ == "__main__":
    _setup()
    record_checks(CHECKS, sys.argv[1])
