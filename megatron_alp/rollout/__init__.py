"""Rollout engines (vLLM, SGLang), weight sync from Megatron, and the collective API the trainer uses.

Importing this package registers both engines; neither vLLM nor SGLang is imported until an
engine is built.
"""

from megatron_alp.rollout import sglang_engine, vllm_engine  # noqa: F401  (register the engines)
from megatron_alp.rollout.base import (
    ENGINES,
    Completion,
    EngineRestarted,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    Trajectory,
)
from megatron_alp.rollout.distributed import DistributedRollout, build_engine
from megatron_alp.rollout.weight_sync import format_mismatch, mismatch_stats

__all__ = [
    "ENGINES",
    "Completion",
    "DistributedRollout",
    "EngineRestarted",
    "RolloutEngine",
    "RolloutError",
    "SamplingParams",
    "Trajectory",
    "build_engine",
    "format_mismatch",
    "mismatch_stats",
]
