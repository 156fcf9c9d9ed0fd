"""Every configuration key of megatron-alp, in one place: the schema.

A run is described by one YAML file whose top-level sections are the classes below. Each field
carries its documentation (``description``), type and range, and each section checks its own
keys; a key that names a registry member says which (``json_schema_extra={"registry": ...}``).
:mod:`megatron_alp.resolve` then checks those names and the sections against each other and sets
the defaults that follow from other keys. ``docs/configuration.md`` is generated from these
classes (``megatron-alp config-docs``) and a test keeps it in sync.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator


class InputError(ValueError):
    """Bad user input (a config key, a file, an argument): the command line prints the message
    alone and exits with status 2, with no traceback. The message names what was wrong and what
    was expected."""


class ConfigError(InputError):
    """A configuration file or override is invalid; the message names each offending key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------------------- model


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


# ------------------------------------------------------------------------------------- moe


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


# -------------------------------------------------------------------------------- perturbation

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
    calibration_mode: Literal["global", "per_layer"] = Field(
        "global",
        description="With `init_std: auto`, the size of each layer's noise before the global scale is searched. "
        "`global`: the RMS of the layer's input hidden states (the same noise-to-activation ratio in every "
        "layer). `per_layer`: the measured divergence of the layer's input between the rollout engine and "
        "the trainer, on the first sequences of the calibrating batch (the size of the paper's zeta_h, which sigma_h "
        "must cover): layers where the engine drifts more get more noise. Needs an engine that shows its "
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


# ------------------------------------------------------------------------------------- lora

#: Megatron-Core's names of the linear layers LoRA can adapt (``experts``: both projections of every
#: routed expert), and the Hugging Face names accepted for them. HF's separate q/k/v (gate/up)
#: projections are one fused Megatron layer, so naming any of them adapts the fused layer.
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts")
LORA_HF_TARGETS = {
    "q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
    "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2",
}


class LoRAConfig(_Section):
    """Low-rank adapters (megatron_alp/models/lora.py): each adapted linear layer computes
    `W x + (alpha / rank) * B A x`; only A and B (and ALP's sigmas) train, the base weights are frozen
    and hold no gradient buffer or optimizer state, and the reference policy is the base model with
    the adapters switched off."""

    enabled: bool = Field(
        False,
        description="Train low-rank adapters on a frozen base instead of the full model. The base comes from "
        "`model.hf_path` (or the tiny model), not `model.load`; checkpoints hold base and adapters, `megatron-alp "
        "convert mcore-to-peft` exports the adapters for `peft` and `mcore-to-hf` the merged model.",
    )
    rank: int = Field(16, gt=0, description="Rank r of every adapter (A: r x in, B: out x r).")
    alpha: Optional[float] = Field(
        None,
        gt=0.0,
        description="The adapter's output is scaled by `alpha / rank`. null (default): `2 * rank`, a scale of 2 "
        "whatever the rank, so changing `rank` does not change the size of the update.",
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter's input in training-mode forwards (the policy update; the logprob "
        "passes run in eval mode). 0 (default) adds no work and no saved activation.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        description="Linear layers to adapt, by Megatron-Core name: `linear_qkv` and `linear_proj` (attention), "
        "`linear_fc1` and `linear_fc2` (dense MLPs and shared experts), `experts` (fc1 and fc2 of every routed "
        "expert; refused for grouped-GEMM experts, `moe.grouped_gemm: true` with the `te` layer spec). Hugging Face names are accepted: `q_proj`, `k_proj` and "
        "`v_proj` map onto the fused `linear_qkv` (naming one of them adapts all three), `o_proj` onto "
        "`linear_proj`, `gate_proj` and `up_proj` onto the fused `linear_fc1`, `down_proj` onto `linear_fc2`. A "
        "name listed here that the model does not have is refused; the default list skips what the model lacks "
        "(the dense MLP of a mixture-of-experts model).",
    )
    init: Literal["kaiming_uniform", "gaussian"] = Field(
        "kaiming_uniform",
        description="How A is drawn: `kaiming_uniform` (U(-1/sqrt(in), 1/sqrt(in)), torch's Linear default) or "
        "`gaussian` (N(0, 1/rank^2)). B always starts at 0, so the adapted model starts equal to the base model.",
    )
    seed: int = Field(
        1234,
        description="Seed of A's draw, mixed with each adapter's layer, module and expert: the same adapters "
        "under every parallel layout.",
    )
    sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="How the trained policy reaches the rollout engines: `merged` sends `W + (alpha / rank) B A` as "
        "full weights (every engine and `rollout.sync_method`); `adapter` sends only A and B, which the engine "
        "applies with its own LoRA support (vLLM only; the base weights are loaded once).",
    )

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, v):
        accepted = list(LORA_TARGETS) + list(LORA_HF_TARGETS)
        unknown = [name for name in v if name not in accepted]
        if unknown:
            raise ValueError(f"unknown module {', '.join(map(repr, unknown))}; expected Megatron names "
                             f"{', '.join(LORA_TARGETS)} or Hugging Face names {', '.join(LORA_HF_TARGETS)}")
        if not v:
            raise ValueError("the list is empty: name at least one module to adapt")
        return list(dict.fromkeys(LORA_HF_TARGETS.get(name, name) for name in v))

    @property
    def scaling(self) -> float:
        """``alpha / rank`` (alpha defaulting to ``2 * rank``)."""
        return (self.alpha if self.alpha is not None else 2.0 * self.rank) / self.rank


