"""The `reward` section: the reward function and DAPO's overlong punishment."""

from __future__ import annotations

from pydantic import Field

from megatron_alp.config.base import _Section


class RewardConfig(_Section):
    """Reward function by registry name."""

    name: str = Field("math_verify", description="Reward by registry name (megatron_alp/rewards).",
                      json_schema_extra={"registry": "reward"})
    timeout_s: float = Field(
        5.0, gt=0.0, description="Per-sample time limit; an answer that exceeds it scores 0."
    )
    workers: int = Field(2, ge=1, description="Reward worker processes.")
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO soft overlong punishment L_c (0: off), added to the reward on rank 0 before the "
        "advantages: with L_max = `rollout.sampling.max_response_length`, a response of |y| tokens gets 0 "
        "while |y| <= L_max - L_c, ((L_max - L_c) - |y|) / L_c * `overlong_penalty` up to L_max, and "
        "-`overlong_penalty` beyond. In multi-turn TIR episodes |y| counts interpreter-output tokens too: "
        "they spend the same budget. Logged: `reward/overlong_penalty_mean`.",
    )
    overlong_penalty: float = Field(
        1.0, ge=0.0, description="Largest overlong punishment (reached at L_max), with `overlong_buffer`."
    )
