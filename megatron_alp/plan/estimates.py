"""What each component of a phase takes on one GPU, estimated from the architecture and the layout.

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

They are estimates from the architecture, not measurements: the GPU self-test of issue 11
measures the real peaks, and the allowances above are to be corrected from it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from megatron_alp.config import Config
from megatron_alp.plan.architecture import Architecture
from megatron_alp.plan.layout import Layout
from megatron_alp.plan.shape import RunShape
from megatron_alp.training.dist_checkpoint import SaveTransient, save_transient
from megatron_alp.training.logprobs import CHUNK_ELEMENTS

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RUNTIME_BYTES = 3 * GiB  # per trainer process: CUDA context, NCCL communicators, cuBLAS/TE workspaces
ENGINE_WORKSPACE_BYTES = 3 * GiB  # vLLM's profiled activation peak, sampler logits, CUDA graphs, non-torch memory
# a sleeping engine: its CUDA context and the NCCL buffers vLLM keeps through sleep (its CUDA-graph pool
# goes to host memory: sleep_mode_offload_cudagraph); not measured yet: the GPU self-test's phase ledger does
ENGINE_ASLEEP_BYTES = 2 * GiB
PROBE_TOKENS = 4 * 2 * (8 + 16)  # rollout.verify_sync's probe: 4 prompts x 2 samples x (8 + 16) tokens
FUSED_STATS_PER_TOKEN = 8  # fp32 values per token of the fused logprob path: max, sum-exp, target logit, ...


@dataclasses.dataclass(frozen=True)
class Item:
    key: str  # stable name: weights, reference, grads, optimizer, activations, logits or hidden, ...
    label: str
    nbytes: int
    basis: str  # how it was counted (or why it is 0)


RUNTIME = Item("runtime", "CUDA context, NCCL, workspaces", RUNTIME_BYTES, "fixed allowance")


def fmt_gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def fmt_count(n: float) -> str:
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


def stage_params(arch: Architecture, lay: Layout) -> list[tuple[int, int]]:
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


def megatron_state(cfg: Config, arch: Architecture, lay: Layout, dense: int, expert: int) -> list[Item]:
    """Weights (policy and reference), gradient buffer and optimizer state of one rank. With LoRA the
    base is frozen (no gradient, no optimizer state) and the reference is the same weights with the
    adapters off; gradients and optimizer state are the adapters' only."""
    b = DTYPE_BYTES[cfg.model.dtype]
    params = dense + expert
    per_param = 12 if b == 2 else 8  # fp32 master copy + Adam m, v; a float32 model is its own master
    dp, edp = (lay.dp, lay.expert_dp) if lay.distributed_optimizer else (1, 1)
    split = f" ({fmt_count(dense)} dense + {fmt_count(expert)} expert)" if expert else ""
    items = [Item("weights", f"policy weights ({cfg.model.dtype})", params * b,
                  f"{fmt_count(params)} params{split} x {b} B")]
    shard = params  # the weights a full-weight sync exports from this rank (a LoRA layer's merged)
    if cfg.lora.enabled:
        dense, expert = _trained_params(cfg, arch, lay, dense, expert)
        params = dense + expert
        items = [Item("weights", f"policy weights ({cfg.model.dtype}): frozen base + LoRA",
                      items[0].nbytes + params * b,
                      f"{items[0].basis} + {fmt_count(params)} adapter params (rank {cfg.lora.rank}) x {b} B")]
    elif RunShape.of(cfg).reference == "model":
        items.append(Item("reference", f"reference weights ({cfg.model.dtype})", params * b,
                          "same, no gradients (loss.kl_coef > 0)"))
    items += sync_snapshot(cfg, arch, shard)
    what = "adapter " if cfg.lora.enabled else ""
    return items + [
        Item("grads", "gradient buffer (fp32)", params * 4, f"{fmt_count(params)} {what}x 4 B, not sharded"),
        Item("optimizer", "optimizer state", per_param * (math.ceil(dense / dp) + math.ceil(expert / edp)),
             f"{per_param} B x ({fmt_count(dense)} {what}/ DP{dp}"
             + (f" + {fmt_count(expert)} / expert-DP{edp})" if expert else ")")),
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


def logprob_budget(cfg: Config) -> Optional[int]:
    """The token budget of the old/reference logprob passes' micro-batches: their own, else the update's."""
    t = cfg.trainer
    return t.logprob_max_tokens_per_micro_batch or t.max_tokens_per_micro_batch


def _probs(cfg: Config, arch: Architecture, lay: Layout, shape: MicroBatchShape) -> float:
    """Attention probabilities of one layer: unfused attention (``layer_spec: local``) only."""
    if cfg.model.layer_spec != "local":
        return 0.0  # flash attention (TE): padded rows, or packed rows in THD layout
    return DTYPE_BYTES[cfg.model.dtype] * arch.heads / lay.tp * shape.square


def activations(cfg: Config, arch: Architecture, lay: Layout, shape: MicroBatchShape, in_flight: int) -> Item:
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


def forward_activations(cfg: Config, arch: Architecture, lay: Layout, shape: MicroBatchShape) -> Item:
    """A forward-only pass keeps nothing for a backward: one layer's activations at a time."""
    per_token = _activations_per_token_layer(arch, lay, DTYPE_BYTES[cfg.model.dtype])
    probs = _probs(cfg, arch, lay, shape)
    return Item("activations", "activations (forward only, one layer)", int(shape.tokens * per_token + probs),
                f"1 layer x {shape.tokens} tok x {per_token / 1024:.1f} KiB" + (" + attention probs" if probs else ""))


def output(cfg: Config, arch: Architecture, lay: Layout, tokens: int, backward: bool) -> list[Item]:
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


def checkpoint_save(cfg: Config, arch: Architecture, lay: Layout, dense: int, expert: int) -> SaveTransient:
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


def engine_bytes(cfg: Config, arch: Architecture) -> int:
    """Bytes per element of the engine's weights and KV cache before quantization (`auto`: the
    checkpoint's)."""
    dtype = arch.torch_dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype
    return DTYPE_BYTES.get(dtype, 2)


def sync_snapshot(cfg: Config, arch: Architecture, params: int) -> list[Item]:
    """``rollout.sync_delta``: this rank's shard of every weight as last synced, on its device, in the
    dtype compared (the engine's where the engine only casts, else the model's). Full-weight syncs
    only: adapter syncs send the adapters."""
    r = cfg.rollout
    if not r.sync_delta or (cfg.lora.enabled and cfg.lora.sync == "adapter"):
        return []
    b = engine_bytes(cfg, arch) if r.dtype != "auto" and r.quantization == "none" else DTYPE_BYTES[cfg.model.dtype]
    return [Item("sync_snapshot", "delta-sync snapshot of this rank's shard", params * b,
                 f"{fmt_count(params)} params x {b} B (rollout.sync_delta)")]


def sync_bucket(cfg: Config, arch: Architecture, leader: bool) -> Item:
    """The gathered weight-sync bucket: ``rollout.sync_bucket_mb``, or one whole layer where a layer
    is bigger (buckets never split a layer); a colocated leader holds its IPC copy as well."""
    r = cfg.rollout
    dense, expert = arch.layer_params()
    layer = (dense + expert) * engine_bytes(cfg, arch)
    bucket = max(r.sync_bucket_mb << 20, layer)
    copies = 2 if leader else 1
    return Item("sync_bucket", "weight-sync bucket" + (" and its copy for the engine" if leader else ""),
                copies * bucket, f"{copies} x max(rollout.sync_bucket_mb, one layer {fmt_gib(layer)} GiB)")


@dataclasses.dataclass(frozen=True)
class EngineMemory:
    """One engine's memory on each of its GPUs: the budget it claims (``rollout.gpu_memory_utilization``
    x the GPU), its weights, and the KV cache the rest of the budget holds."""

    budget: int
    weights: int
    kv_cache: int  # below 0 where weights and workspace exceed the budget
    kv_per_token: int
    seq: int  # the engine context: one full-length sequence
    weights_basis: str
    kv_basis: str

    @classmethod
    def of(cls, cfg: Config, arch: Architecture, lay: Layout, gpu_mem_gib: float, seq: int) -> "EngineMemory":
        r = cfg.rollout
        budget = int(r.gpu_memory_utilization * int(gpu_mem_gib * GiB))
        element = engine_bytes(cfg, arch)
        weight_bytes = 1 if r.quantization != "none" else element  # embeddings stay unquantized
        embeddings = arch.embedding_params
        weights = ((arch.total_params - embeddings) * weight_bytes + embeddings * element) // lay.rollout_tp
        kv_per_token = (2 * arch.layers * max(1, arch.kv_heads // lay.rollout_tp) * arch.head_dim
                        * (1 if r.kv_cache_dtype == "fp8" else element))
        return cls(budget, weights, budget - weights - ENGINE_WORKSPACE_BYTES, kv_per_token, seq,
                   f"{fmt_count(arch.total_params)} x {weight_bytes} B / engine TP{lay.rollout_tp}",
                   f"rest of rollout.gpu_memory_utilization {r.gpu_memory_utilization} x {gpu_mem_gib:g} GiB")

    @property
    def one_sequence(self) -> int:
        """KV cache of one full-length sequence: vLLM refuses to start without room for it."""
        return self.kv_per_token * self.seq

    def weights_item(self) -> Item:
        return Item("engine_weights", "engine weights", self.weights, self.weights_basis)

    def awake(self) -> list[Item]:
        """The engine awake: its weights, its workspace and the KV cache its budget leaves."""
        return [self.weights_item(),
                Item("engine_workspace", "engine activations, CUDA graphs", ENGINE_WORKSPACE_BYTES, "fixed allowance"),
                Item("kv_cache", "KV cache", max(self.kv_cache, 0), self.kv_basis)]

    def in_state(self, cfg: Config, state: str) -> list[Item]:
        """The engine's memory on a GPU that holds one, in ``state`` (asleep, weights or awake); an
        engine that never sleeps (``rollout.free_memory_during_training: false``) is always awake."""
        if not cfg.rollout.free_memory_during_training:
            state = "awake"
        asleep = Item("engine", "rollout engine asleep", ENGINE_ASLEEP_BYTES,
                      "fixed allowance: CUDA context, graph pool, NCCL buffers")
        if state == "asleep":
            return [asleep]
        if state == "weights":
            return [self.weights_item(), asleep]
        return self.awake()
