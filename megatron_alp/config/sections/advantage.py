"""The `advantage` section: how a GRPO group's rewards become advantages."""

from __future__ import annotations

from pydantic import Field

from megatron_alp.config.base import _Section


class AdvantageConfig(_Section):
    """GRPO group-normalised advantages."""

    norm_by_std: bool = Field(True, description="Divide by the group's reward std (Dr.GRPO sets false).")
    eps: float = Field(1e-6, gt=0.0, description="Added to the std before dividing.")
