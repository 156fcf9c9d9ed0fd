"""The `eval` section: average@k and pass@k of `megatron-alp eval` and of validation."""

from __future__ import annotations

from pydantic import Field, field_validator

from megatron_alp.config.base import _Section


class EvalConfig(_Section):
    """`megatron-alp eval`, and validation during training (`trainer.eval_interval`): average@k and pass@k."""

    files: list[str] = Field(
        default_factory=list,
        description="Benchmark files (jsonl/parquet) of `megatron-alp eval` (empty: `data.val_files`).",
    )
    k: int = Field(32, ge=1, description="Samples per problem (average@k, pass@k).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature.")
    max_response_length: int = Field(
        4096,
        ge=1,
        description="Generation limit (tokens), cut with a notice to what the context leaves after the longest "
        "prompt: the model's `max_position_embeddings` or `rollout.max_model_len` (in training: the engine's).",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (1.0 disables).")
    pass_k: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256],
        description="k values of the unbiased pass@k estimate; those above `k` are dropped.",
    )
    correct_threshold: float = Field(
        0.5, description="A sample counts as correct when its reward exceeds this (math_verify: 1 or 0)."
    )

    @field_validator("pass_k")
    @classmethod
    def _check_pass_k(cls, v):
        if not v or any(k < 1 for k in v):
            raise ValueError(f"pass_k must be a non-empty list of integers >= 1 (got {v})")
        return sorted(set(v))