# ------------------------------------------------------------------------------------- loss


class LossConfig(_Section):
    """The policy objective (paper section 2 and the appendix table of importance ratios)."""

    name: str = Field(
        "alp_token",
        description="Policy loss by registry name (megatron_alp/algorithms/policy_loss.py; the table below "
        "describes each): ALP (ratio perturbed-train / rollout) or one of the paper's baselines.",
        json_schema_extra={"registry": "loss"},
    )
    clip_low: Optional[float] = Field(
        None, gt=0.0, le=1.0,
        description="Lower clip: ratio >= 1 - clip_low (1: no lower clip). null: the loss's default (0.2 token "
        "level, 0.5 sequence level; `cispo` 1, MiniMax-M1's unbounded lower IS weight).",
    )
    clip_high: Optional[float] = Field(
        None, gt=0.0,
        description="Upper clip: ratio <= 1 + clip_high. null: the loss's default (0.28 token level, 3.0 sequence level).",
    )
    dual_clip_c: Optional[float] = Field(
        10.0, description="Dual-clip bound c (> 1) for negative advantages; null disables it."
    )
    seq_ratio: Literal["product", "geometric_mean"] = Field(
        "product",
        description="How sequence-level ratios aggregate token log-ratios: `product` (sum of logs, "
        "the paper's Seq-ALP) or `geometric_mean` (GSPO's length-normalised form).",
    )
    mis_threshold: float = Field(
        2.0, gt=0.0,
        description="C for Token-/Seq-MIS: each sequence's objective is weighted by rho' = prod_t "
        "pi_old / pi_rollout and masked where rho' > C.",
    )
    mis_two_sided: bool = Field(
        False,
        description="Token-/Seq-MIS: also mask sequences with rho' < 1/C (the lower bound the paper "
        "authors' code applies); off: only rho' > C is masked, as the paper's formula says.",
    )
    tis_threshold: float = Field(2.0, gt=0.0, description="C for Token-TIS: truncate the weight at C.")
    icepop_low: float = Field(
        0.5, gt=0.0, le=1.0,
        description="alpha for `icepop`: a token whose k = pi_old / pi_rollout is below it is masked (Ring-1T: 0.5).",
    )
    icepop_high: float = Field(
        5.0, ge=1.0,
        description="beta for `icepop`: a token whose k = pi_old / pi_rollout is above it is masked (Ring-1T: 5).",
    )
    log_ratio_clamp: float = Field(
        20.0, gt=0.0, description="Clamp |log ratio| before exp() for numerical safety."
    )
    aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = Field(
        "token-mean",
        description="How per-token losses reduce to the batch loss. The normalisers count loss tokens, and "
        "sequences with at least one loss token, over the whole mini-batch.",
    )
    mask_truncated: bool = Field(
        False,
        description="Overlong filtering (DAPO): take responses cut by the length limit (finish reason "
        "`length`) out of the loss entirely, their tokens out of the normalisers too; their rewards still "
        "count in their group's advantages. Logged: `response/masked_truncated_frac`.",
    )
    kl_coef: float = Field(0.001, ge=0.0, description="Coefficient of the KL penalty to the reference.")
    kl_type: Literal["k1", "k3"] = Field(
        "k3", description="KL estimator: `k1` (log ratio) or `k3` (low-variance, always >= 0)."
    )
    kl_clamp: float = Field(
        10.0, gt=0.0,
        description="Bound on the per-token KL estimate, [-kl_clamp, kl_clamp] (as verl): k3 grows like "
        "exp(log-ratio), so without it one token far from the reference dominates the gradient; a token "
        "beyond the bound contributes no KL gradient.",
    )
    entropy_coef: float = Field(0.001, ge=0.0, description="Entropy bonus coefficient.")

    @field_validator("dual_clip_c")
    @classmethod
    def _check_c(cls, v):
        if v is not None and v <= 1.0:
            raise ValueError(f"dual clip c must be > 1 (got {v})")
        return v



class AdvantageConfig(_Section):
    """GRPO group-normalised advantages."""

    norm_by_std: bool = Field(True, description="Divide by the group's reward std (Dr.GRPO sets false).")
    eps: float = Field(1e-6, gt=0.0, description="Added to the std before dividing.")


class OptimizerConfig(_Section):
    """Megatron-Core optimizer for the model weights (sigma has its own group, see perturbation)."""

    lr: float = Field(1e-6, ge=0.0, description="Peak learning rate of the model weights.")
    min_lr: float = Field(1e-6, ge=0.0, description="Final learning rate after decay.")
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning-rate decay after warmup."
    )
    lr_warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup.")
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW weight decay (not on norms/biases).")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    clip_grad: float = Field(1.0, ge=0.0, description="Global gradient-norm clip (0 disables).")


