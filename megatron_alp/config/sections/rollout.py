"""The `rollout` section and its `rollout.sampling`: the engine that generates the rollouts, and how it samples."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from megatron_alp.config.base import _Section


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
        "staleness is that of its oldest span. Off: a sequence is always generated by one weight version. "
        "Under `trainer.async_schedule: deterministic` the cut is fixed instead of timed: a batch whose "
        "successor needs the next weights generates the first `partial_cut_tokens` tokens of each response "
        "with its own version, then waits for the next one (the update waits only for that first span).",
    )
    partial_cut_tokens: Optional[int] = Field(
        None,
        ge=1,
        description="`partial_rollout` under `trainer.async_schedule: deterministic`: the tokens of each response "
        "generated by the batch's own weights before the rest continues under the next version. None: half of "
        "`sampling.max_response_length`.",
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
    sync_delta: bool = Field(
        False,
        description="Send only the weight elements that changed since the last sync (compared bit for bit "
        "in the engine's dtype, on each rank's own shard) and rebuild the changed tensors on the replica "
        "leaders, which hold a host copy of the weights the engine holds. A full sync still comes every "
        "`sync_delta_anchor` syncs, after an engine restart, a resume or a checksum mismatch. Full weights "
        "only: `lora.sync: adapter` sends adapters as before.",
    )
    sync_delta_anchor: int = Field(
        20, ge=1, description="With `sync_delta`: every this many syncs one is a full sync (the anchor)."
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
