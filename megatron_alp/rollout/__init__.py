"""Rollout engines (vLLM, SGLang) with their weight receivers, and the collective API the trainer uses.

Importing this package registers both engines; neither vLLM nor SGLang is imported until an
engine is built.
"""

from megatron_alp.rollout import sglang_engine, vllm  # noqa: F401  (register the engines)
from megatron_alp.rollout.base import (
    ENGINES,
    Completion,
    EngineRestarted,
    RolloutEngine,
    RolloutError,
    SamplingParams,
)
from megatron_alp.rollout.distributed import DistributedRollout
from megatron_alp.rollout.replicas import ReplicaSet, build_engine

__all__ = [
    "ENGINES",
    "Completion",
    "DistributedRollout",
    "EngineRestarted",
    "ReplicaSet",
    "RolloutEngine",
    "RolloutError",
    "SamplingParams",
    "build_engine",
]
