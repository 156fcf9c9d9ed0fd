"""The `optimizer` section: the model weights' optimizer and learning-rate schedule."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_alp.config.base import _Section


class OptimizerConfig(_Section):
    """Megatron-Core optimizer for the model weights (sigma has its own group, see perturbation)."""

    lr: float = Field(1e-6, ge=0.0, description="Peak learning rate of the model weights.")
    min_lr: float = Field(1e-6, ge=0.0, description="Final learning rate after decay.")
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning-rate decay after warmup."
    )
    lr_warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup.")
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW weight decay (not on norms/biases).")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    clip_grad: float = Field(1.0, ge=0.0, description="Global gradient-norm clip (0 disables).")