# ---------------------------------------------------------------------------------- rollout


class SamplingConfig(_Section):
    """How responses are sampled (the rollout engine applies exactly these)."""

    n: int = Field(8, ge=1, description="Responses per prompt (the GRPO group size).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (1.0 disables).")
    top_k: int = Field(-1, description="Top-k sampling (-1 disables).")
    max_prompt_length: int = Field(2048, ge=1, description="Prompts longer than this (tokens) are skipped.")
    max_response_length: int = Field(2048, ge=1, description="Maximum generated tokens per response.")
    per_sample_seeds: Optional[bool] = Field(
        None,
        description="Seed every sample from (trainer.seed, iteration, prompt, sample), so rollouts do not "
        "depend on the engine's process, batching or restarts: a run on more ranks, another layout or "
        "resumed samples what a one-rank run does (vllm engine only). Default: on without a GPU; off on "
        "GPUs, where vLLM then samples request by request and kernels are not reproducible anyway.",
    )

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v):
        if v == 0 or v < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1 (got {v})")
        return v


class RolloutConfig(_Section):
    """The inference engine that generates rollouts and reports their logprobs."""

    engine: str = Field(
        "vllm",
        description="Rollout engine by registry name (megatron_alp/rollout); each engine refuses at "
        "validation the settings it cannot honour (e.g. SGLang with FP8).",
        json_schema_extra={"registry": "engine"},
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="Engine compute precision."
    )
    quantization: Literal["none", "fp8", "fp8_per_channel"] = Field(
        "none",
        description="Weight quantization of the rollout engine (vLLM only), to stress mismatch as in the "
        "paper: `fp8` is vLLM's online per-tensor FP8 (`fp8_per_tensor`: E4M3 weights with one scale per tensor, "
        "dynamic per-tensor activation scales; GPU only) and `fp8_per_channel` FP8 weights with one scale per output channel "
        "and dynamic per-token activation scales (GPU and CPU). Both re-quantize after every weight sync. "
        "SGLang refuses both (its online FP8 cannot take weight updates).",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field("auto", description="KV-cache precision of the engine.")
    tensor_parallel_size: int = Field(1, ge=1, description="Engine tensor parallel size (GPU).")
    replicas: Union[Literal["auto"], int] = Field(
        "auto",
        description="Engine replicas that share each iteration's prompts (whole GRPO groups, balanced by "
        "expected tokens). Replica k is started by global rank k * world/replicas on the GPUs (or CPU cores) "
        "of the ranks up to the next replica's: colocated with training. `auto`: world size / "
        "`tensor_parallel_size` on GPUs (every GPU generates), one per data-parallel rank on the CPU. With "
        "per-sample seeds the rollouts do not depend on the number of replicas.",
    )
    placement: Literal["colocated", "separate"] = Field(
        "colocated",
        description="Where the engine replicas run. `colocated`: on the trainer's own GPUs (they sleep while "
        "Megatron trains) or CPU cores, generation and training taking turns. `separate`: on devices of their "
        "own (`gpus` on GPU nodes, `cpu_cores` on the CPU), so they can generate while the trainer trains "
        "(`trainer.max_staleness` >= 1); the engine runs in its own process, never sleeps (raise "
        "`gpu_memory_utilization`: the GPUs are its own) and weights reach it by `sync_method: broadcast` "
        "unless another method is set.",
    )
    gpus: list[int] = Field(
        default_factory=list,
        description="`placement: separate` on GPU nodes: the local GPU indices (into the node's visible devices) "
        "of every node that the engine replicas use, `tensor_parallel_size` GPUs each; the trainer ranks take "
        "the node's first GPUs, so launch `nproc_per_node` = GPUs per node - len(gpus) (e.g. 8-GPU nodes, "
        "`gpus: [4, 5, 6, 7]`, 4 trainer ranks per node). Each replica is led by one trainer rank of its node.",
    )
    cpu_cores: list[int] = Field(
        default_factory=list,
        description="CPU runs: the cores the engine replicas' threads are pinned to (shared out among the "
        "replicas of a machine); the engine then runs in its own process. With `placement: separate` the "
        "trainer ranks are pinned to the other cores of their affinity set; empty: the second half of them "
        "(at least one core) goes to the engines. Empty with `colocated`: engine threads are not pinned.",
    )
    partial_rollout: bool = Field(
        False,
        description="With `trainer.max_staleness` >= 1 (vLLM): a weight update does not wait for the running "
        "generation to finish; the engine pauses between decoding steps, takes the new weights and continues "
        "the unfinished sequences, so one response may span several policy versions. Each trajectory records "
        "the version of each token span (`info['version_spans']`: (first token, version) pairs); its "
        "staleness is that of its oldest span. Off: a sequence is always generated by one weight version.",
    )
    sync_method: Optional[str] = Field(
        None,
        description="How weights reach an engine: `memory` (buckets handed over in memory: in-process "
        "reload, shared-memory buffers to a CPU engine subprocess, CUDA IPC handles to a colocated GPU "
        "engine), `broadcast` (vllm: each bucket of whole layers broadcast from the replica's leader to the "
        "engine's workers in a process group of their own, NCCL for GPU weights, gloo for CPU ones; for engines "
        "that share neither memory nor GPU with the trainer; runs the engine in its subprocess) or `folder` (a "
        "safetensors checkpoint in `sync_dir` the engine reloads). Default: `broadcast` with `placement: "
        "separate`, else the engine's first supported method (vllm: memory; sglang: folder only).",
        json_schema_extra={"registry": "sync_method"},
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0,
        description="Fraction of the GPU's whole memory the engine claims (weights, workspace, KV cache). "
        "Colocated: it must be free beside what `offload_*` leave of Megatron's state; with `placement: "
        "separate` the GPU is the engine's own (0.9, vLLM's default, suits). `megatron-alp plan` checks both.",
    )
    max_model_len: Optional[int] = Field(
        None, ge=1, description="Engine context length (default: max_prompt + max_response)."
    )
    enforce_eager: bool = Field(False, description="Disable CUDA graphs in the engine (always on CPU).")
    free_memory_during_training: bool = Field(
        True, description="Put the engine to sleep (free KV cache/weights) while the trainer runs (GPU)."
    )
    sync_bucket_mb: int = Field(
        512, ge=1, description="Weight-sync bucket size: tensors are gathered and sent in buckets this big."
    )
    verify_sync: bool = Field(
        False, description="After each weight sync, check engine and trainer logprobs agree on a probe."
    )
    verify_tolerance: Optional[float] = Field(
        None,
        gt=0.0,
        description="Largest mean |engine - trainer| logprob on the verify probe accepted after a sync "
        "(default: 1e-3 for a float32 engine without quantization, 0.05 otherwise).",
    )
    engine_process: Literal["auto", "in_process", "subprocess"] = Field(
        "auto",
        description="Where the vLLM engine runs: `in_process` (fastest start, weights handed over in "
        "memory), `subprocess` (vLLM's engine-core process, started by each replica's rank and "
        "restarted if it dies), or `auto`: in-process for a one-rank job, a subprocess under torchrun "
        "(an in-process vLLM would join the trainer's process group) or with `sync_method: broadcast`.",
    )
    sync_dir: Optional[str] = Field(
        None,
        description="Folder for the weight checkpoints handed to an engine in another process "
        "(vLLM subprocess, SGLang server); default /dev/shm when present, else the temp folder.",
    )
    startup_timeout_s: float = Field(
        900.0, gt=0.0, description="Seconds an engine or server may take to start before it is an error."
    )
    request_timeout_s: float = Field(
        600.0, gt=0.0,
        description="Fixed part of the time limit of one generate attempt (and the limit of other engine "
        "requests); samples unfinished by then are aborted and retried. An attempt of S samples of up to "
        "M tokens may take request_timeout_s + S * M / min_tokens_per_s.",
    )
    min_tokens_per_s: float = Field(
        1000.0, gt=0.0,
        description="Slowest generation rate (tokens per second, all samples of one attempt together) "
        "accepted before an attempt counts as stuck: the part of the time limit that grows with the batch "
        "(a 16K-token 4096-sample batch gets ~18 h, a CPU quickstart batch the fixed part).",
    )
    max_retries: int = Field(
        2, ge=0,
        description="Retries of the samples an attempt did not return (timeout, abort, engine death and "
        "restart) before a RolloutError; a batch is never returned short.",
    )
    sglang_port: int = Field(30000, ge=1, le=65535, description="Port of the SGLang server (sglang engine).")
    sglang_args: list[str] = Field(
        default_factory=list, description="Extra command-line arguments for `sglang.launch_server`."
    )
    sglang_python: Optional[str] = Field(
        None,
        description="Python interpreter that runs the SGLang server (SGLang pins its own torch, so images "
        "install it in an environment of its own). Default: $MEGATRON_ALP_SGLANG_PYTHON (the Docker image "
        "sets it), else the trainer's interpreter.",
    )
    return_routed_experts: Optional[bool] = Field(
        None,
        description="MoE models: the engine returns the experts it routed every token to, per layer (vLLM "
        "`enable_return_routed_experts`, which needs its Model Runner V2 and so a GPU; SGLang "
        "`--enable-return-routed-experts`), carried with each trajectory. null: exactly when "
        "`moe.routing_replay: r3`, which needs it; `true` under none/r2 logs `moe/rollout_agreement` only.",
    )
    offload_weights: bool = Field(
        True,
        description="Colocated GPU runs: move Megatron's parameters (the policy's and, with a KL penalty, the "
        "reference model's) to pinned CPU memory while the engine generates, and back before the logprob "
        "passes. vLLM needs `gpu_memory_utilization` x the GPU's memory free when it starts and at every "
        "wake-up; `megatron-alp plan` counts what stays resident (docs/memory_plan.md).",
    )
    offload_grads: bool = Field(
        True,
        description="Colocated GPU runs: take Megatron's fp32 gradient buffer off the GPU while the engine "
        "generates (its contents are not needed: it is zeroed before every update). 4 bytes per parameter "
        "of this rank.",
    )
    offload_optimizer: bool = Field(
        True,
        description="Colocated GPU runs: move the optimizer state (fp32 master weights and Adam moments, "
        "12 bytes per parameter, divided over data-parallel ranks by the distributed optimizer) to pinned "
        "CPU memory while the engine generates, and back before the update.",
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)

    @field_validator("replicas")
    @classmethod
    def _replicas_positive(cls, v):
        if v != "auto" and v < 1:
            raise ValueError(f"replicas must be `auto` or >= 1 (got {v})")
        return v

    @model_validator(mode="after")
    def _placement(self):
        if (self.placement == "separate" or self.cpu_cores) and self.engine_process == "in_process":
            what = "placement: separate" if self.placement == "separate" else "cpu_cores"
            raise ValueError(f"{what} runs the engine in a process of its own: engine_process: in_process "
                             "cannot be used with it (use auto or subprocess)")
        if self.gpus and self.placement != "separate":
            raise ValueError("gpus lists the engines' own GPUs and needs placement: separate")
        if len(set(self.gpus)) != len(self.gpus) or len(self.gpus) % self.tensor_parallel_size:
            raise ValueError(f"gpus {self.gpus} must be distinct GPU indices, a multiple of "
                             f"tensor_parallel_size={self.tensor_parallel_size} of them")
        if any(c < 0 for c in self.cpu_cores) or len(set(self.cpu_cores)) != len(self.cpu_cores):
            raise ValueError(f"cpu_cores {self.cpu_cores} must be distinct core numbers >= 0")
        return self


# ------------------------------------------------------------------------------ data, reward


class DataConfig(_Section):
    """Prompt data sets (parquet or jsonl)."""

    train_files: list[str] = Field(
        default_factory=list, description="Training prompt files (.parquet, .jsonl); read in order."
    )
    val_files: list[str] = Field(default_factory=list, description="Validation prompt files.")
    prompt_key: str = Field(
        "prompt",
        description="Column holding the prompt: a chat message list (system+user) or a plain string.",
    )
    answer_key: str = Field(
        "reward_model.ground_truth",
        description="Column holding the ground truth; dotted paths reach into nested columns.",
    )
    system_prompt: Optional[str] = Field(
        "Please reason step by step, and put your final answer within \\boxed{}.",
        description="System instruction added when a prompt has no system message (null: none). With "
        "`tir.enabled` and this key unset, the TIR instruction is used instead (megatron_alp.config."
        "TIR_SYSTEM_PROMPT: it describes the ```python and ```output blocks), so the model knows the interpreter.",
    )
    replace_system_prompt: bool = Field(
        False,
        description="Also replace the system message a prompt already has with `system_prompt` (e.g. to "
        "give single-turn data the TIR instruction); false keeps the data's own.",
    )
    max_train_prompts: Optional[int] = Field(
        None, ge=1, description="RL trains on only the first N usable training prompts (null: all of them), "
        "e.g. for a quick run on a fixed pool or an overfitting check. The tiny-model warm start "
        "(`trainer.sft_warmup_steps`) still reads every training prompt.",
    )
    skip_bad_rows: bool = Field(
        False,
        description="Skip the rows of data files that cannot be used (a line that is not a JSON object, an empty "
        "or malformed prompt, no ground truth) and report how many and where (file:line), instead of refusing "
        "the file at the first one. Prompts longer than `rollout.sampling.max_prompt_length` are always left out "
        "and reported.",
    )
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (deterministic in `seed`).")
    seed: int = Field(1, description="Data shuffling seed.")


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


class SandboxConfig(_Section):
    """Limits of the Python interpreter used in tool-integrated reasoning. Each execution runs in
    its own process, isolated by Linux namespaces, seccomp and an unprivileged uid; without them
    training refuses to start unless `allow_unsafe` is set (see docs/sandbox.md)."""

    cpu_time_s: float = Field(5.0, gt=0.0, description="CPU seconds per execution (rounded up to whole seconds).")
    wall_time_s: float = Field(
        10.0, gt=0.0, description="Wall-clock seconds per execution; then every process it started is killed."
    )
    memory_mb: int = Field(1024, ge=16, description="Address-space limit per execution (MiB).")
    max_output_bytes: int = Field(
        8192, ge=64, description="Output kept per execution (bytes); longer output keeps its head and tail "
        "around a truncation marker, and an execution that prints 64 times this much is stopped."
    )
    max_processes: int = Field(1, ge=1, description="Processes the executed code may have (1: no fork).")
    max_file_mb: int = Field(64, ge=1, description="Largest file the executed code may write (MiB).")
    workers: int = Field(8, ge=1, description="Executions run in parallel.")
    disk_mb: int = Field(
        64, ge=1, description="Size of the private tmpfs each execution writes to (its working directory and "
        "/tmp), in MiB; it takes memory, not disk, and disappears with the execution."
    )
    allow_unsafe: bool = Field(
        False,
        description="Run model-written code even where full isolation (namespaces, seccomp) is unavailable, "
        "instead of refusing to start. Local debugging only: the code then runs without namespaces or disk "
        "quota (never as uid 0) and can read the machine's files, reach local services and, unless the "
        "trainer runs as root, signal the trainer's processes.",
    )
    allow_no_memory_cgroup: bool = Field(
        False,
        description="Run fully isolated executions where no memory cgroup can be made for them (cgroup v2 "
        "without the memory controller delegated, cgroup v1 read-only), instead of refusing to start. Kernel "
        "memory is then bounded only by refusing what pins it (Unix sockets, System V semaphores, memfd): "
        "see docs/sandbox.md for what each mode bounds.",
    )


TIR_SYSTEM_PROMPT = (
    "Solve the problem step by step. You may write Python code in a ```python code block; it is "
    "executed and its output is shown to you in an ```output block. Use it to compute and check. "
    "Put your final answer within \\boxed{}."
)


class TIRConfig(_Section):
    """Multi-turn tool-integrated reasoning (paper section 4): the model writes ```python blocks,
    each is executed in the sandbox and its output appended as an ```output block."""

    enabled: bool = Field(False, description="Roll out multi-turn episodes with a Python interpreter.")
    max_turns: int = Field(
        5, ge=1, description="Code executions per episode; a further code block ends the episode unexecuted."
    )
    mask_void_turns: bool = Field(
        True,
        description="Exclude from the loss a turn the model ends with neither a code block nor a final "
        "\\boxed{} answer (turns cut by the length limit are not void).",
    )
    tool_format: Literal["inline", "chat"] = Field(
        "inline",
        description="How interpreter output enters the context: `inline` appends the ```output block in the "
        "assistant message (SimpleTIR, the paper's setup, for base models); `chat` closes the assistant "
        "message and adds a `tool` message rendered by the tokenizer's chat template.",
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)


# ---------------------------------------------------------------------------------- trainer


class TrainerConfig(_Section):
    """The RL loop: sizes, lengths, checkpoints and logging."""

    output_dir: str = Field("runs/default", description="Run directory (checkpoints, metrics, plots).")
    iterations: int = Field(100, ge=1, description="RL iterations (rollout + updates + sync).")
    prompts_per_iteration: int = Field(512, ge=1, description="Prompts sampled per iteration.")
    updates_per_iteration: int = Field(
        16, ge=1, description="Optimizer steps per iteration (the batch is split into this many mini-batches)."
    )
    micro_batch_size: int = Field(
        4, ge=1, description="Sequences per micro-batch in a forward/backward (when no token budget is set)."
    )
    max_tokens_per_micro_batch: Optional[int] = Field(
        None,
        ge=1,
        description="Token budget of a policy-update micro-batch, in place of `micro_batch_size` rows: "
        "length-sorted padded rows while rows x longest row fit, or with `sequence_packing` sequences laid "
        "end to end in one row of at most this many tokens. Must hold the longest sequence (`rollout."
        "max_model_len`, default max prompt + max response). The loss normalisation stays exact (global "
        "token and sequence counts of the mini-batch).",
    )
    logprob_max_tokens_per_micro_batch: Optional[int] = Field(
        None,
        ge=1,
        description="Token budget of the old/reference logprob passes (default: `max_tokens_per_micro_batch`). "
        "They keep no activations for a backward, so a budget 2-4x the update's usually fits.",
    )
    sequence_packing: bool = Field(
        False,
        description="Pack several sequences into one row with per-sequence positions and no attention "
        "across sequences, so no pad token is computed (needs `max_tokens_per_micro_batch`). Transformer "
        "Engine attention gets Megatron's THD layout (cu_seqlens); the local spec a block-diagonal causal "
        "mask. Pipeline parallel pads the packed rows of a pass to one length; sequence parallel pads to "
        "a multiple of the tensor-parallel size.",
    )
    balance_data_parallel: bool = Field(
        True,
        description="Split each mini-batch over the data-parallel ranks by greedy LPT on the estimated cost "
        "of each sequence (tokens, plus attention's quadratic share) instead of equal contiguous counts. "
        "Logged: `batch/dp_imbalance` (max / mean cost per rank) and `batch/dp_imbalance_unbalanced`.",
    )
    fused_linear_logprobs: bool = Field(
        True,
        description="Compute the sampled-token logprobs and entropy from the final hidden states and the "
        "output weight chunk by chunk, never materialising the [tokens, vocab/TP] logits or their gradient "
        "(false: Megatron's output layer makes the logits, then the chunked logprob code reads them).",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="Asynchronous off-policy training. 0: every iteration generates with the newest weights, "
        "then trains (synchronous). k >= 1 (needs `rollout.placement: separate`): the engines generate the "
        "next k batches while the trainer updates, and a batch is trained on only if the weights that "
        "generated it are at most k versions (iterations) old; older groups are regenerated and counted "
        "(`staleness/regenerated_groups`). Every trajectory records its policy version; `staleness/mean` and "
        "`staleness/max` are logged. ALP's single ratio is against the policy that generated the tokens, so "
        "staleness and engine mismatch are corrected by the same ratio.",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: drop the GRPO groups that `dynamic_sampling_filter` rejects (by "
        "default those whose n answers are all correct or all wrong) and sample more prompts in extra rounds "
        "until the batch has `prompts_per_iteration` groups it keeps (the first ones, in sampling order). A "
        "round asks for the missing groups / the keep rate so far x 1.25 (at most 4 x `prompts_per_iteration` "
        "prompts), with per-sample seeds of (seed, iteration, round), so a resumed run replays it. After "
        "`dynamic_sampling_max_rounds` rounds a short batch is completed with dropped groups, never an error. "
        "Extra rounds draw from the data, so epochs end sooner. Logged: `dynamic_sampling/rounds`, "
        "`generated_groups`, `kept_frac` (groups kept / generated), `filled_groups` (dropped groups trained "
        "on) and `reward_mean` (all generated responses; `reward/mean` is the trained batch's). Needs "
        "`rollout.sampling.n` >= 2.",
    )
    dynamic_sampling_filter: Literal["correct", "reward"] = Field(
        "correct",
        description="The groups `dynamic_sampling` keeps. `correct` (DAPO): 0 < #correct < n, where a response "
        "is correct when the reward function gives it full credit (1.0) before the overlong punishment (for "
        "`math_verify`: the verifier accepts its last boxed answer; a TIR episode is judged by its final "
        "response); a group of correct answers whose rewards differ only through the punishment is dropped, "
        "and a kept group whose punished rewards happen to be equal trains with zero advantage "
        "(`batch/zero_variance_groups`). `reward`: the final rewards (punishment included) are not all equal, "
        "i.e. exactly the groups with a non-zero advantage.",
    )
    dynamic_sampling_max_rounds: int = Field(
        4, ge=0, description="Extra generation rounds per iteration allowed to `dynamic_sampling`."
    )
    seed: int = Field(1, description="Global seed (model init, sampling engine, data order).")
    save_interval: int = Field(10, ge=1, description="Save a checkpoint every this many iterations.")
    keep_checkpoints: int = Field(2, ge=1, description="How many recent checkpoints to keep.")
    resume: bool = Field(
        True,
        description="Resume from the newest complete checkpoint in output_dir (a run that has none starts from the "
        "beginning). false: start a fresh run, which a directory an earlier run left files in refuses (its "
        "metrics and checkpoints would mix with the new run's) unless `archive_previous` is set.",
    )
    archive_previous: bool = Field(
        False,
        description="With `resume: false`: move what an earlier run left in output_dir (checkpoints, metrics, "
        "config, tiny base model, figures, tracker files) to output_dir/archive/<UTC time>/ before the fresh run "
        "starts.",
    )
    validate_base: bool = Field(
        True,
        description="With `eval_interval`: validate the base model before the first update too, logged as "
        "iteration -1 (the figures draw it at 0, where the validation curve starts).",
    )
    eval_interval: int = Field(
        0,
        ge=0,
        description="Validate every this many iterations and after the last (0: never): the run's rollout "
        "engine, holding the current (unperturbed) policy, samples `eval.k` answers per problem of "
        "`data.val_files` at `eval.temperature` and `eval.top_p`, with the same seeds every time; the "
        "iteration's metrics get `val/reward_mean` (average@k) and `val/pass@j` (j in `eval.pass_k`, up to "
        "k), per file too (`val/<file>/...`) when there are several. The reward figure draws them.",
    )
    loggers: list[str] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Experiment trackers that get the run's config, every iteration's metrics, the figures and the "
        "final summary, beside RUN/metrics.jsonl (always written): `tensorboard` (RUN/tensorboard), `wandb` (needs "
        "`wandb_project`; `wandb_mode: offline` writes RUN/wandb), `mlflow` (`mlflow_tracking_uri`, default a file "
        "store in RUN/mlruns). A tracker whose package is missing is refused when the config is loaded, with the pip "
        "command.",
        json_schema_extra={"registry": "logger"},
    )
    tensorboard: bool = Field(
        True, description="TensorBoard in `loggers` (kept for configs that set it; false takes it out of `loggers`).")
    wandb_project: Optional[str] = Field(
        None, description="Weights & Biases project of the `wandb` logger (setting it alone adds `wandb` to `loggers`).")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="Weights & Biases mode: `offline` keeps the run in RUN/wandb for `wandb sync` later.")
    mlflow_tracking_uri: Optional[str] = Field(
        None, description="MLflow tracking URI of the `mlflow` logger (default: a file store in RUN/mlruns).")
    mlflow_experiment: str = Field("megatron-alp", description="MLflow experiment the run is logged under.")
    progress_bar: bool = Field(True, description="Show a progress bar with ETA on the console.")
    mismatch_metrics: bool = Field(
        True,
        description="Run the unperturbed old-policy logprob pass every iteration even when the loss "
        "does not need it, for the train-vs-rollout mismatch metrics and token-probability dumps.",
    )
    hang_deadline_s: Optional[float] = Field(
        3600.0,
        gt=0,
        description="A phase (rollout, logprob passes, update, weight sync, ...) that runs longer than this stops "
        "the rank: it writes RUN/hang/rank_<r>.json (its phase, and where every other rank's heartbeat stands, so "
        "the rank that did not arrive is named) with its threads' stacks, and exits 124, which the launch scripts "
        "requeue. A checkpoint save, a resume and the start's HF weights count only the time without progress "
        "(no more bytes written by the save's ranks, or read by the rank), so a slow shared storage is not a hang. "
        "null: wait forever.",
    )
    phase_ledger: bool = Field(
        False,
        description="Write what each rank holds at every phase entry (Megatron state measured from its storages, "
        "the engine memory awake; on GPUs the memory in use and the trainer's peak) to "
        "RUN/phase_ledger/rank_<r>.jsonl. The offload moves of rollout.offload_* then run on the CPU too, so a CPU "
        "run checks that the trainer follows the phase table (megatron_alp/trainer/phases.py); the GPU self-test "
        "compares the measured peaks with `megatron-alp plan`.",
    )
    token_prob_samples: int = Field(
        20000, ge=0, description="Token (train, rollout) probability pairs saved per iteration for plots."
    )
    sft_warmup_steps: int = Field(
        0,
        ge=0,
        description="Supervised warm-start steps on the training answers before RL (tiny models only: "
        "gives a random model a partial skill so rewards are not all zero).",
    )
    sft_warmup_lr: float = Field(3e-3, gt=0.0, description="Learning rate of the supervised warm start.")
    sft_warmup_unboxed: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Fraction of the training prompts whose warm-start answer (format `answer`) leaves out "
        "the box (\"The answer is 7.\", which math_verify scores 0), chosen with `seed`: the model starts out "
        "forgetting the box about as often on every problem, and RL can learn to box on held-out ones too.",
    )
    sft_warmup_format: Literal["answer", "tir"] = Field(
        "answer",
        description="Target of the supervised warm start: `answer` is \"The answer is \\boxed{x}.\"; `tir` "
        "(needs `tir.enabled`) is an episode of the multi-turn format, token for token: a ```python block "
        "that computes the problem, the interpreter's ```output block (masked from the loss, as in RL), "
        "then the answer. `tir` reads the problem from prompts like data/digits' (\"What is 7 + 9?\").",
    )


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


