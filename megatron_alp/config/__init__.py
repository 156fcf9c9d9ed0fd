"""The configuration wing: the schema of every key (the root :mod:`~megatron_alp.config.schema`
and one module per section in :mod:`~megatron_alp.config.sections`) and reading it from YAML and
overrides (:mod:`~megatron_alp.config.loading`). Resolving a config against the registries is
:mod:`megatron_alp.resolve`, which sits above them."""

from megatron_alp.config.loading import apply_overrides, read_config, validate_schema
from megatron_alp.config.schema import (
    LORA_HF_TARGETS,
    LORA_TARGETS,
    TIR_SYSTEM_PROMPT,
    AdvantageConfig,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    InputError,
    LoRAConfig,
    LossConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    PerturbationConfig,
    RewardConfig,
    RolloutConfig,
    SamplingConfig,
    SandboxConfig,
    TIRConfig,
    TrainerConfig,
    parse_layer_selection,
)

__all__ = [
    "LORA_HF_TARGETS", "LORA_TARGETS", "TIR_SYSTEM_PROMPT", "AdvantageConfig", "Config", "ConfigError", "DataConfig",
    "EvalConfig", "InputError", "LoRAConfig", "LossConfig", "ModelConfig", "MoEConfig", "OptimizerConfig",
    "ParallelConfig", "PerturbationConfig",
    "RewardConfig", "RolloutConfig", "SamplingConfig", "SandboxConfig", "TIRConfig", "TrainerConfig",
    "apply_overrides", "parse_layer_selection", "read_config", "validate_schema",
]
