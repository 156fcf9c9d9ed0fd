"""The `perturbation` section: ALP's learnable noise on chosen layers, and the parser of those layer selections."""

from __future__ import annotations

import re
from typing import Literal, Optional, Union

from pydantic import Field, field_validator

from megatron_alp.config.base import _Section


_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+))?\s*$")


def parse_layer_selection(spec: str | list, num_layers: Optional[int] = None) -> Optional[set[int]]:
    """Parse a layer selection into 0-based layer indices; ``None`` means "logits only".

    Accepted: ``all``, ``logits``, ``"0-4,12-16"`` (inclusive ranges, 0-based, as in the paper's
    ablations), or a list of ints / range strings.
    """
    if isinstance(spec, str) and spec.strip().lower() == "logits":
        return None
    if isinstance(spec, str) and spec.strip().lower() == "all":
        if num_layers is None:
            raise ValueError("'all' needs the model's number of layers")
        return set(range(num_layers))
    parts = spec if isinstance(spec, list) else str(spec).split(",")
    chosen: set[int] = set()
    for part in parts:
        if isinstance(part, int):
            lo = hi = part
        else:
            m = _RANGE.match(str(part))
            if not m:
                raise ValueError(
                    f"layer selection item {part!r}: expected an index like 3 or a range like 0-4"
                )
            lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo:
            raise ValueError(f"layer range {lo}-{hi}: the end is before the start")
        if num_layers is not None and hi >= num_layers:
            raise ValueError(f"layer {hi} does not exist: the model has layers 0-{num_layers - 1}")
        chosen.update(range(lo, hi + 1))
    if not chosen:
        raise ValueError("the layer selection is empty")
    return chosen