class Config(_Section):
    """A whole run. The schema checks each section; :func:`megatron_alp.resolve.resolve` checks the
    sections against each other and the registries and sets the defaults that follow from other keys."""

    _resolved: bool = PrivateAttr(False)

    model: ModelConfig
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    perturbation: PerturbationConfig = Field(default_factory=PerturbationConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    tir: TIRConfig = Field(default_factory=TIRConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _consistent(self):
        """Keys of different sections that contradict each other (the registries play no part)."""
        t, r, s = self.trainer, self.rollout, self.rollout.sampling
        if t.sft_warmup_steps and self.model.tiny is None:
            raise ValueError("trainer.sft_warmup_steps is for tiny models (model.tiny); start real models from a checkpoint")
        if t.sft_warmup_format == "tir" and not self.tir.enabled:
            raise ValueError("trainer.sft_warmup_format=tir warm-starts on multi-turn episodes and needs tir.enabled: true")
        budgets = {k: getattr(t, k) for k in ("max_tokens_per_micro_batch", "logprob_max_tokens_per_micro_batch")}
        if t.sequence_packing and budgets["max_tokens_per_micro_batch"] is None:
            raise ValueError("trainer.sequence_packing needs trainer.max_tokens_per_micro_batch (the packed row length)")
        longest = r.max_model_len or (s.max_prompt_length + s.max_response_length)
        for key, budget in budgets.items():
            if budget is not None and budget < longest:
                raise ValueError(
                    f"trainer.{key}={budget} cannot hold the longest sequence the engine can produce ({longest} "
                    "tokens: rollout.max_model_len, or max_prompt_length + max_response_length): raise it")
        if t.max_staleness and r.placement != "separate":
            raise ValueError(
                f"trainer.max_staleness={t.max_staleness} generates while the trainer trains, which needs "
                "rollout.placement: separate (colocated engines sleep during the update)")
        if r.partial_rollout and not t.max_staleness:
            raise ValueError("rollout.partial_rollout continues generations across weight updates, which happen "
                             "during generation only with trainer.max_staleness >= 1")
        if r.partial_rollout and self.moe.routing_replay == "r3":
            raise ValueError("rollout.partial_rollout with moe.routing_replay=r3: a continued sequence is re-fed under "
                             "the new weights, so the engine's routing of its earlier span would be lost; use r2 or "
                             "partial_rollout: false")
        if r.partial_rollout and self.tir.enabled:
            raise ValueError("rollout.partial_rollout with tir.enabled: a multi-turn episode is generated in several "
                             "calls whose spans are not tracked across turns; use partial_rollout: false")
        if t.dynamic_sampling and s.n < 2:
            raise ValueError("trainer.dynamic_sampling compares the n answers of each group and needs "
                             f"rollout.sampling.n >= 2 (got {s.n})")
        if self.reward.overlong_buffer > s.max_response_length:
            raise ValueError(f"reward.overlong_buffer={self.reward.overlong_buffer} is longer than "
                             f"rollout.sampling.max_response_length={s.max_response_length}")
        return self

    @property
    def resolved(self) -> bool:
        """Whether :func:`megatron_alp.resolve.resolve` has checked this config and set its defaults."""
        return self._resolved
