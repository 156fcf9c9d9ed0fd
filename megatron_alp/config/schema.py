"""Every configuration key of megatron-alp: the root of the schema.

A run is described by one YAML file whose top-level sections are the fields of :class:`Config`.
Each section is declared in its own module of :mod:`megatron_alp.config.sections` and re-exported
here and by :mod:`megatron_alp.config`, where code imports it from. Each field carries its
documentation (``description``), type and range, and each section checks its own keys; a key that
names a registry member says which (``json_schema_extra={"registry": ...}``).
:mod:`megatron_alp.resolve` then checks those names and the sections against each other and sets
the defaults that follow from other keys. ``docs/configuration.md`` is generated from these
classes (``megatron-alp config-docs``) and a test keeps it in sync.
"""

from __future__ import annotations

from pydantic import Field, PrivateAttr, model_validator

from megatron_alp.config.base import ConfigError, InputError, _Section
from megatron_alp.config.sections.advantage import AdvantageConfig
from megatron_alp.config.sections.data import DataConfig
from megatron_alp.config.sections.eval import EvalConfig
from megatron_alp.config.sections.lora import LORA_HF_TARGETS, LORA_TARGETS, LoRAConfig
from megatron_alp.config.sections.loss import LossConfig
from megatron_alp.config.sections.model import ModelConfig
from megatron_alp.config.sections.moe import MoEConfig
from megatron_alp.config.sections.optimizer import OptimizerConfig
from megatron_alp.config.sections.parallel import ParallelConfig
from megatron_alp.config.sections.perturbation import PerturbationConfig, parse_layer_selection
from megatron_alp.config.sections.reward import RewardConfig
from megatron_alp.config.sections.rollout import RolloutConfig, SamplingConfig
from megatron_alp.config.sections.tir import TIR_SYSTEM_PROMPT, SandboxConfig, TIRConfig
from megatron_alp.config.sections.trainer import TrainerConfig

__all__ = [
    "LORA_HF_TARGETS", "LORA_TARGETS", "TIR_SYSTEM_PROMPT", "AdvantageConfig", "Config", "ConfigError", "DataConfig",
    "EvalConfig", "InputError", "LoRAConfig", "LossConfig", "ModelConfig", "MoEConfig", "OptimizerConfig",
    "ParallelConfig", "PerturbationConfig", "RewardConfig", "RolloutConfig", "SamplingConfig", "SandboxConfig",
    "TIRConfig", "TrainerConfig", "parse_layer_selection",
]


class Config(_Section):
    """A whole run. The schema checks each section; :func:`megatron_alp.resolve.resolve` checks the
    sections against each other and the registries and sets the defaults that follow from other keys."""

    _resolved: bool = PrivateAttr(False)

    model: ModelConfig
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    perturbation: PerturbationConfig = Field(default_factory=PerturbationConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    tir: TIRConfig = Field(default_factory=TIRConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _consistent(self):
        """Keys of different sections that contradict each other (the registries play no part)."""
        t, r, s = self.trainer, self.rollout, self.rollout.sampling
        if t.sft_warmup_steps and self.model.tiny is None:
            raise ValueError("trainer.sft_warmup_steps is for tiny models (model.tiny); start real models from a checkpoint")
        if t.sft_warmup_format == "tir" and not self.tir.enabled:
            raise ValueError("trainer.sft_warmup_format=tir warm-starts on multi-turn episodes and needs tir.enabled: true")
        budgets = {k: getattr(t, k) for k in ("max_tokens_per_micro_batch", "logprob_max_tokens_per_micro_batch")}
        if t.sequence_packing and budgets["max_tokens_per_micro_batch"] is None:
            raise ValueError("trainer.sequence_packing needs trainer.max_tokens_per_micro_batch (the packed row length)")
        longest = r.max_model_len or (s.max_prompt_length + s.max_response_length)
        for key, budget in budgets.items():
            if budget is not None and budget < longest:
                raise ValueError(
                    f"trainer.{key}={budget} cannot hold the longest sequence the engine can produce ({longest} "
                    "tokens: rollout.max_model_len, or max_prompt_length + max_response_length): raise it")
        if t.max_staleness and r.placement != "separate":
            raise ValueError(
                f"trainer.max_staleness={t.max_staleness} generates while the trainer trains, which needs "
                "rollout.placement: separate (colocated engines sleep during the update)")
        if r.partial_rollout and not t.max_staleness:
            raise ValueError("rollout.partial_rollout continues generations across weight updates, which happen "
                             "during generation only with trainer.max_staleness >= 1")
        if r.partial_cut_tokens is not None and r.partial_cut_tokens >= s.max_response_length:
            raise ValueError(f"rollout.partial_cut_tokens={r.partial_cut_tokens} must be below "
                             f"rollout.sampling.max_response_length={s.max_response_length} (the first span of a "
                             "response, the rest coming from the next weights)")
        if r.partial_rollout and self.moe.routing_replay == "r3":
            raise ValueError("rollout.partial_rollout with moe.routing_replay=r3: a continued sequence is re-fed under "
                             "the new weights, so the engine's routing of its earlier span would be lost; use r2 or "
                             "partial_rollout: false")
        if r.partial_rollout and self.tir.enabled:
            raise ValueError("rollout.partial_rollout with tir.enabled: a multi-turn episode is generated in several "
                             "calls whose spans are not tracked across turns; use partial_rollout: false")
        if t.dynamic_sampling and s.n < 2:
            raise ValueError("trainer.dynamic_sampling compares the n answers of each group and needs "
                             f"rollout.sampling.n >= 2 (got {s.n})")
        if self.reward.overlong_buffer > s.max_response_length:
            raise ValueError(f"reward.overlong_buffer={self.reward.overlong_buffer} is longer than "
                             f"rollout.sampling.max_response_length={s.max_response_length}")
        return self

    @property
    def resolved(self) -> bool:
        """Whether :func:`megatron_alp.resolve.resolve` has checked this config and set its defaults."""
        return self._resolved
