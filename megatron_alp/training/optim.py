"""Wrap the policy for training: mixed precision, Megatron DDP, optimizer, LR schedule.

The ALP sigmas get their own parameter group (own learning rate, weight decay from the
perturbation config, optionally a constant LR) through Megatron's ``config_overrides``, and stay
float32 even when the model trains in bf16: log-sigma changes by ~lr per step, far below bf16
resolution around log(1e-4) ~ -9.2.
"""

from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module

from megatron_alp.config import OptimizerConfig, ParallelConfig, PerturbationConfig


def wrap_for_training(model, parallel: ParallelConfig):
    """Float16Module (bf16/fp16 models) + Megatron DDP with fp32 gradient buffers."""
    config = model.config
    if config.bf16 or config.fp16:
        model = Float16Module(config, model)
        for p in model.parameters():
            if getattr(p, "is_alp_sigma", False):
                p.data = p.data.float()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=bool(parallel.use_distributed_optimizer),
    )
    model = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    return model


def build_optimizer(model, opt: OptimizerConfig, pert: PerturbationConfig, parallel: ParallelConfig, total_steps: int):
    """Megatron optimizer (AdamW) + scheduler; sigma in its own group."""
    config = model.config
    mcfg = MegatronOptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=bool(parallel.use_distributed_optimizer),
    )
    sigma_min_lr = pert.lr if pert.lr_schedule == "constant" else pert.lr * (opt.min_lr / opt.lr if opt.lr else 1.0)
    wd_mult = (pert.weight_decay / opt.weight_decay) if opt.weight_decay else 0.0
    if pert.weight_decay and not opt.weight_decay:
        raise ValueError(
            "perturbation.weight_decay > 0 needs optimizer.weight_decay > 0 (Megatron scales decay per group)"
        )
    # Megatron's standard rule (no decay on biases and 1-D params) minus the sigmas, which are 1-D
    # too but get their own group: Megatron refuses two overrides that disagree on a parameter.
    no_decay = ParamKey(
        name="*.bias",
        predicate=ParamPredicate(
            name="1d_not_alp_sigma", fn=lambda p: p.dim() == 1 and not getattr(p, "is_alp_sigma", False)
        ),
    )
    overrides = {
        no_decay: {"wd_mult": 0.0},
        # `is_decoupled_lr` (true: sigma has its own LR) also keeps this group's Megatron identifier
        # (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) distinct from the no-decay group's,
        # which Megatron's optimizer checkpoint loading needs to tell the two groups apart.
        ParamKey(attr="is_alp_sigma"): {"max_lr": pert.lr, "min_lr": sigma_min_lr, "wd_mult": wd_mult,
                                         "is_decoupled_lr": True},
    }
    optimizer = get_megatron_optimizer(mcfg, [model], config_overrides=overrides)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if opt.lr_warmup_steps else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=opt.lr_warmup_steps,
        lr_decay_steps=max(total_steps, 1),
        lr_decay_style=opt.lr_decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def learning_rates(optimizer) -> dict[str, float]:
    """Current LR of the model weights and of sigma (for logging)."""
    out = {}
    for group in optimizer.param_groups:
        is_sigma = any(getattr(p, "is_alp_sigma", False) for p in group["params"])
        out["lr/sigma" if is_sigma else "lr"] = group["lr"]
    return out

