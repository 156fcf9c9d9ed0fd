"""The `model` section: the checkpoint or tiny model the policy starts from, its precision and layers."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from megatron_alp.config.base import _Section


class ModelConfig(_Section):
    """The policy model: which Hugging Face checkpoint or config, in which precision and layout."""

    hf_path: Optional[str] = Field(
        None,
        description="Directory of a Hugging Face model (config.json, safetensors, tokenizer). "
        "Weights are loaded from it unless `load` names a Megatron checkpoint.",
    )
    tiny: Optional[str] = Field(
        None,
        description="Instead of `hf_path`: build a tiny model of this family with random weights and "
        "a local tokenizer (tests and the CPU quickstart).",
        json_schema_extra={"registry": "family"},
    )
    load: Optional[str] = Field(
        None, description="Megatron distributed checkpoint to initialise the policy from (optional)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="Parameter/compute precision of the Megatron model (float32 on CPU)."
    )
    layer_spec: Literal["auto", "local", "te"] = Field(
        "auto",
        description="Megatron layer implementation: Transformer-Engine (`te`), Megatron-Core "
        "native (`local`), or `auto` (TE when importable and a GPU is present).",
    )
    recompute: Literal["none", "full", "selective"] = Field(
        "none", description="Activation recomputation granularity (Megatron `recompute_granularity`)."
    )
    recompute_num_layers: int = Field(
        1, ge=1, description="Layers per recomputed chunk when `recompute: full` (uniform method)."
    )
    tiny_config: dict[str, Any] = Field(
        default_factory=dict,
        description="With `tiny`: Hugging Face config keys overriding the tiny defaults "
        "(e.g. hidden_size, num_hidden_layers).",
    )

    @model_validator(mode="after")
    def _one_source(self):
        if (self.hf_path is None) == (self.tiny is None):
            raise ValueError("set exactly one of `hf_path` (a Hugging Face model directory) or `tiny`")
        return self
