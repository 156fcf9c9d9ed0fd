"""The `parallel` section: how Megatron-Core splits the policy over ranks."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, model_validator

from megatron_alp.config.base import _Section


class ParallelConfig(_Section):
    """Megatron-Core model parallelism. Data parallel size is world_size / (tp * pp * cp)."""

    tensor_model_parallel_size: int = Field(1, ge=1, description="Tensor parallel size (TP).")
    pipeline_model_parallel_size: int = Field(1, ge=1, description="Pipeline parallel size (PP).")
    expert_model_parallel_size: int = Field(1, ge=1, description="Expert parallel size (EP), MoE only.")
    expert_tensor_parallel_size: Optional[int] = Field(
        None, ge=1, description="Tensor parallel size inside experts (default: same as TP)."
    )
    sequence_parallel: bool = Field(
        False, description="Shard activations along the sequence across TP ranks (requires TP > 1)."
    )
    use_distributed_optimizer: Optional[bool] = Field(
        None,
        description="Shard optimizer states across data-parallel ranks (ZeRO-1). null (default): on for bf16/fp16 "
        "models with ALP, off otherwise: Megatron-Core's non-distributed fp16 optimizer cannot checkpoint the fp32 "
        "sigmas of a bf16 model (its sharded state dict maps only the fp16 parameters), so `false` is refused there; "
        "with one data-parallel rank the distributed optimizer shards nothing.",
    )

    @model_validator(mode="after")
    def _sp_needs_tp(self):
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("`sequence_parallel: true` needs `tensor_model_parallel_size` > 1")
        return self
