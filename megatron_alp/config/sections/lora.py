"""The `lora` section: low-rank adapters on a frozen base, and the layer names they may target."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from megatron_alp.config.base import _Section


#: Megatron-Core's names of the linear layers LoRA can adapt (``experts``: both projections of every
#: routed expert), and the Hugging Face names accepted for them. HF's separate q/k/v (gate/up)
#: projections are one fused Megatron layer, so naming any of them adapts the fused layer.
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts")
LORA_HF_TARGETS = {
    "q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
    "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2",
}


class LoRAConfig(_Section):
    """Low-rank adapters (megatron_alp/models/lora.py): each adapted linear layer computes
    `W x + (alpha / rank) * B A x`; only A and B (and ALP's sigmas) train, the base weights are frozen
    and hold no gradient buffer or optimizer state, and the reference policy is the base model with
    the adapters switched off."""

    enabled: bool = Field(
        False,
        description="Train low-rank adapters on a frozen base instead of the full model. The base comes from "
        "`model.hf_path` (or the tiny model), not `model.load`; checkpoints hold the adapters, sigmas and optimizer "
        "state and record the base's folder and fingerprint instead of its weights (a resume refuses a changed "
        "base), `megatron-alp convert mcore-to-peft` exports the adapters for `peft` and `mcore-to-hf` the merged "
        "model.",
    )
    rank: int = Field(16, gt=0, description="Rank r of every adapter (A: r x in, B: out x r).")
    alpha: Optional[float] = Field(
        None,
        gt=0.0,
        description="The adapter's output is scaled by `alpha / rank`. null (default): `2 * rank`, a scale of 2 "
        "whatever the rank, so changing `rank` does not change the size of the update.",
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter's input in training-mode forwards (the policy update; the logprob "
        "passes run in eval mode). 0 (default) adds no work and no saved activation.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        description="Linear layers to adapt, by Megatron-Core name: `linear_qkv` and `linear_proj` (attention), "
        "`linear_fc1` and `linear_fc2` (dense MLPs and shared experts), `experts` (fc1 and fc2 of every routed "
        "expert; refused for grouped-GEMM experts, `moe.grouped_gemm: true` with the `te` layer spec). Hugging Face names are accepted: `q_proj`, `k_proj` and "
        "`v_proj` map onto the fused `linear_qkv` (naming one of them adapts all three), `o_proj` onto "
        "`linear_proj`, `gate_proj` and `up_proj` onto the fused `linear_fc1`, `down_proj` onto `linear_fc2`. A "
        "name listed here that the model does not have is refused; the default list skips what the model lacks "
        "(the dense MLP of a mixture-of-experts model).",
    )
    init: Literal["kaiming_uniform", "gaussian"] = Field(
        "kaiming_uniform",
        description="How A is drawn: `kaiming_uniform` (U(-1/sqrt(in), 1/sqrt(in)), torch's Linear default) or "
        "`gaussian` (N(0, 1/rank^2)). B always starts at 0, so the adapted model starts equal to the base model.",
    )
    seed: int = Field(
        1234,
        description="Seed of A's draw, mixed with each adapter's layer, module and expert: the same adapters "
        "under every parallel layout.",
    )
    sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="How the trained policy reaches the rollout engines: `merged` sends `W + (alpha / rank) B A` as "
        "full weights (every engine and `rollout.sync_method`); `adapter` sends only A and B, which the engine "
        "applies with its own LoRA support (vLLM only; the base weights are loaded once).",
    )

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, v):
        accepted = list(LORA_TARGETS) + list(LORA_HF_TARGETS)
        unknown = [name for name in v if name not in accepted]
        if unknown:
            raise ValueError(f"unknown module {', '.join(map(repr, unknown))}; expected Megatron names "
                             f"{', '.join(LORA_TARGETS)} or Hugging Face names {', '.join(LORA_HF_TARGETS)}")
        if not v:
            raise ValueError("the list is empty: name at least one module to adapt")
        return list(dict.fromkeys(LORA_HF_TARGETS.get(name, name) for name in v))

    @property
    def scaling(self) -> float:
        """``alpha / rank`` (alpha defaulting to ``2 * rank``)."""
        return (self.alpha if self.alpha is not None else 2.0 * self.rank) / self.rank
