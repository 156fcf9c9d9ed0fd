"""The `moe` section: what mixture-of-experts runs add against the router's training-inference mismatch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_alp.config.base import _Section


class MoEConfig(_Section):
    """Mixture-of-experts models (Qwen3-MoE): routing replay, the load-balancing loss, expert kernels.

    The router is the largest single source of training-inference mismatch in MoE RL: where the
    engine and Megatron send a token to different experts, its probability jumps. Routing replay
    makes the training passes use given expert choices (see megatron_alp/training/routing_replay.py);
    every iteration of an MoE run logs `moe/*` routing agreement, flips, expert load and the
    load-balancing loss."""

    routing_replay: Literal["none", "r2", "r3"] = Field(
        "none",
        description="`none`: every pass routes on its own. `r2`: the old-policy (unperturbed) pass records "
        "the experts it chose for every token and layer, and the update and reference passes replay them "
        "(micro-batch aligned, through packing, recomputation and TP/PP/EP). `r3`: the rollout engine "
        "returns the experts it used (vLLM `enable_return_routed_experts`, GPU only; SGLang "
        "`return_routed_experts`), they travel with each trajectory, and every training pass replays them "
        "(tokens without engine routing route on their own). Needs an MoE model.",
    )
    aux_loss_coeff: float = Field(
        0.0,
        ge=0.0,
        description="Coefficient of Megatron's router load-balancing loss. 0 in RL: the loss pulls the router "
        "towards even expert loads with a gradient unrelated to the reward, so the trained policy's routing, "
        "and with it its logprobs, drift away from the engine's (the mismatch the importance ratio pays for); "
        "the pretrained router is already balanced. Logged either way as `moe/aux_loss` (coefficient 1).",
    )
    grouped_gemm: bool = Field(
        False, description="Grouped GEMM experts (GPU with Transformer Engine; the local spec ignores it)."
    )
