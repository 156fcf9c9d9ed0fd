"""Hugging Face <-> Megatron-Core checkpoint conversion, resharding and logits verification.

Command line: ``megatron-alp convert {hf-to-mcore,mcore-to-hf,mcore-to-peft,reshard,quantize,verify}`` (see
:mod:`checkpoint_tools.cli`). Weight placement comes from
:mod:`megatron_alp.models.weight_mapping`, the same table the trainer's HF loading and the rollout
weight sync use; the export is :mod:`megatron_alp.training.export`. This module holds what the
conversion jobs share.
"""

from __future__ import annotations


def parallel_config(tp: int, pp: int, ep: int, moe: bool):
    """The layout; MoE with TP > 1 gets sequence parallelism (Megatron requires it; the weights
    are unaffected)."""
    from megatron_alp.config import ParallelConfig

    return ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=moe and tp > 1,
    )


def world_size(tp: int, pp: int, ep: int) -> int:
    """Ranks a layout needs: each stage holds TP ranks and EP x (expert TP = TP) expert ranks."""
    return tp * pp * ep


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")
