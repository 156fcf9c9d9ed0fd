"""Per-GPU memory plan of a run: what each phase holds on its fullest GPU, and whether it fits.

The phases are those of the trainer's phase table (megatron_alp/trainer/phases.py: what each
phase keeps of Megatron's state and of the engine's memory), and any of them can run out:

- **training**, the policy update (or the forward-only old/reference logprob passes, when a
  larger logprob token budget makes them the fuller), counted on the fullest pipeline stage;
- **rollout** (with the engine start and validation, which hold the same), the engines awake,
  counted on the fullest GPU that holds one: ``rollout.replicas`` engines, replica k on the first
  ``rollout.tensor_parallel_size`` GPUs of the k-th block of world/replicas GPUs
  (megatron_alp/rollout/placement.py; with ``auto`` every GPU). vLLM needs
  ``gpu_memory_utilization x total`` free when it starts and at every wake-up, so what
  ``rollout.offload_*`` leave of Megatron's state plus that budget must fit;
- **weight sync** and **engine restart + resync**: Megatron's weights, the gathered bucket (and a
  leader's copy of it for the engine), the engine's weights awake without its KV cache;
- **sync verification**: Megatron's weights and a probe's forward pass beside the awake engine;
- **layer probe** (``perturbation.calibration_mode: per_layer``): Megatron's weights and a plain
  forward of one probe sequence (full logits) beside the awake engine;
- **checkpoint save**: the policy's weights and optimizer state (the reference stays offloaded), the
  engine asleep, and what the save allocates on the GPU: nothing with the distributed optimizer's
  state gathered over gloo on the host (``save_transient`` of megatron_alp/training/dist_checkpoint.py,
  which the save's format and this count share; its host memory is a note of the plan).

A run with ``rollout.placement: separate`` keeps the two apart. Its GPU count (``--gpus``) is the
trainer's world size, the GPUs torchrun starts ranks on: ``nproc_per_node`` per node, on the node's
first GPUs (default: the GPUs below the first of ``rollout.gpus``); every node adds its
``rollout.gpus`` for the engines, ``tensor_parallel_size`` each (placement.py's rules). Nothing is
offloaded and no engine sleeps, so:

- **training** is counted on a trainer GPU, as above but with no engine beside it;
- **rollout** on an engine GPU: the engine's ``gpu_memory_utilization`` x the whole GPU (its
  weights, workspace and KV cache; a GPU of its own can give it 0.9) plus one weight-sync bucket
  of ``rollout.sync_bucket_mb``, which arrives after vLLM has sized its KV cache, outside that
  budget. The trainer GPUs are taken to be the same kind as the engine GPUs.

Counts, in bytes per GPU. P is this rank's parameters on its pipeline stage: TP splits the
attention and MLP matrices and the vocabulary, PP the layers (embedding on the first stage, final
norm and output layer on the last; tied embeddings keep a copy on each), EP the experts and
``expert_tensor_parallel_size`` each expert's matrices; norms and the router are replicated.
b is the size of ``model.dtype``.

- weights ``P x b``, and the reference model (``loss.kl_coef > 0``) the same again;
- gradient buffer ``P x 4``: fp32 (Megatron DDP with ``grad_reduce_in_fp32``, megatron_alp/training/optim.py),
  not sharded by the distributed optimizer;
- optimizer ``12 x P`` (fp32 master copy, Adam m and v; 8 for a float32 model, its own master),
  divided with ``use_distributed_optimizer`` by DP = gpus / (TP x PP) for dense parameters and by
  expert-DP = gpus / (ETP x EP x PP) for expert parameters;
- activations of a micro-batch of T tokens: ``trainer.max_tokens_per_micro_batch`` when set (a
  token budget: length-sorted padded rows while rows x longest row <= T, or with
  ``trainer.sequence_packing`` one packed row of at most T tokens), else T = ``micro_batch_size x s``,
  s the engine context (prompt + response budget). Per layer and token, after Korthikanti et al.
  2022 ("Reducing Activation Recomputation in Large Transformer Models") for SwiGLU, grouped-query
  attention, no dropout and flash attention (Transformer Engine, packed rows in THD layout):
  ``b x 4h / (TP if SP else 1)`` (inputs of the two norms, of QKV and of FC1 or the router)
  ``+ b x (2q + 2kv, + q + kv with q/k norms) / TP`` (Q, K, V, the attention output, the q/k norm
  inputs) ``+ b x 3I / TP`` (FC1 and SwiGLU outputs); an MoE layer has
  ``(8E + b x k x ETP x (2h + 3 I_e / ETP)) / TP`` instead (fp32 router logits and scores; per
  routed copy its input, output, FC1 and SwiGLU outputs, routing balanced), with q = heads x
  head_dim and kv = kv_heads x head_dim. ``model.layer_spec: local`` (unfused attention) adds the
  attention probabilities, ``b x heads / TP x S`` per layer with S the sum of each row's length
  squared, unless ``recompute: selective``: ``micro_batch_size x s^2`` for rows; for padded rows
  under a budget the worst r x L^2 with r x L <= T and L <= s (r = T // s full-length rows, or one
  row more of T // r tokens); for a packed row T^2 (the block-diagonal causal mask is applied to
  the whole row's T x T scores). With ``recompute: full`` only each chunk's input stays
  (``b x h x T / (TP if SP else 1)`` per ``recompute_num_layers`` layers), plus one chunk's
  activations while it is recomputed. The first pipeline stage holds min(PP, micro-batches per
  update) micro-batches in flight: a rank's sequences per update / ``micro_batch_size``, or with a
  budget ceil(sequences x s / T) (all full-length, the worst case);
- the output on the last stage. With ``trainer.fused_linear_logprobs`` (the default) the update
  computes the sampled-token logprob and entropy from the final hidden states and the output
  weight chunk by chunk (``linear_token_logprobs``, megatron_alp/training/logprobs.py), and the logits and
  their gradient never exist: the hidden states ``T x h x b`` (the GPTModel output, gathered over
  sequence parallel, in the model dtype, kept for the backward), their gradient ``T x h x 4`` (an
  fp32 accumulator during the backward), the fp32 working set (two chunks of
  ``CHUNK_ELEMENTS["cuda"]`` elements, as below) and ``FUSED_STATS_PER_TOKEN`` fp32 statistics per
  token. Without it the logits: ``T x vocab / TP x 2b``, the logits and their gradient in the model
  dtype: the policy update asks Float16Module for its output without the fp32 upcast
  (``fp32_output=False``, megatron_alp/training/policy_update.py), megatron_alp/training/logprobs.py keeps the
  logits for its backward and allocates their gradient ``empty_like`` them; plus its fp32 working
  set, two chunks of ``CHUNK_ELEMENTS["cuda"]`` elements alive at once (the shifted logits and
  their exponentials, in the forward and again in the backward; on a GPU the upcast of a bf16
  chunk is fused into the subtraction, not a third copy). The output weight's gradient is part of
  the gradient buffer in both paths (P counts the output layer on the last stage);
- the old and reference logprob passes, forward-only, keep nothing for a backward: per micro-batch
  of ``trainer.logprob_max_tokens_per_micro_batch`` tokens (default: the update's budget; without a
  budget the update's rows), one layer's activations at a time (the per-token bytes above and that
  layer's probabilities) and the output without its gradient: the hidden states (fused) or the
  logits ``T x vocab / TP x b``, and the working chunks. The training phase counts whichever of
  the update and these passes is the larger on the fullest stage: the update, unless the logprob
  budget is several times the update's;
- engine weights ``parameters x bytes / rollout.tensor_parallel_size``, with 1 byte for the linear
  layers under ``rollout.quantization`` (embeddings stay in the engine dtype);
- KV cache: what the budget leaves after the engine's weights and workspace, at
  ``2 x layers x max(1, kv_heads / rollout TP) x head_dim x bytes`` per token (1 byte with
  ``kv_cache_dtype: fp8``). An iteration asks for ``prompts_per_iteration x n`` sequences of up to
  the engine context; the engine runs what fits and queues the rest, but it must hold one
  full-length sequence or vLLM refuses to start;
- fixed allowances: CUDA context, NCCL buffers and library workspaces of each trainer process; the
  engine's profiled activation peak, CUDA graphs and non-torch memory inside its budget; what a
  sleeping engine keeps.

A plan fits when each phase stays under 95% of the GPU (allocator fragmentation and the error of
these counts). They are estimates from the architecture, not measurements: the GPU self-test of
issue 11 measures the real peaks, and the allowances above are to be corrected from it.
:func:`check_fits` is the trainer's start-up check; docs/memory_plan.md has the plan of every
shipped GPU config.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path
from typing import Optional

from megatron_alp.config import Config, ConfigError, apply_overrides
from megatron_alp.models.families import PUBLISHED, hf_to_megatron, load_hf_config
from megatron_alp.models.tiny import tiny_hf_config
from megatron_alp.resolve import config_from_dict
from megatron_alp.rollout.base import resolve_max_model_len
from megatron_alp.rollout.placement import auto_replicas, check_sync_placement, replica_layout
from megatron_alp.plan.phases import PHASES, PhaseSpec
from megatron_alp.training.calibration import LAYER_PROBE_TOKENS
from megatron_alp.training.dist_checkpoint import SaveTransient, save_transient
from megatron_alp.training.logprobs import CHUNK_ELEMENTS
from megatron_alp.training.offload import parts_of

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RUNTIME_BYTES = 3 * GiB  # per trainer process: CUDA context, NCCL communicators, cuBLAS/TE workspaces
ENGINE_WORKSPACE_BYTES = 3 * GiB  # vLLM's profiled activation peak, sampler logits, CUDA graphs, non-torch memory
# a sleeping engine: its CUDA context and the NCCL buffers vLLM keeps through sleep (its CUDA-graph pool
# goes to host memory: sleep_mode_offload_cudagraph); not measured yet: the GPU self-test's phase ledger does
ENGINE_ASLEEP_BYTES = 2 * GiB
# the rows of the plan, in the order a run meets them (each phase of the table counts in its PhaseSpec.plan_row)
PLAN_ROWS = ("warm_start", "rollout", "engine_restart_resync", "training", "weight_sync", "sync_verification",
             "layer_probe", "checkpoint_save")
PROBE_TOKENS = 4 * 2 * (8 + 16)  # rollout.verify_sync's probe: 4 prompts x 2 samples x (8 + 16) tokens
HEADROOM = 0.05  # of the GPU kept free: allocator fragmentation and the error of the estimates
DEFAULT_GPU_MEM_GIB = 80.0  # H100 80GB
MAX_SEARCH_GPUS = 256  # the advice looks for layouts up to this many GPUs
FUSED_STATS_PER_TOKEN = 8  # fp32 values per token of the fused logprob path: max, sum-exp, target logit, ...


# ------------------------------------------------------------------------------ architecture


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What the memory of a model depends on, read through :func:`hf_to_megatron` so it is what
    the trainer builds (q/k norms and biases by family)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    linear_bias: bool
    qk_norm: bool
    torch_dtype: str
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0

    @classmethod
    def from_hf(cls, hf: dict) -> "Architecture":
        args = hf_to_megatron(hf)
        t = args.transformer
        return cls(
            layers=t["num_layers"], hidden=t["hidden_size"], heads=t["num_attention_heads"],
            kv_heads=t["num_query_groups"], head_dim=t["kv_channels"], ffn=t["ffn_hidden_size"],
            vocab=args.vocab_size, tied=args.tie_word_embeddings, qkv_bias=t["add_qkv_bias"],
            linear_bias=t["add_bias_linear"], qk_norm=t["qk_layernorm"],
            torch_dtype=str(hf.get("torch_dtype") or "bfloat16"),
            experts=t.get("num_moe_experts", 0), topk=t.get("moe_router_topk", 0),
            expert_ffn=t.get("moe_ffn_hidden_size", 0),
        )

    def layer_params(self, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
        """(dense, expert) parameters of one layer on one rank. Norms and the router are replicated;
        a row-parallel bias is whole on every rank."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        dense = h * (q + 2 * kv) // tp + q * h // tp + 2 * h
        dense += (q + 2 * kv) // tp if self.qkv_bias else 0
        dense += h if self.linear_bias else 0
        dense += 2 * self.head_dim if self.qk_norm else 0
        if not self.experts:
            mlp = 3 * h * self.ffn // tp + ((2 * self.ffn // tp + h) if self.linear_bias else 0)
            return dense + mlp, 0
        one_expert = 3 * h * self.expert_ffn // etp + ((2 * self.expert_ffn // etp + h) if self.linear_bias else 0)
        return dense + h * self.experts, self.experts // ep * one_expert

    def adapter_params(self, lora, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
        """(dense, expert) LoRA parameters of one layer on one rank (megatron_alp/models/lora.py): a
        column-parallel layer's A (r x in) is whole and its B (out/TP x r) sharded, a row-parallel
        layer's A (r x in/TP) sharded and its B (out x r) whole; experts as their layers, under EP/ETP.
        The dense MLP targets count only for dense models (shared experts are not modelled)."""
        r, h, t = lora.rank, self.hidden, set(lora.target_modules)
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        dense = (r * h + r * (q + 2 * kv) // tp if "linear_qkv" in t else 0) + (r * q // tp + r * h
                                                                                if "linear_proj" in t else 0)
        if not self.experts:
            dense += (r * h + r * 2 * self.ffn // tp if "linear_fc1" in t else 0) + (
                r * self.ffn // tp + r * h if "linear_fc2" in t else 0)
            return dense, 0
        one_expert = 2 * r * h + 3 * r * self.expert_ffn // etp
        return dense, (self.experts // ep * one_expert if "experts" in t else 0)

    @property
    def embedding_params(self) -> int:
        """Input embedding plus, when untied, the output layer."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def total_params(self) -> int:
        dense, expert = self.layer_params()
        return self.layers * (dense + expert) + self.embedding_params + self.hidden


def resolve_architecture(cfg: Config, hf_config: Optional[dict] = None) -> tuple[dict, str]:
    """The HF config the plan counts, and where it came from: ``hf_config`` as given, the tiny
    model's, ``model.hf_path``/config.json, or the bundled published config named like the
    basename of ``model.hf_path`` (the shipped configs point at placeholder paths)."""
    if hf_config is not None:
        return hf_config, "the given HF config"
    m = cfg.model
    if m.tiny is not None:
        return tiny_hf_config(m.tiny, **m.tiny_config), f"tiny {m.tiny} model (model.tiny)"
    path = Path(m.hf_path)
    if (path / "config.json").is_file():
        return load_hf_config(path), str(path / "config.json")
    published = PUBLISHED / f"{path.name}.json"
    if published.is_file():
        return json.loads(published.read_text()), (
            f"bundled published config megatron_alp/models/published/{published.name} "
            f"(model.hf_path {m.hf_path} has no config.json here)")
    bundled = ", ".join(sorted(p.stem for p in PUBLISHED.glob("*.json")))
    raise ConfigError(
        f"model.hf_path: {m.hf_path} has no config.json, and no published config is bundled for "
        f"{path.name!r} (bundled: {bundled}); point model.hf_path at the model's directory")


# ------------------------------------------------------------------------------------ layout


@dataclasses.dataclass(frozen=True)
class Layout:
    gpus: int  # the trainer's ranks, one GPU each
    tp: int
    pp: int
    ep: int
    etp: int
    sp: bool
    distributed_optimizer: bool
    rollout_tp: int
    replicas: int
    separate_gpus: tuple[int, ...] = ()  # placement: separate: rollout.gpus, the engines' GPUs of every node
    nodes: int = 1  # placement: separate: nodes of gpus // nodes trainer ranks each

    @classmethod
    def of(cls, cfg: Config, gpus: int, nproc_per_node: Optional[int] = None) -> "Layout":
        """``gpus`` trainer ranks; with ``placement: separate``, ``nproc_per_node`` of them per node
        (default: the GPUs below the first of ``rollout.gpus``), and the nodes' ``rollout.gpus`` beside."""
        p, r = cfg.parallel, cfg.rollout
        check_sync_placement(r, gpu=True)  # the plan is of a GPU job
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        replicas, separate, nodes = r.replicas, (), 1
        if r.placement == "separate":
            local = nproc_per_node or min([gpus, *r.gpus])
            if gpus % local:
                raise ConfigError(f"--gpus {gpus} trainer GPUs are not whole nodes of {local} trainer ranks "
                                  "(--nproc-per-node; default: the GPUs below the first of rollout.gpus)")
            if r.gpus and min(r.gpus) < local:
                raise ConfigError(f"rollout.gpus {r.gpus} overlap GPUs 0-{local - 1}, which the node's {local} "
                                  "trainer ranks use (placement: separate)")
            replicas = replica_layout(r, gpus, gpus, gpu=True, local_world=local).replicas
            separate, nodes = tuple(r.gpus), gpus // local
        elif replicas == "auto":
            replicas = auto_replicas(r, gpus, gpus // (tp * pp), gpu=True, local_world=gpus)
        return cls(gpus, tp, pp, p.expert_model_parallel_size, p.expert_tensor_parallel_size or tp,
                   p.sequence_parallel, p.use_distributed_optimizer, r.tensor_parallel_size, replicas, separate, nodes)

    @property
    def separate(self) -> bool:
        return bool(self.separate_gpus)

    @property
    def engine_gpu_count(self) -> int:
        """GPUs of the job that only the engines use (placement: separate), besides the trainer's."""
        return self.nodes * len(self.separate_gpus)

    @property
    def replica_stride(self) -> int:
        return self.gpus // self.replicas

    def stages_with_engine(self) -> list[int]:
        """Pipeline stages (Megatron orders ranks with PP outermost) that have a GPU holding an engine."""
        if self.separate:
            return []
        per_stage = self.gpus // self.pp
        return [s for s in range(self.pp)
                if any(g % self.replica_stride < self.rollout_tp for g in range(s * per_stage, (s + 1) * per_stage))]

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.gpus // (self.etp * self.ep * self.pp)

    def check(self, arch: Architecture) -> None:
        """Refuse a layout Megatron, vLLM or the GPU count cannot run, naming the keys."""
        rules = [
            (self.gpus % (self.tp * self.pp) == 0,
             f"--gpus {self.gpus} is not a multiple of parallel.tensor_model_parallel_size x "
             f"pipeline_model_parallel_size = {self.tp * self.pp}"),
            (not arch.experts or self.gpus % (self.etp * self.ep * self.pp) == 0,
             f"--gpus {self.gpus} is not a multiple of parallel.expert_tensor_parallel_size x "
             f"expert_model_parallel_size x pipeline_model_parallel_size = {self.etp * self.ep * self.pp}"),
            (arch.heads % self.tp == 0 and arch.kv_heads % self.tp == 0 and arch.vocab % self.tp == 0
             and (arch.experts or arch.ffn % self.tp == 0),
             f"parallel.tensor_model_parallel_size={self.tp} does not divide the model's heads "
             f"({arch.heads}), KV heads ({arch.kv_heads}), vocabulary ({arch.vocab}) or FFN ({arch.ffn})"),
            (arch.layers % self.pp == 0,
             f"parallel.pipeline_model_parallel_size={self.pp} does not divide the {arch.layers} layers"),
            (arch.experts % self.ep == 0 if arch.experts else self.ep == 1,
             f"parallel.expert_model_parallel_size={self.ep} does not divide the model's "
             f"{arch.experts or 'absent'} experts"),
            (arch.expert_ffn % self.etp == 0,
             f"parallel.expert_tensor_parallel_size={self.etp} does not divide the experts' FFN ({arch.expert_ffn})"),
            (not arch.experts or self.tp == 1 or self.sp,
             "parallel.sequence_parallel must be true for a mixture-of-experts model with TP > 1"),
            (arch.heads % self.rollout_tp == 0 and (self.separate or self.rollout_tp <= self.gpus),
             f"rollout.tensor_parallel_size={self.rollout_tp} must divide the model's {arch.heads} heads "
             + ("" if self.separate else f"and fit in --gpus {self.gpus}")),
            (self.separate or (self.gpus % self.replicas == 0 and self.replica_stride >= self.rollout_tp),
             f"rollout.replicas={self.replicas} must divide --gpus {self.gpus} into blocks of at least "
             f"rollout.tensor_parallel_size={self.rollout_tp} GPUs"),
        ]
        wrong = [msg for ok, msg in rules if not ok]
        if wrong:
            raise ConfigError("parallel layout cannot run:\n  " + "\n  ".join(wrong))

    def describe(self, moe: bool) -> str:
        parts = [f"TP{self.tp}" + (" (SP)" if self.sp else ""), f"PP{self.pp}"]
        if moe:
            parts.append(f"EP{self.ep} (expert TP{self.etp}, expert-DP{self.expert_dp})")
        parts.append(f"DP{self.dp}")
        opt = "distributed optimizer" if self.distributed_optimizer else "replicated optimizer"
        if self.separate:
            return (f"{' x '.join(parts)}, {opt}; {self.nodes} node{'s, each' if self.nodes > 1 else ''} with "
                    f"trainer ranks on GPUs 0-{self.gpus // self.nodes - 1} and rollout engines TP{self.rollout_tp} "
                    f"on rollout.gpus {list(self.separate_gpus)} ({self.replicas} replicas in all)")
        return f"{' x '.join(parts)}, {opt}; rollout engine TP{self.rollout_tp} on {self.engine_gpus}"

    @property
    def engine_gpus(self) -> str:
        first = "GPU 0" if self.rollout_tp == 1 else f"GPUs 0-{self.rollout_tp - 1}"
        if self.replicas == 1:
            return first
        if self.replica_stride == self.rollout_tp:
            return f"every GPU ({self.replicas} replicas)"
        return f"{first} of every {self.replica_stride} GPUs ({self.replicas} replicas)"


def default_gpus(cfg: Config) -> int:
    """The fewest GPUs the config's layout runs on (not its stated hardware: pass --gpus for that);
    with ``placement: separate`` the fewest trainer GPUs, enough to lead one node's engine replicas."""
    p, r = cfg.parallel, cfg.rollout
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    unit = math.lcm(p.tensor_model_parallel_size * p.pipeline_model_parallel_size,
                    etp * p.expert_model_parallel_size * p.pipeline_model_parallel_size)
    if r.placement == "separate":
        return math.lcm(unit, max(1, len(r.gpus) // r.tensor_parallel_size))
    return unit * math.ceil(r.tensor_parallel_size / unit)


# ---------------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Item:
    key: str  # stable name: weights, reference, grads, optimizer, activations, logits or hidden, ...
    label: str
    nbytes: int
    basis: str  # how it was counted (or why it is 0)


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str  # "training" (the logprob passes and the update), "rollout", or a phase of the table
    title: str
    where: str  # which GPU the phase is counted on
    items: tuple[Item, ...]
    not_run: str = ""  # why this config never runs the phase (then it holds nothing)

    @property
    def total(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def resident(self) -> tuple[str, ...]:
        return tuple(i.key for i in self.items if i.nbytes)

    def nbytes(self, key: str) -> int:
        return next(i.nbytes for i in self.items if i.key == key)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    source: str  # where the architecture came from
    layout: str
    gpus: int  # the trainer's
    gpu_mem_bytes: int
    phases: tuple[Phase, ...]
    offloaded_bytes: int  # host memory per GPU for the state offloaded during rollout
    notes: tuple[str, ...]
    problems: tuple[str, ...]
    failing: tuple[str, ...]  # which checks failed: training, rollout, kv_cache
    engine_minimum: int  # engine weights + workspace + the KV cache of one full-length sequence
    advice: tuple[str, ...] = ()
    engine_gpus: int = 0  # placement: separate: the engines' own GPUs, besides the trainer's

    @property
    def hardware(self) -> str:
        if not self.engine_gpus:
            return _gpus(self.gpus)
        return f"{_gpus(self.gpus).replace('GPU', 'trainer GPU')} + {_gpus(self.engine_gpus).replace('GPU', 'engine GPU')}"

    @property
    def usable(self) -> int:
        return int(self.gpu_mem_bytes * (1 - HEADROOM))

    @property
    def peak(self) -> int:
        return max(p.total for p in self.phases)

    @property
    def fits(self) -> bool:
        return not self.problems

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def report(self) -> str:
        """The table `megatron-alp plan` prints: phase, component, GiB per GPU, how it was counted."""
        rows = [("phase", "component", "GiB/GPU", "counted as")]
        for ph in self.phases:
            rows.append((ph.title, "", "", ""))
            if ph.not_run:
                rows.append((f"  not run ({ph.not_run})", "", "", ""))
                continue
            rows.append((f"  {ph.where}", "", "", ""))
            rows += [("", i.label, _gib(i.nbytes), i.basis) for i in ph.items]
            rows.append(("", "total", _gib(ph.total), ""))
        widths = [max(len(r[c]) for r in rows if r[1] or r is rows[0]) for c in range(3)]  # titles overhang
        lines = [f"model   {self.source}",
                 f"layout  {self.hardware} x {self.gpu_mem_bytes / GiB:g} GiB: {self.layout}", ""]
        for r in rows:
            lines.append(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip())
        verdict = "FITS" if self.fits else "DOES NOT FIT"
        lines += ["", f"peak {_gib(self.peak)} GiB of {_gib(self.usable)} GiB usable "
                      f"({1 - HEADROOM:.0%} of {self.gpu_mem_bytes / GiB:g} GiB): {verdict}"]
        lines += list(self.notes)
        lines.append("Estimates, not measurements (formulas: docs/memory_plan.md); the GPU self-test "
                     "measures the real peaks.")
        return "\n".join(lines)

    def refusal(self) -> str:
        """Why the plan does not fit and which keys would change that (each change planned alone)."""
        lines = [f"the memory plan does not fit {self.hardware} of {self.gpu_mem_bytes / GiB:g} GiB:"]
        lines += [f"  - {p}" for p in self.problems]
        if self.advice:
            lines.append("to make it fit:")
            lines += [f"  {a}" for a in self.advice]
        return "\n".join(lines)


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("s" if n != 1 else "")


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:.0f}"


def _activations_per_token_layer(arch: Architecture, lay: Layout, b: int) -> float:
    """Bytes one token leaves saved in one layer for the backward (see the module docstring)."""
    h, q, kv = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    seq = b * 4 * h / (lay.tp if lay.sp else 1)
    attn = b * (2 * q + 2 * kv + (q + kv if arch.qk_norm else 0)) / lay.tp
    if arch.experts:
        mlp = (8 * arch.experts + b * arch.topk * lay.etp * (2 * h + 3 * arch.expert_ffn / lay.etp)) / lay.tp
    else:
        mlp = b * 3 * arch.ffn / lay.tp
    return seq + attn + mlp


def _stage_params(arch: Architecture, lay: Layout) -> list[tuple[int, int]]:
    """(dense, expert) parameters of one rank of the first and the last pipeline stage (one entry
    without PP): the embedding sits on the first, final norm and output layer on the last, and tied
    embeddings keep a copy on each when they differ."""
    dense, expert = arch.layer_params(lay.tp, lay.ep, lay.etp)
    layers = arch.layers // lay.pp
    embed = arch.vocab * arch.hidden // lay.tp
    if lay.pp == 1:
        return [(layers * dense + embed * (1 if arch.tied else 2) + arch.hidden, layers * expert)]
    return [(layers * dense + embed, layers * expert), (layers * dense + embed + arch.hidden, layers * expert)]


def _trained_params(cfg: Config, arch: Architecture, lay: Layout, dense: int, expert: int) -> tuple[int, int]:
    """(dense, expert) parameters of one rank that have gradients and optimizer state: with LoRA the
    adapters only, the base being frozen."""
    if not cfg.lora.enabled:
        return dense, expert
    layers = arch.layers // lay.pp
    dense, expert = arch.adapter_params(cfg.lora, lay.tp, lay.ep, lay.etp)
    return layers * dense, layers * expert


def _megatron_state(cfg: Config, arch: Architecture, lay: Layout, dense: int, expert: int) -> list[Item]:
    """Weights (policy and reference), gradient buffer and optimizer state of one rank. With LoRA the
    base is frozen (no gradient, no optimizer state) and the reference is the same weights with the
    adapters off; gradients and optimizer state are the adapters' only."""
    b = DTYPE_BYTES[cfg.model.dtype]
    params = dense + expert
    per_param = 12 if b == 2 else 8  # fp32 master copy + Adam m, v; a float32 model is its own master
    dp, edp = (lay.dp, lay.expert_dp) if lay.distributed_optimizer else (1, 1)
    split = f" ({_count(dense)} dense + {_count(expert)} expert)" if expert else ""
    items = [Item("weights", f"policy weights ({cfg.model.dtype})", params * b,
                  f"{_count(params)} params{split} x {b} B")]
    if cfg.lora.enabled:
        dense, expert = _trained_params(cfg, arch, lay, dense, expert)
        params = dense + expert
        items = [Item("weights", f"policy weights ({cfg.model.dtype}): frozen base + LoRA", items[0].nbytes + params * b,
                      f"{items[0].basis} + {_count(params)} adapter params (rank {cfg.lora.rank}) x {b} B")]
    elif cfg.loss.kl_coef > 0:
        items.append(Item("reference", f"reference weights ({cfg.model.dtype})", params * b,
                          "same, no gradients (loss.kl_coef > 0)"))
    what = "adapter " if cfg.lora.enabled else ""
    return items + [
        Item("grads", "gradient buffer (fp32)", params * 4, f"{_count(params)} {what}x 4 B, not sharded"),
        Item("optimizer", "optimizer state", per_param * (math.ceil(dense / dp) + math.ceil(expert / edp)),
             f"{per_param} B x ({_count(dense)} {what}/ DP{dp}"
             + (f" + {_count(expert)} / expert-DP{edp})" if expert else ")")),
    ]


@dataclasses.dataclass(frozen=True)
class MicroBatchShape:
    """The worst micro-batch of a pass: ``tokens`` computed, ``square`` the sum over its rows of the
    row length squared (the attention scores of unfused attention), and how it is cut."""

    tokens: int
    square: int
    describe: str  # for the notes: "4 x 4096 tokens", "16384 tokens (token budget, padded)"

    @classmethod
    def of(cls, cfg: Config, seq: int, budget: Optional[int]) -> "MicroBatchShape":
        """``budget`` tokens (None: ``micro_batch_size`` rows of ``seq``), as padded rows or, with
        ``sequence_packing``, one packed row."""
        t = cfg.trainer
        if budget is None:
            return cls(t.micro_batch_size * seq, t.micro_batch_size * seq**2, f"{t.micro_batch_size} x {seq} tokens")
        if t.sequence_packing:
            return cls(budget, budget**2, f"{budget} tokens (token budget, packed)")
        # r rows of longest L with r x L <= budget, L <= seq: r x L^2 grows with r while L = seq,
        # then shrinks as L = budget // r, so the worst is at r = budget // seq or one row more.
        full = max(1, budget // seq)
        square = max(full * min(seq, budget // full) ** 2, (full + 1) * min(seq, budget // (full + 1)) ** 2)
        return cls(budget, square, f"{budget} tokens (token budget, padded)")


def _probs(cfg: Config, arch: Architecture, lay: Layout, shape: MicroBatchShape) -> float:
    """Attention probabilities of one layer: unfused attention (``layer_spec: local``) only."""
    if cfg.model.layer_spec != "local":
        return 0.0  # flash attention (TE): padded rows, or packed rows in THD layout
    return DTYPE_BYTES[cfg.model.dtype] * arch.heads / lay.tp * shape.square


def _activations(cfg: Config, arch: Architecture, lay: Layout, shape: MicroBatchShape, in_flight: int) -> Item:
    """Activations of one stage's layers kept for the backward, ``in_flight`` micro-batches of them."""
    m = cfg.model
    b = DTYPE_BYTES[m.dtype]
    layers = arch.layers // lay.pp
    tokens = shape.tokens
    per_token = _activations_per_token_layer(arch, lay, b)
    probs = _probs(cfg, arch, lay, shape)
    label = f"activations ({in_flight} micro-batch{'es' if in_flight > 1 else ''} in flight)"
    if m.recompute == "full":
        chunk = min(m.recompute_num_layers, layers)
        chunks = math.ceil(layers / chunk)
        inputs = chunks * tokens * b * arch.hidden / (lay.tp if lay.sp else 1)
        nbytes = in_flight * inputs + chunk * (tokens * per_token + probs)
        return Item("activations", label, int(nbytes),
                    f"full recompute: {chunks} chunk inputs + {chunk} layer(s) recomputed, {tokens} tok"
                    + (" + attention probs" if probs else ""))
    kept = tokens * per_token + (0.0 if m.recompute == "selective" else probs)
    return Item("activations", label, int(in_flight * layers * kept),
                f"{layers} layers x {tokens} tok x {per_token / 1024:.1f} KiB"
                + (" + attention probs" if kept > tokens * per_token else ""))


def _forward_activations(cfg: Config, arch: Architecture, lay: Layout, shape: MicroBatchShape) -> Item:
    """A forward-only pass keeps nothing for a backward: one layer's activations at a time."""
    per_token = _activations_per_token_layer(arch, lay, DTYPE_BYTES[cfg.model.dtype])
    probs = _probs(cfg, arch, lay, shape)
    return Item("activations", "activations (forward only, one layer)", int(shape.tokens * per_token + probs),
                f"1 layer x {shape.tokens} tok x {per_token / 1024:.1f} KiB" + (" + attention probs" if probs else ""))


def _output(cfg: Config, arch: Architecture, lay: Layout, tokens: int, backward: bool) -> list[Item]:
    """What the last stage holds to turn its output into logprobs (see the module docstring)."""
    m = cfg.model
    b = DTYPE_BYTES[m.dtype]
    v_local = arch.vocab // lay.tp
    chunk = min(CHUNK_ELEMENTS["cuda"], tokens * v_local)
    chunks = Item("logprob_chunks", "logprob working chunks (fp32)", 2 * chunk * 4, "2 x CHUNK_ELEMENTS['cuda'] x 4 B")
    if not cfg.trainer.fused_linear_logprobs:
        copies = 2 if backward else 1
        return [Item("logits", f"logits + their gradient ({m.dtype})" if backward else f"logits ({m.dtype})",
                     tokens * v_local * copies * b, f"{tokens} tok x {v_local} vocab/TP x ({copies} x {b}) B"), chunks]
    items = [Item("hidden", f"final hidden states ({m.dtype})", tokens * arch.hidden * b,
                  f"{tokens} tok x {arch.hidden} hidden x {b} B (fused_linear_logprobs)")]
    if backward:
        items.append(Item("hidden_grad", "their gradient (fp32 accumulator)", tokens * arch.hidden * 4,
                          f"{tokens} tok x {arch.hidden} hidden x 4 B"))
    return items + [chunks, Item("token_stats", "per-token logprob statistics (fp32)",
                                 tokens * FUSED_STATS_PER_TOKEN * 4, f"{tokens} tok x {FUSED_STATS_PER_TOKEN} x 4 B")]


def _logprob_budget(cfg: Config) -> Optional[int]:
    t = cfg.trainer
    return t.logprob_max_tokens_per_micro_batch or t.max_tokens_per_micro_batch


def _training(cfg: Config, arch: Architecture, lay: Layout, seq: int, engine_budget: int) -> Phase:
    """The policy update, or the forward-only logprob passes where they are the fuller, on the
    fullest pipeline stage."""
    t, r = cfg.trainer, cfg.rollout
    update = MicroBatchShape.of(cfg, seq, t.max_tokens_per_micro_batch)
    logprob = MicroBatchShape.of(cfg, seq, _logprob_budget(cfg))
    per_rank = t.prompts_per_iteration * r.sampling.n / (t.updates_per_iteration * lay.dp)
    if t.max_tokens_per_micro_batch:  # worst case: every sequence full length
        micro_batches = max(1, math.ceil(per_rank * seq / t.max_tokens_per_micro_batch))
    else:
        micro_batches = max(1, math.ceil(per_rank / t.micro_batch_size))
    stages = _stage_params(arch, lay)
    phases = []
    for index, (dense, expert) in enumerate(stages):
        first, last = index == 0, index == len(stages) - 1
        state = _megatron_state(cfg, arch, lay, dense, expert)
        fixed = [Item("runtime", "CUDA context, NCCL, workspaces", RUNTIME_BYTES, "fixed allowance")]
        if (0 if first else lay.pp - 1) in lay.stages_with_engine():
            asleep = r.free_memory_during_training
            fixed.append(Item("engine", "rollout engine " + ("asleep" if asleep else "awake"),
                              ENGINE_ASLEEP_BYTES if asleep else engine_budget,
                              "fixed allowance" if asleep else "rollout.free_memory_during_training: false"))
        where = "GPU 0" if lay.pp == 1 else "first pipeline stage" if first else "last pipeline stage"
        passes = [
            ("training (policy update)",
             [_activations(cfg, arch, lay, update, min(lay.pp, micro_batches) if first else 1)]
             + (_output(cfg, arch, lay, update.tokens, backward=True) if last else [])),
            ("training (old/reference logprob pass)",
             [_forward_activations(cfg, arch, lay, logprob)]
             + (_output(cfg, arch, lay, logprob.tokens, backward=False) if last else [])),
        ]
        phases += [Phase("training", title, where, tuple(state + held + fixed)) for title, held in passes]
    return max(phases, key=lambda p: p.total)  # the first of equals: the update


def _rollout(cfg: Config, arch: Architecture, lay: Layout, gpu_mem_gib: float, engine_weights: int,
             kv_cache: int) -> Phase:
    """The engine awake beside what ``rollout.offload_*`` leave of Megatron's state, on the fullest
    pipeline stage that has an engine GPU."""
    r = cfg.rollout
    stages = _stage_params(arch, lay)  # the first stage's parameters, and the last's (PP > 1)
    held = [stages[0 if s == 0 else -1] for s in lay.stages_with_engine()]
    offloaded_by = {"weights": "weights", "reference": "weights", "grads": "grads", "optimizer": "optimizer"}
    items = []
    for item in _megatron_state(cfg, arch, lay, *max(held, key=sum)):
        key = offloaded_by[item.key]
        off = getattr(r, f"offload_{key}")
        how = "released" if key == "grads" else "offloaded"  # gradients are zeroed before every update anyway
        items.append(Item(item.key, item.label, 0, f"{how} (rollout.offload_{key})") if off else item)
    weight_bytes = 1 if r.quantization != "none" else _engine_bytes(cfg, arch)
    items += [
        Item("runtime", "CUDA context, NCCL, workspaces", RUNTIME_BYTES, "fixed allowance"),
        Item("engine_weights", "engine weights", engine_weights,
             f"{_count(arch.total_params)} x {weight_bytes} B / engine TP{lay.rollout_tp}"),
        Item("engine_workspace", "engine activations, CUDA graphs", ENGINE_WORKSPACE_BYTES, "fixed allowance"),
        Item("kv_cache", "KV cache", max(kv_cache, 0),
             f"rest of rollout.gpu_memory_utilization {r.gpu_memory_utilization} x {gpu_mem_gib:g} GiB"),
    ]
    return Phase("rollout", "rollout, engine start, validation (engine awake)", f"engine {lay.engine_gpus}",
                 tuple(items))


def _engine_items(cfg: Config, arch: Architecture, lay: Layout, state: str, gpu_mem_gib: float,
                  engine_weights: int, kv_cache: int) -> list[Item]:
    """The engine's memory on a GPU that holds one, in ``state`` (asleep, weights or awake); an
    engine that never sleeps (``rollout.free_memory_during_training: false``) is always awake."""
    r = cfg.rollout
    if not r.free_memory_during_training:
        state = "awake"
    asleep = Item("engine", "rollout engine asleep", ENGINE_ASLEEP_BYTES,
                  "fixed allowance: CUDA context, graph pool, NCCL buffers")
    weight_bytes = 1 if r.quantization != "none" else _engine_bytes(cfg, arch)
    weights = Item("engine_weights", "engine weights", engine_weights,
                   f"{_count(arch.total_params)} x {weight_bytes} B / engine TP{lay.rollout_tp}")
    if state == "asleep":
        return [asleep]
    if state == "weights":
        return [weights, asleep]
    return [weights,
            Item("engine_workspace", "engine activations, CUDA graphs", ENGINE_WORKSPACE_BYTES, "fixed allowance"),
            Item("kv_cache", "KV cache", max(kv_cache, 0),
                 f"rest of rollout.gpu_memory_utilization {r.gpu_memory_utilization} x {gpu_mem_gib:g} GiB")]


def _sync_bucket(cfg: Config, arch: Architecture, leader: bool) -> Item:
    """The gathered weight-sync bucket: ``rollout.sync_bucket_mb``, or one whole layer where a layer
    is bigger (buckets never split a layer); a colocated leader holds its IPC copy as well."""
    r = cfg.rollout
    dense, expert = arch.layer_params()
    layer = (dense + expert) * _engine_bytes(cfg, arch)
    bucket = max(r.sync_bucket_mb << 20, layer)
    copies = 2 if leader else 1
    return Item("sync_bucket", "weight-sync bucket" + (" and its copy for the engine" if leader else ""),
                copies * bucket, f"{copies} x max(rollout.sync_bucket_mb, one layer {_gib(layer)} GiB)")


def _phase_runs(cfg: Config, spec: PhaseSpec) -> Optional[str]:
    """None when the config runs phase ``spec``, else why it does not."""
    if spec.name == "validation" and not cfg.trainer.eval_interval:
        return "trainer.eval_interval: 0"
    if spec.name == "sync_verification" and not cfg.rollout.verify_sync:
        return "rollout.verify_sync: false"
    if spec.name == "layer_probe" and not (cfg.perturbation.init_std == "auto"
                                           and cfg.perturbation.calibration_mode == "per_layer"):
        return "perturbation.calibration_mode: per_layer not set"
    if spec.name == "warm_start" and cfg.model.tiny is None:
        return "not a tiny model: model.tiny unset"
    if spec.name == "warm_start" and not cfg.trainer.sft_warmup_steps:
        return "trainer.sft_warmup_steps: 0"
    return None


def _table_phase(cfg: Config, arch: Architecture, lay: Layout, spec: PhaseSpec, gpu_mem_gib: float,
                 engine_weights: int, kv_cache: int) -> Phase:
    """A phase of the table (megatron_alp/trainer/phases.py) on its fullest GPU: the Megatron state it
    needs (the rest offloaded where ``rollout.offload_*`` allow), what it allocates, and the engine
    memory it keeps awake on a GPU that holds an engine."""
    r = cfg.rollout
    moves = r.placement == "colocated" and r.free_memory_during_training
    part_of = {"weights": "policy", "reference": "reference", "grads": "grads", "optimizer": "optimizer"}
    kind_of = {"weights": "weights", "reference": "weights", "grads": "grads", "optimizer": "optimizer"}
    needed = parts_of(spec.megatron)
    candidates = []
    stages = _stage_params(arch, lay)
    for index, (dense, expert) in enumerate(stages):
        first, last = index == 0, index == len(stages) - 1
        items = []
        if spec.name != "warm_start":
            for item in _megatron_state(cfg, arch, lay, dense, expert):
                kind = kind_of[item.key]
                if part_of[item.key] not in needed and moves and getattr(r, f"offload_{kind}"):
                    how = "released" if kind == "grads" else "offloaded"
                    item = Item(item.key, item.label, 0, f"{how} (rollout.offload_{kind}; not needed here)")
                items.append(item)
        if spec.work == "save":
            saving = _save_transient(cfg, arch, lay, dense, expert)
            items.append(Item("save_transient", "optimizer state gathered for the save", saving.gpu, saving.basis))
        engine_here = (0 if first else lay.pp - 1) in lay.stages_with_engine()
        if spec.work == "bucket":
            items.append(_sync_bucket(cfg, arch, leader=engine_here and r.sync_method != "broadcast"))
        if spec.work == "probe":
            probe = MicroBatchShape(PROBE_TOKENS, PROBE_TOKENS * 24, "probe")
            items.append(_forward_activations(cfg, arch, lay, probe))
            items += _output(cfg, arch, lay, PROBE_TOKENS, backward=False) if last else []
        if spec.work == "layer_probe":  # one sequence at a time, a plain forward: full logits
            n, b = LAYER_PROBE_TOKENS, DTYPE_BYTES[cfg.model.dtype]
            items.append(_forward_activations(cfg, arch, lay, MicroBatchShape(n, n * n, f"{n} tokens (layer probe)")))
            items += [Item("logits", f"logits ({cfg.model.dtype})", n * (arch.vocab // lay.tp) * b,
                           f"{n} tok x {arch.vocab // lay.tp} vocab/TP x {b} B")] if last else []
        items.append(Item("runtime", "CUDA context, NCCL, workspaces", RUNTIME_BYTES, "fixed allowance"))
        if engine_here and spec.engine != "none":
            items += _engine_items(cfg, arch, lay, spec.engine, gpu_mem_gib, engine_weights, kv_cache)
        where = "GPU 0" if lay.pp == 1 else "first pipeline stage" if first else "last pipeline stage"
        candidates.append(Phase(spec.name, spec.title, where, tuple(items)))
    return max(candidates, key=lambda p: p.total)


def _save_transient(cfg: Config, arch: Architecture, lay: Layout, dense: int, expert: int) -> SaveTransient:
    """What a checkpoint save of one rank allocates beyond its state (megatron_alp/training/dist_checkpoint.py):
    the distributed optimizer's buffers (dense over DP, expert over expert-DP) are gathered, and the
    writer stages the GPU tensors the rank writes: its weights, and a plain optimizer's state."""
    b = DTYPE_BYTES[cfg.model.dtype]
    trained_dense, trained_expert = _trained_params(cfg, arch, lay, dense, expert)
    staged = (dense + expert) * b
    if not lay.distributed_optimizer:
        return save_transient([], staged + (12 if b == 2 else 8) * (trained_dense + trained_expert))
    buffers = [(trained_dense, lay.dp)] + ([(trained_expert, lay.expert_dp)] if trained_expert else [])
    return save_transient(buffers, staged)


def _separate_rollout(cfg: Config, arch: Architecture, lay: Layout, gpu_mem_gib: float, engine_weights: int,
                      kv_cache: int) -> Phase:
    """An engine GPU of ``placement: separate``: the engine's budget, and a weight-sync bucket that
    arrives after vLLM has sized its KV cache (outside the budget). No trainer process is on it."""
    r = cfg.rollout
    weight_bytes = 1 if r.quantization != "none" else _engine_bytes(cfg, arch)
    items = (
        Item("engine_weights", "engine weights", engine_weights,
             f"{_count(arch.total_params)} x {weight_bytes} B / engine TP{lay.rollout_tp}"),
        Item("engine_workspace", "engine activations, CUDA graphs", ENGINE_WORKSPACE_BYTES, "fixed allowance"),
        Item("kv_cache", "KV cache", max(kv_cache, 0),
             f"rest of rollout.gpu_memory_utilization {r.gpu_memory_utilization} x {gpu_mem_gib:g} GiB"),
        Item("sync_bucket", "weight-sync bucket", r.sync_bucket_mb << 20,
             "rollout.sync_bucket_mb, outside the engine's budget"),
    )
    return Phase("rollout", "rollout (engine on a GPU of its own)", "an engine GPU", items)


def _engine_bytes(cfg: Config, arch: Architecture) -> int:
    """Bytes per element of the engine's weights and KV cache before quantization (`auto`: the
    checkpoint's)."""
    dtype = arch.torch_dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype
    return DTYPE_BYTES.get(dtype, 2)


def _plan(cfg: Config, gpus: int, gpu_mem_gib: float, hf: dict, source: str,
          nproc_per_node: Optional[int] = None) -> MemoryPlan:
    arch = Architecture.from_hf(hf)
    lay = Layout.of(cfg, gpus, nproc_per_node)
    lay.check(arch)
    t, r = cfg.trainer, cfg.rollout
    responses = t.prompts_per_iteration * r.sampling.n
    if responses % (lay.dp * t.updates_per_iteration):
        raise ConfigError(
            f"trainer.prompts_per_iteration x rollout.sampling.n = {responses} responses do not split evenly into "
            f"data-parallel size {lay.dp} x trainer.updates_per_iteration {t.updates_per_iteration}")
    total = int(gpu_mem_gib * GiB)
    usable = int(total * (1 - HEADROOM))
    seq = resolve_max_model_len(r, hf)
    budget = int(r.gpu_memory_utilization * total)
    engine_bytes = _engine_bytes(cfg, arch)
    weight_bytes = 1 if r.quantization != "none" else engine_bytes  # embeddings stay unquantized
    embeddings = arch.embedding_params
    engine_weights = ((arch.total_params - embeddings) * weight_bytes + embeddings * engine_bytes) // lay.rollout_tp
    kv_cache = budget - engine_weights - ENGINE_WORKSPACE_BYTES
    kv_per_token = (2 * arch.layers * max(1, arch.kv_heads // lay.rollout_tp) * arch.head_dim
                    * (1 if r.kv_cache_dtype == "fp8" else engine_bytes))
    one_sequence = kv_per_token * seq
    training = _training(cfg, arch, lay, seq, budget)
    rollout = (_separate_rollout if lay.separate else _rollout)(cfg, arch, lay, gpu_mem_gib, engine_weights, kv_cache)

    problems, failing = [], []
    if training.total > usable:
        failing.append("training")
        problems.append(f"{training.title} needs {_gib(training.total)} GiB on {training.where}, "
                        f"over the {_gib(usable)} GiB usable")
    if rollout.total > usable and lay.separate:
        failing.append("rollout")
        problems.append(f"{rollout.title}: the engine's budget rollout.gpu_memory_utilization {r.gpu_memory_utilization} "
                        f"x {gpu_mem_gib:g} GiB plus the weight-sync bucket (rollout.sync_bucket_mb) make "
                        f"{_gib(rollout.total)} GiB, over the {_gib(usable)} GiB usable")
    elif rollout.total > usable:
        failing.append("rollout")
        engine = max(budget, engine_weights + ENGINE_WORKSPACE_BYTES)
        problems.append(f"{rollout.title}: what stays of Megatron on {rollout.where} "
                        f"({_gib(rollout.total - engine)} GiB with the runtime) plus the engine's {_gib(engine)} GiB "
                        f"make {_gib(rollout.total)} GiB, over the {_gib(usable)} GiB usable (vLLM needs "
                        "rollout.gpu_memory_utilization x the GPU free when it starts and at every wake-up)")
    if kv_cache < one_sequence:
        failing.append("kv_cache")
        problems.append(f"the engine's KV cache ({_gib(max(kv_cache, 0))} GiB after weights and workspace) cannot "
                        f"hold one sequence of {seq} tokens ({_gib(one_sequence)} GiB): vLLM refuses to start")
    rows = {"training": training, "rollout": rollout}
    for spec in PHASES.values():
        if spec.plan_row in rows:
            continue
        why = _phase_runs(cfg, spec)
        phase = rows[spec.plan_row] = (Phase(spec.name, spec.title, "", (), not_run=why) if why else
                                       _table_phase(cfg, arch, lay, spec, gpu_mem_gib, engine_weights, kv_cache))
        if phase.total > usable:
            failing.append(spec.name)
            problems.append(f"{phase.title} needs {_gib(phase.total)} GiB on {phase.where}, over the "
                            f"{_gib(usable)} GiB usable")
    phases = tuple(rows[name] for name in PLAN_ROWS)
    kept = set(rollout.resident)
    offloaded = 0 if lay.separate else sum(i.nbytes for i in _megatron_state(cfg, arch, lay, *_stage_params(arch, lay)[0])
                                           if i.key not in kept and i.key != "grads")  # gradients are dropped
    micro_batch = MicroBatchShape.of(cfg, seq, t.max_tokens_per_micro_batch).describe
    if _logprob_budget(cfg):
        micro_batch += f"; old/reference logprob passes {_logprob_budget(cfg)} tokens (forward only)"
    notes = (
        f"sequence {seq} tokens (the engine context); micro-batch {micro_batch}",
        f"rollout: {kv_per_token / 1024:.1f} KiB of KV cache per token: {kv_cache // one_sequence} "
        f"full-length sequences at once (an iteration samples {responses}; the engine queues the rest)"
        if kv_cache >= one_sequence else
        f"rollout: {kv_per_token / 1024:.1f} KiB of KV cache per token: no room for one full-length sequence "
        "beside the engine's weights and workspace (raise rollout.gpu_memory_utilization)",
        "nothing offloaded: Megatron's state stays on the trainer GPUs, each engine keeps its own GPU "
        "(rollout.placement: separate)" if lay.separate else
        f"host memory for the offloaded state: {_gib(offloaded)} GiB per GPU",
    ) + _engine_host_note(cfg, lay, engine_weights) + _routing_note(cfg, arch, lay, responses, seq) + _save_note(
        cfg, arch, lay)
    return MemoryPlan(source, lay.describe(bool(arch.experts)), gpus, total, phases, offloaded,
                      notes, tuple(problems), tuple(failing), engine_weights + ENGINE_WORKSPACE_BYTES + one_sequence,
                      engine_gpus=lay.engine_gpu_count)


def _save_note(cfg: Config, arch: Architecture, lay: Layout) -> tuple[str, ...]:
    """The checkpoint save's host memory on the fullest stage (:func:`_save_transient`)."""
    host = max(_save_transient(cfg, arch, lay, *stage).host for stage in _stage_params(arch, lay))
    return (f"checkpoint save: {_gib(host)} GiB of host memory on a data-parallel group's first rank (the "
            "optimizer state gathered, the weights staged for writing)",)


def _engine_host_note(cfg: Config, lay: Layout, engine_weights: int) -> tuple[str, ...]:
    """The host copy of a sleeping engine's weights (megatron_alp/rollout/engine_memory.py): vLLM's
    level-1 sleep offloads them to pinned host memory, needed only where a sync re-sends the adapters
    alone (``lora.sync: adapter``; else level 2 discards them); SGLang keeps a host copy
    (``--enable-weights-cpu-backup``) whenever it frees its memory."""
    r = cfg.rollout
    if lay.separate or not r.free_memory_during_training:
        return ()
    if r.engine == "sglang" or (cfg.lora.enabled and cfg.lora.sync == "adapter"):
        why = ("SGLang's --enable-weights-cpu-backup" if r.engine == "sglang" else
               "vLLM sleep level 1: lora.sync: adapter never re-sends the base")
        return (f"sleeping engines: {_gib(engine_weights)} GiB of host memory per engine GPU for their weights "
                f"({why})",)
    return ("sleeping engines keep no weights in host memory (vLLM sleep level 2: every weight sync "
            "re-sends them)",)


def _routing_note(cfg: Config, arch: Architecture, lay: Layout, responses: int, seq: int) -> tuple[str, ...]:
    """Routing replay's host buffers on the fullest rank, ``[sequences, s, layers, k]`` in 1 byte per
    expert id up to 256 experts, else 2: the old-policy pass's experts of the rank's share (R2, and
    R3's update pass); under R3 also the engine's of the share, fetched and then laid out dense (two
    copies), and on a replica leader the engine's of its replica's responses, held there until the
    ranks that train them fetched them (:mod:`~megatron_alp.rollout.held_routing`)."""
    replay = cfg.moe.routing_replay
    if not arch.experts or replay == "none":
        return ()
    per_sequence = seq * arch.layers * arch.topk * (1 if arch.experts <= 256 else 2)
    share = responses // lay.dp
    host = share * per_sequence
    if replay == "r3":
        host += (2 * share + math.ceil(responses / lay.replicas)) * per_sequence
    return (f"routing replay ({replay}): {_gib(host)} GiB of host memory per rank for the expert ids "
            "(the micro-batch's slice goes to the GPU)",)


def _changes(cfg: Config, gpus: int, plan: MemoryPlan) -> list[tuple[list[str], int]]:
    """Single changes worth trying for the checks that failed: (overrides, gpus)."""
    p, m, t, r = cfg.parallel, cfg.model, cfg.trainer, cfg.rollout
    out: list[tuple[list[str], int]] = []
    util_min = math.ceil(100 * plan.engine_minimum / plan.gpu_mem_bytes) / 100
    if "training" in plan.failing:
        training = plan.phase("training")
        logits = sum(i.nbytes for i in training.items if i.key == "logits")
        if not t.fused_linear_logprobs and logits >= GiB:
            out.append((["trainer.fused_linear_logprobs=true"], gpus))
        if m.recompute != "full":
            out.append((["model.recompute=full"], gpus))
        # a budget must hold the longest sequence the engine can produce (the config's validation)
        longest = r.max_model_len or r.sampling.max_prompt_length + r.sampling.max_response_length
        budget, lp = t.max_tokens_per_micro_batch, t.logprob_max_tokens_per_micro_batch
        if budget is not None:
            if max(longest, budget // 2) < budget:
                out.append(([f"trainer.max_tokens_per_micro_batch={max(longest, budget // 2)}"], gpus))
        elif t.micro_batch_size > 1:
            out.append(([f"trainer.micro_batch_size={t.micro_batch_size // 2}"], gpus))
        if "logprob pass" in training.title and lp is not None and max(longest, lp // 2) < lp:
            out.append(([f"trainer.logprob_max_tokens_per_micro_batch={max(longest, lp // 2)}"], gpus))
        if p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
            out.append((["parallel.sequence_parallel=true"], gpus))
        if not p.use_distributed_optimizer:
            out.append((["parallel.use_distributed_optimizer=true"], gpus))
        out.append(([f"parallel.tensor_model_parallel_size={2 * p.tensor_model_parallel_size}",
                     "parallel.sequence_parallel=true"], gpus))
        out.append(([f"parallel.pipeline_model_parallel_size={2 * p.pipeline_model_parallel_size}"], gpus))
        if p.expert_model_parallel_size > 1:
            out.append(([f"parallel.expert_model_parallel_size={2 * p.expert_model_parallel_size}"], gpus))
        if not r.free_memory_during_training and r.placement == "colocated":
            out.append((["rollout.free_memory_during_training=true"], gpus))
        out.append(([], 2 * gpus))
    if "rollout" in plan.failing:
        if r.placement == "colocated":
            out += [([f"rollout.offload_{k}=true"], gpus) for k in ("weights", "grads", "optimizer")
                    if not getattr(r, f"offload_{k}")]
        budget = int(r.gpu_memory_utilization * plan.gpu_mem_bytes)
        util_max = math.floor(100 * (plan.usable - plan.phase("rollout").total + budget) / plan.gpu_mem_bytes) / 100
        if util_min <= util_max < r.gpu_memory_utilization:
            out.append(([f"rollout.gpu_memory_utilization={util_max}"], gpus))
        if r.placement == "separate" and r.sync_bucket_mb > 1:
            out.append(([f"rollout.sync_bucket_mb={r.sync_bucket_mb // 2}"], gpus))
    if "kv_cache" in plan.failing:
        if util_min <= 1:
            out.append(([f"rollout.gpu_memory_utilization={util_min}"], gpus))
        out.append(([f"rollout.tensor_parallel_size={2 * r.tensor_parallel_size}"], gpus))
        if r.kv_cache_dtype != "fp8":
            out.append((["rollout.kv_cache_dtype=fp8"], gpus))
        if r.quantization == "none":
            out.append((["rollout.quantization=fp8"], gpus))
    table = [PHASES[name] for name in plan.failing if name in PHASES]
    if table:
        if r.placement == "colocated":
            out += [([f"rollout.offload_{k}=true"], gpus) for k in ("weights", "grads", "optimizer")
                    if not getattr(r, f"offload_{k}")]
        if any(spec.work == "bucket" for spec in table) and r.sync_bucket_mb > 64:
            out.append(([f"rollout.sync_bucket_mb={r.sync_bucket_mb // 2}"], gpus))
        if any(spec.engine == "awake" for spec in table) and r.gpu_memory_utilization > util_min:
            out.append(([f"rollout.gpu_memory_utilization={max(util_min, round(r.gpu_memory_utilization - 0.1, 2))}"],
                        gpus))
        if any(spec.name == "sync_verification" for spec in table):
            out.append((["rollout.verify_sync=false"], gpus))
        out.append(([f"parallel.tensor_model_parallel_size={2 * p.tensor_model_parallel_size}",
                     "parallel.sequence_parallel=true"], gpus))
        out.append(([f"parallel.pipeline_model_parallel_size={2 * p.pipeline_model_parallel_size}"], gpus))
        out.append(([], 2 * gpus))
    unique = []
    for change in out:
        if change not in unique:
            unique.append(change)
    return unique


def _try(cfg: Config, overrides: list[str], gpus: int, gpu_mem_gib: float, hf: dict,
         source: str, nproc_per_node: Optional[int] = None) -> Optional[MemoryPlan]:
    """The plan of ``cfg`` changed by ``overrides`` on ``gpus`` GPUs; None for a layout that cannot run."""
    try:
        changed = config_from_dict(apply_overrides(cfg.model_dump(mode="json"), overrides), gpu=True)
        return _plan(changed, gpus, gpu_mem_gib, hf, source, nproc_per_node)
    except ConfigError:
        return None


def _smallest_layout(cfg: Config, gpus: int, gpu_mem_gib: float, hf: dict, source: str,
                     nproc_per_node: Optional[int] = None) -> Optional[str]:
    """The fewest GPUs (doubling from ``gpus``) on which some TP x PP (and rollout TP) fits, with the
    least model parallelism there, as the arguments that select it."""
    p, rtp = cfg.parallel, cfg.rollout.tensor_parallel_size
    n = gpus
    while n <= max(MAX_SEARCH_GPUS, gpus):
        best = None
        for tp, pp, engine_tp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16), (rtp, 2 * rtp, 4 * rtp, 8 * rtp)):
            if engine_tp > 8:
                continue
            overrides = [f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
                         f"parallel.sequence_parallel={str(tp > 1).lower()}",
                         f"rollout.tensor_parallel_size={engine_tp}"]
            alt = _try(cfg, overrides, n, gpu_mem_gib, hf, source, nproc_per_node)
            if alt is not None and alt.fits:
                rank = (tp * pp, engine_tp, alt.peak)
                if best is None or rank < best[0]:
                    best = (rank, overrides)
        if best is not None:
            same = {f"parallel.tensor_model_parallel_size={p.tensor_model_parallel_size}",
                    f"parallel.pipeline_model_parallel_size={p.pipeline_model_parallel_size}",
                    f"parallel.sequence_parallel={str(p.sequence_parallel).lower()}",
                    f"rollout.tensor_parallel_size={rtp}"}
            return " ".join([f"--gpus {n}"] + [o for o in best[1] if o not in same])
        n *= 2
    return None


def _advice(cfg: Config, gpus: int, gpu_mem_gib: float, hf: dict, source: str, plan: MemoryPlan,
            nproc_per_node: Optional[int] = None) -> tuple[str, ...]:
    lines = []
    for overrides, n in _changes(cfg, gpus, plan):
        alt = _try(cfg, overrides, n, gpu_mem_gib, hf, source, nproc_per_node)
        if alt is not None and alt.fits:
            what = " ".join(overrides + ([f"--gpus {n}"] if n != gpus else []))
            lines.append(f"{what}  (fits: training {_gib(alt.phase('training').total)} GiB, "
                         f"rollout {_gib(alt.phase('rollout').total)} GiB)")
    if lines:
        return tuple(lines)
    found = _smallest_layout(cfg, gpus, gpu_mem_gib, hf, source, nproc_per_node)
    if found is None:
        return (f"no single change fits, and no layout of up to {MAX_SEARCH_GPUS} GPUs does (varying "
                "parallel.tensor_model_parallel_size, pipeline_model_parallel_size, rollout.tensor_parallel_size)",)
    return (f"no single change fits; the smallest layout that does: {found}",)


def memory_plan(cfg: Config, gpus: int, gpu_mem_gib: float, hf_config: Optional[dict] = None,
                nproc_per_node: Optional[int] = None) -> MemoryPlan:
    """The per-GPU memory of each phase of ``cfg`` on ``gpus`` GPUs of ``gpu_mem_gib`` GiB (with
    ``rollout.placement: separate``: ``gpus`` trainer GPUs, ``nproc_per_node`` per node, and the
    nodes' ``rollout.gpus``); a plan that does not fit carries advice: single config changes, each
    planned, that would help."""
    if gpus < 1 or gpu_mem_gib <= 0 or (nproc_per_node is not None and nproc_per_node < 1):
        raise ConfigError(f"--gpus and --nproc-per-node must be >= 1 and --gpu-mem > 0 (got {gpus}, "
                          f"{nproc_per_node}, {gpu_mem_gib})")
    try:
        hf, source = resolve_architecture(cfg, hf_config)
        plan = _plan(cfg, gpus, gpu_mem_gib, hf, source, nproc_per_node)
    except ConfigError:
        raise
    except ValueError as err:  # an unreadable config.json, or an architecture hf_to_megatron refuses
        raise ConfigError(f"model ({cfg.model.hf_path or cfg.model.tiny}): {err}") from None
    if plan.fits:
        return plan
    return dataclasses.replace(plan, advice=_advice(cfg, gpus, gpu_mem_gib, hf, source, plan, nproc_per_node))


def check_fits(cfg: Config, gpus: int, gpu_mem_gib: float, hf_config: Optional[dict] = None,
               nproc_per_node: Optional[int] = None) -> MemoryPlan:
    """The trainer's start-up check on GPUs: the plan, or a ConfigError naming the keys to change."""
    plan = memory_plan(cfg, gpus, gpu_mem_gib, hf_config, nproc_per_node)
    if not plan.fits:
        per_node = f" --nproc-per-node {nproc_per_node}" if nproc_per_node else ""
        raise ConfigError(plan.refusal() + f"\n(`megatron-alp plan CONFIG --gpus {gpus}{per_node} --gpu-mem "
                          f"{gpu_mem_gib:g}` prints the per-phase table; docs/memory_plan.md explains it)")
    return plan