class PerturbationConfig(_Section):
    """Adaptive Layerwise Perturbation: learnable Gaussian noise on the inputs of chosen layers,
    applied only in the policy-update forward."""

    enabled: Optional[bool] = Field(
        None,
        description="Perturb the policy-update forward. null (default): exactly when the loss is perturbed "
        "(`alp_*`; each loss declares it). `true` with a baseline loss is refused unless "
        "`allow_with_baseline` is set; `false` with an ALP loss is refused.",
    )
    allow_with_baseline: bool = Field(
        False,
        description="Ablation opt-in: allow `enabled: true` with a loss that is not perturbed (e.g. GRPO "
        "on a perturbed forward). The run is then no longer the named baseline.",
    )
    layers: str | list[int | str] = Field(
        "all",
        description="Which transformer layers get noise on their input hidden states: `all`, "
        "0-based inclusive ranges such as `0-4,12-16`, or `logits` (noise on the final hidden state "
        "before the output layer only).",
    )
    shape: Literal["scalar", "vector"] = Field(
        "scalar",
        description="One sigma per layer (`scalar`, the paper's choice and its official code's) or one per "
        "hidden dimension of each layer (`vector`, an option).",
    )
    init_std: Union[float, Literal["auto"]] = Field(
        1e-4,
        description="Initial sigma. 0 reproduces the unperturbed model exactly. `auto`: calibrated before the first "
        "update from the measured mismatch (megatron_alp/training/calibration.py): on the first iteration's rollouts, "
        "each layer's sigma is set to one global scale times the RMS of that layer's input, the scale chosen "
        "so that KL(unperturbed || perturbed training policy) is `calibration_target` times the measured "
        "KL(engine || training policy) (both k3 estimates over the batch's response tokens); sigma is learned "
        "from there. A target out of reach stops the run naming `calibration_target`; no measurable mismatch (KL 0 "
        "or NaN) sets this key's default with a warning. Refused with `rollout.sampling.top_p` < 1 or `top_k` "
        "(renormalised engine logprobs).",
    )
    calibrate_every: int = Field(
        0,
        ge=0,
        description="With `init_std: auto`: calibrate again every this many iterations (at iterations k, 2k, ...; "
        "the learned sigmas are overwritten, their Adam moments kept). 0: only before the first iteration.",
    )
    calibration_target: float = Field(
        1.0,
        gt=0.0,
        description="With `init_std: auto`: the perturbed policy's KL to the unperturbed one, as a multiple of the "
        "measured engine-training KL. The paper's bound (section 3) wants sigma large enough to cover the "
        "engine's disturbance and small enough to keep the policy: 1 makes the two divergences equal.",
    )
    calibration_mode: Literal["global", "per_layer", "per_layer_added"] = Field(
        "global",
        description="With `init_std: auto`, the size of each layer's noise before the global scale is searched. "
        "`global`: the RMS of the layer's input hidden states (the same noise-to-activation ratio in every "
        "layer). `per_layer_added`: the drift the rollout engine adds before the layer, measured on the first "
        "sequences of the calibrating batch as the engine's input of the layer minus what the trainer's layers make "
        "of the engine's input of the perturbed layer before (the paper's zeta_h, which sigma_h must cover; the "
        "noise of earlier layers, carried forward by the network, covers the drift they let in). `per_layer`: "
        "the cumulative divergence of the layer's input between the engine and the trainer (the earlier layers' "
        "drift included, so it grows with depth). In both, layers where the engine drifts more get more noise, and "
        "one that does not drift gets 1e-3 x the largest layer's (never 0). Needs an engine that shows its "
        "layers' hidden states (vLLM; on GPUs `rollout.enforce_eager: true`), "
        "`parallel.pipeline_model_parallel_size` 1 and transformer-layer sites (not `layers: logits`).",
    )
    lr: float = Field(5e-4, ge=0.0, description="Learning rate of the sigma parameters (own group).")
    weight_decay: float = Field(
        0.0,
        ge=0.0,
        description="Weight decay on log-sigma. Default none: decay would pull sigma towards 1, "
        "not 0, because sigma is stored as log-sigma.",
    )
    lr_schedule: Literal["constant", "follow"] = Field(
        "constant",
        description="`constant`: sigma's LR stays at `lr` (after the common warmup); `follow`: it "
        "decays with the model's schedule to `lr * optimizer.min_lr / optimizer.lr`.",
    )
    seed: int = Field(1234, description="Base seed of the noise stream (mixed with step, micro-batch, ranks).")
    moe_routing: Optional[Literal["follow", "fixed"]] = Field(
        None,
        description="MoE models: whether the noise may change which experts a token goes to in the update pass. "
        "`follow`: the router sees the perturbed hidden state, so the noise moves discrete expert choices as well "
        "as activations; pi_theta,sigma then includes the jumps of tokens whose experts flip and the ratio "
        "pi_theta,sigma / pi_rollout carries them, smoothed over the routing boundaries the noise crosses. "
        "`fixed`: every token keeps the experts of the unperturbed routing (the replayed one under "
        "`moe.routing_replay` r2/r3, else the old-policy pass's own) while the noise still flows through the "
        "gate weights of those experts and through the experts; the ratio then measures the continuous "
        "mismatch only, and routing mismatch is what the replay leaves (none on replayed tokens under r3). "
        "null: `fixed` with a routing replay, `follow` without; `follow` with `moe.routing_replay` r2/r3 is refused "
        "(the update pass would drop the replayed experts). `moe/noise_flip_frac` logs how often the noise "
        "changes the router's own choice in either mode.",
    )

    @field_validator("init_std", mode="before")
    @classmethod
    def _check_init_std(cls, v):
        if v == "auto":
            return v
        try:
            value = float(v)
        except (TypeError, ValueError):
            value = float("nan")
        if not value >= 0.0:
            raise ValueError("expected a number >= 0 or 'auto'")
        return value

    @field_validator("layers")
    @classmethod
    def _check_layers(cls, v):
        if not (isinstance(v, str) and v.strip().lower() in ("all", "logits")):
            parse_layer_selection(v)
        return v
