"""LoRA: low-rank adapters on the linear layers of a Megatron-Core GPTModel (issue 27, model side).

An adapted layer computes ``W x + s * B A dropout(x)`` with ``s = alpha / rank``, A (r x in) drawn at
random and B (out x r) zero, so the adapted model starts equal to the base model bit for bit (the
branch adds exact zeros). The adapter is a sibling module of its layer (``linear_qkv`` ->
``linear_qkv_lora``, parameters ``A`` and ``B``): the base parameters keep their names, so checkpoints,
converters and weight maps still find them. A forward hook on the layer adds the branch and keeps
Megatron's ``(output, bias)`` contract. :func:`adapters_disabled` turns every branch off, which is the
reference policy: the base model, with no second copy of its weights.

Tensor parallelism. The branch mirrors its layer's sharding, and talks over the r-dimensional
activation ``u = A x`` rather than the hidden one:

- Column-parallel (``linear_qkv``, ``linear_fc1``): A replicated, B sharded on its output rows like W.
  Without sequence parallelism x is replicated; ``u`` enters the layer's TP region (identity forward,
  all-reduce of du backward, as Megatron's ``copy_to_tensor_model_parallel_region``) so A's gradient
  and x's are whole and equal on every rank. Under sequence parallelism x is this rank's sequence
  shard: A acts on the shard and ``u`` is all-gathered along the sequence (reduce-scatter backward),
  where the layer gathers x itself. A's gradient is then a partial sum over the shards: A is marked
  ``sequence_parallel``, and Megatron's ``finalize_model_grads`` sums it over the TP group like the
  norm weights (``distributed/finalize_model_grads.py:354-366``).
- Row-parallel (``linear_proj``, ``linear_fc2``): A sharded on its input columns like W, B replicated.
  ``u`` is all-reduced over TP (reduce-scattered along the sequence under sequence parallelism, to the
  layer output's shape); under sequence parallelism B's gradient is a partial sum over sequence
  shards and B is marked ``sequence_parallel`` too (Megatron does the same for the row layer's bias,
  ``tensor_parallel/layers.py:1228``).
- Routed experts (``SequentialMLP``): the expert layers do no tensor-parallel communication; the token
  dispatcher gathers tokens over the expert-TP group and sums the partial outputs and input gradients
  over it. The branch does the same (no collective on u); the replicated factor (A of fc1, B of fc2)
  then sees only its rank's part of the gradient, which is all-reduced over the expert-TP group in the
  backward. Expert adapters carry the layer's ``allreduce`` flag, so DDP reduces them over the
  expert-data-parallel group. Grouped-GEMM experts are refused.
- Pipeline stages adapt the layers they own; replicated factors carry ``tensor_model_parallel=False``
  so the gradient norm counts them once.

A is drawn from a private generator seeded by (``lora.seed``, global layer, module, global expert) on
the full shape and then sharded, so every parallel layout starts from the same adapters.

Checkpoints. :meth:`LoRAAdapter.sharded_state_dict` gives Megatron's distributed checkpoint A and B as
ShardedTensors cut like the layer's weight (``make_sharded_tensors_for_checkpoint``, over the layer's
TP group: B on dim 0 for a column-parallel layer, A on dim 1 for a row-parallel one, the other factor
replicated with Megatron's replica ids), and ``linear_fc1_lora.B`` of a gated MLP goes through
``apply_swiglu_sharded_factory`` like ``linear_fc1.weight``, so its [gate; up] rows reshard over TP.
The parents pass the rest, read from Megatron-Core 0.16: ``MLP.sharded_state_dict`` calls every child's
``sharded_state_dict`` (the swiglu factory only for ``linear_fc1`` itself), ``SelfAttention`` and
``TransformerLayer`` recurse through ``sharded_state_dict_default``, ``TransformerBlock`` adds the
layer offset (pipeline stages), and ``SequentialMLP`` the global expert offset and the
expert-data-parallel replica id. So adapters save and load at any TP/SP/PP/EP layout, like the base
weights (``training/dist_checkpoint.py``; ``load_checkpoint(..., base_only=True)`` starts adapters from
their initial values on a checkpoint without them).

Transformer Engine: ``TELayerNormColumnParallelLinear`` fuses the input norm into ``linear_qkv`` and
``linear_fc1``, and the branch must see the normalised input. The layer is set to return its norm
output (``return_layernorm_output``; the local shard under sequence parallelism, as here), which the
hook takes off the result. TE linears shard and communicate like Megatron's, so the rest is the same.
Transformer Engine is not installed on the CPU machines this was written on: that path is unrun.

What freezing the base buys, read from Megatron-Core 0.16 (``megatron/core``):

- ``distributed/distributed_data_parallel.py:111-113``: DDP skips parameters with
  ``requires_grad=False`` when it lays out its gradient buffers, and ``:321-322`` registers its
  gradient hooks only on trainable ones: a frozen weight has no ``main_grad`` and no buffer space.
- ``optimizer/__init__.py:146-148`` (``_get_param_groups``): frozen parameters join no parameter
  group, so they get no fp32 main copy and no Adam state (``optimizer/optimizer.py:668`` and
  ``optimizer/distrib_optimizer.py:580`` skip them too).
- ``tensor_parallel/layers.py:948-952`` (and ``:1239-1243``): a layer whose weight is frozen runs
  ``linear_with_frozen_weight``, which computes no weight gradient and keeps only the weight, not the
  input activation, for its backward (sequence-parallel gather included, ``:431-436``).
- ``distributed/finalize_model_grads.py:34-37, 250-252``: a frozen (tied) embedding has no gradient
  and the pipeline's embedding all-reduce skips it.

Memory: each adapted layer keeps its input (this rank's shard: the sequence shard under sequence
parallelism) for A's gradient, and ``u``; the frozen linear itself keeps no input activation.

The embedding output is made to require a gradient: with the embedding frozen, nothing before the
first adapter would, and Megatron's full activation recomputation (a reentrant
``torch.autograd.Function``) returns outputs that need no gradient when none of its inputs do, which
would leave the adapters of the first recomputed chunk without gradients.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from megatron.core.utils import unwrap_model

from megatron_alp.config import ConfigError, LoRAConfig
from megatron_alp.runtime.seeding import derive_seed

#: Megatron layer name -> (column-parallel?, key of the adapter's seed)
_LAYERS = {"linear_qkv": (True, 0), "linear_proj": (False, 1), "linear_fc1": (True, 2), "linear_fc2": (False, 3)}
SUFFIX = "_lora"  # linear_qkv -> linear_qkv_lora


@dataclass(frozen=True)
class _Layout:
    """How the adapted layer is sharded, and so what the branch communicates."""

    column: bool  # output sharded (column-parallel) or input sharded (row-parallel)
    expert: bool  # a routed expert: the token dispatcher does the layer's communication
    group: object  # the layer's tensor-parallel group (expert-TP for experts)
    size: int
    rank: int
    sequence_parallel: bool
    gated: bool  # fc1 of a gated MLP: this rank's rows are [gate shard; up shard], as the layer's weight


def _layout(config, column: bool, expert: bool, gated: bool) -> _Layout:
    if expert:
        return _Layout(column, True, ps.get_expert_tensor_parallel_group(),
                       ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(), False, gated)
    size = ps.get_tensor_model_parallel_world_size()
    return _Layout(column, False, ps.get_tensor_model_parallel_group(), size,
                   ps.get_tensor_model_parallel_rank(), bool(config.sequence_parallel) and size > 1, gated)


def _draw_a(cfg: LoRAConfig, in_features: int, seed: int) -> torch.Tensor:
    """A on its full (unsharded) shape [rank, in_features], float32, from a private generator."""
    gen = torch.Generator().manual_seed(seed)
    if cfg.init == "gaussian":
        return torch.randn(cfg.rank, in_features, generator=gen) / cfg.rank
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)), torch's Linear default
    return torch.empty(cfg.rank, in_features).uniform_(-bound, bound, generator=gen)


class LoRAAdapter(torch.nn.Module):
    """The low-rank branch ``s * B A dropout(x)`` of one linear layer, sharded like it (see the module
    docstring for the communication)."""

    def __init__(self, base: torch.nn.Module, layout: _Layout, cfg: LoRAConfig, seed: int, dtype: torch.dtype):
        super().__init__()
        out_local, in_local = base.weight.shape
        a_full = _draw_a(cfg, in_local if layout.column else in_local * layout.size, seed)
        a = a_full if layout.column else a_full.chunk(layout.size, dim=1)[layout.rank]
        device = base.weight.device
        self.A = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.B = torch.nn.Parameter(torch.zeros(out_local, cfg.rank, device=device, dtype=dtype))
        sharded, replicated = (self.B, self.A) if layout.column else (self.A, self.B)
        tensor_parallel.set_tensor_model_parallel_attributes(sharded, True, 0 if layout.column else 1, 1)
        tensor_parallel.set_tensor_model_parallel_attributes(replicated, False, -1, 1)
        replicated.sequence_parallel = layout.sequence_parallel  # summed over TP by finalize_model_grads
        for p in (self.A, self.B):
            p.is_lora = True
            p.allreduce = getattr(base.weight, "allreduce", True)  # False: expert-data-parallel reduction
        self.layout = layout
        self.scaling = cfg.scaling
        self.dropout = cfg.dropout
        self.enabled = True
        # the input is a shard (distinct per rank): dropout draws from a per-rank stream of Megatron's
        # tracker; a replicated input draws from the default generator, in step on all ranks
        sharded_input = not layout.column or layout.sequence_parallel
        self._dropout_stream = None if not sharded_input else (
            tensor_parallel.get_expert_parallel_rng_tracker_name() if layout.expert else "model-parallel-rng")
        self._base = [base]  # a list: not registered as a child (its parameters stay where they are)

    @property
    def base(self) -> torch.nn.Module:
        return self._base[0]

    def delta_weight(self) -> torch.Tensor:
        """``s * B A`` in the base weight's local layout (this rank's shard): ``W + delta`` is the
        merged layer."""
        return (self.B.float() @ self.A.float()) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        if self.dropout and self.training:
            if self._dropout_stream is None:
                x = F.dropout(x, self.dropout, True)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork(self._dropout_stream):
                    x = F.dropout(x, self.dropout, True)
        a, b = self.A, self.B
        if lay.expert and lay.size > 1:  # the replicated factor's gradient is partial per expert-TP rank
            if lay.column:
                a = tensor_parallel.copy_to_tensor_model_parallel_region(a, group=lay.group)
            else:
                b = tensor_parallel.copy_to_tensor_model_parallel_region(b, group=lay.group)
        u = F.linear(x, a)
        if not lay.expert and lay.size > 1:
            if lay.column and lay.sequence_parallel:
                u = tensor_parallel.gather_from_sequence_parallel_region(u, True, group=lay.group)
            elif lay.column:
                u = tensor_parallel.copy_to_tensor_model_parallel_region(u, group=lay.group)
            elif lay.sequence_parallel:
                u = tensor_parallel.reduce_scatter_to_sequence_parallel_region(u, group=lay.group)
            else:
                u = tensor_parallel.reduce_from_tensor_model_parallel_region(u, group=lay.group)
        return F.linear(u * self.scaling, b)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """A and B as Megatron ShardedTensors cut like the layer's weight (see the module docstring,
        Checkpoints), so they load under any TP/PP/EP layout."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        lay = self.layout
        sd = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"B": 0} if lay.column else {"A": 1},
            sharded_offsets, tp_group=lay.group, dp_cp_group=metadata["dp_cp_group"])
        if lay.gated:  # as MLP.sharded_state_dict does for linear_fc1.weight
            key = f"{prefix}B"
            sd[key] = apply_swiglu_sharded_factory(sd[key], sharded_offsets,
                                                   metadata.get("singleton_local_shards", False))
        return sd

    def extra_repr(self) -> str:
        kind = ("column" if self.layout.column else "row") + (", expert" if self.layout.expert else "")
        return f"rank={self.A.shape[0]}, scaling={self.scaling}, {kind}"


def _hook(adapter: LoRAAdapter, fused_norm: bool, module, args, kwargs, output):
    """``(out + branch(x), bias)``, Megatron's contract. A TE layer with a fused norm also returns the
    norm's output (``(out, bias, ln)`` with a returned bias, else ``((out, ln), None)`` from Megatron's
    wrapper), which is the branch's input and is taken off the result."""
    if fused_norm:
        if len(output) == 3:
            out, bias, x = output
        else:
            (out, x), bias = output
    else:
        out, bias = output
        x = args[0] if args else kwargs["input_" if "input_" in kwargs else "x"]  # Megatron's, TE's name
    if not adapter.enabled:
        return (out, bias) if fused_norm else None
    return out + adapter(x), bias


def _input_requires_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.requires_grad_()  # a leaf: nothing before it needs a gradient
    return None


def _kind(name: str) -> Optional[str]:
    """The target a decoder layer's submodule ``name`` answers to, or None."""
    parts = name.split(".")
    if parts[-1] not in _LAYERS:
        return None
    return "experts" if "experts" in parts else parts[-1]  # shared_experts.* are dense MLPs


def _model_targets(config) -> set[str]:
    """The targets the whole model has (every pipeline stage, from its config)."""
    have = {"linear_qkv", "linear_proj"}
    if config.num_moe_experts:
        have.add("experts")
        freq = config.moe_layer_freq
        dense = (0 in freq) if isinstance(freq, list) else freq > 1
        if dense or config.moe_shared_expert_intermediate_size:
            have |= {"linear_fc1", "linear_fc2"}
    else:
        have |= {"linear_fc1", "linear_fc2"}
    return have


def _check_targets(config, cfg: LoRAConfig) -> set[str]:
    """The targets to adapt; one line naming ``lora.target_modules`` for a name the model lacks when the
    list was set (the default list skips them) or when nothing is left."""
    targets, have = set(cfg.target_modules), _model_targets(config)
    if "target_modules" in cfg.model_fields_set and targets - have:
        missing = sorted(targets - have)
        kind = "mixture-of-experts" if config.num_moe_experts else "dense"
        raise ConfigError(f"lora.target_modules: {', '.join(missing)} not in this {kind} model (it has "
                          f"{', '.join(sorted(have))})")
    targets &= have
    if not targets:
        raise ConfigError(f"lora.target_modules: nothing to adapt in this model (it has {', '.join(sorted(have))})")
    return targets


def _targets_of(layer, targets: set[str]) -> list[tuple[str, torch.nn.Module, torch.nn.Module, int]]:
    """``(name, parent, linear, global expert index or -1)`` of every target linear in ``layer``,
    collected before any adapter is added."""
    found = []
    for name, module in layer.named_modules():
        kind = _kind(name)
        if kind not in targets:
            continue
        parts, expert = name.split("."), -1
        if kind == "experts":
            if "local_experts" not in parts:  # GroupedMLP / TEGroupedMLP: all experts in one weight
                raise ConfigError("lora.target_modules: experts with moe.grouped_gemm: true is not supported "
                                  "(adapters need one linear layer per expert); set moe.grouped_gemm: false")
            at = parts.index("local_experts")
            local_experts = layer.get_submodule(".".join(parts[: at + 1]))
            expert = ps.get_expert_model_parallel_rank() * len(local_experts) + int(parts[at + 1])
        found.append((name, layer.get_submodule(".".join(parts[:-1])), module, expert))
    return found


def attach_lora(model: torch.nn.Module, cfg: LoRAConfig) -> list[LoRAAdapter]:
    """Freeze every parameter of this stage's GPTModel except ALP's sigmas and add an adapter next to
    every target linear layer of its decoder layers; returns the adapters. Call on the bare model
    (before Float16Module/DDP) and before :func:`~megatron_alp.runtime.platform.place_on_device`."""
    if adapters(model):
        raise RuntimeError("LoRA adapters are already attached to this model")
    config = model.config
    targets = _check_targets(config, cfg)
    # what checkpoints record (lora_metadata): the targets this model has, so a rebuild adapts the same
    model.lora_config = cfg.model_copy(update={"target_modules": [t for t in cfg.target_modules if t in targets]})
    found = [(layer.layer_number - 1, *t) for layer in model.decoder.layers for t in _targets_of(layer, targets)]
    for p in model.parameters():
        if not getattr(p, "is_alp_sigma", False):
            p.requires_grad_(False)
    attached = []
    for index, name, parent, linear, expert in found:
        leaf = name.rsplit(".", 1)[-1]
        column, key = _LAYERS[leaf]
        if getattr(linear, "gather_output", False):
            raise RuntimeError(f"LoRA: {name} gathers its output, which no decoder layer does")
        fused_norm = hasattr(linear, "layer_norm_weight")  # TE's LayerNormLinear
        if fused_norm:
            linear.return_layernorm_output = True
            linear.return_layernorm_output_gathered = False
        gated = leaf == "linear_fc1" and bool(config.gated_linear_unit)
        adapter = LoRAAdapter(linear, _layout(config, column, expert >= 0, gated), cfg,
                              derive_seed(cfg.seed, index, key, expert), config.params_dtype)
        parent.add_module(leaf + SUFFIX, adapter)
        linear.register_forward_hook(functools.partial(_hook, adapter, fused_norm), with_kwargs=True)
        attached.append(adapter)
    if getattr(model, "pre_process", False):
        model.embedding.register_forward_hook(_input_requires_grad)
    return attached


def _as_list(models) -> list:
    return list(models) if isinstance(models, (list, tuple)) else [models]


def adapters(models) -> list[LoRAAdapter]:
    """The adapters of ``models`` (this rank's chunks, wrapped or not), in module order."""
    return [m for model in _as_list(models) for m in unwrap_model(model).modules() if isinstance(m, LoRAAdapter)]


@contextlib.contextmanager
def adapters_disabled(models) -> Iterator[None]:
    """Every adapter of ``models`` adds nothing inside this block: the forward is the base model's,
    bit for bit (the reference policy). Models without adapters are left alone."""
    found = adapters(models)
    before = [a.enabled for a in found]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a, state in zip(found, before):
            a.enabled = state


def is_lora_parameter(param: torch.Tensor) -> bool:
    return bool(getattr(param, "is_lora", False))


def lora_state(model) -> dict[str, torch.nn.Parameter]:
    """The adapter parameters of one model chunk by name (``...linear_qkv_lora.A``; names as in the
    bare model, whatever wraps it): what the weight sync, checkpoints and PEFT export carry."""
    return {n: p for n, p in unwrap_model(model).named_parameters() if is_lora_parameter(p)}


def merged_weights(model) -> dict[str, torch.Tensor]:
    """``{name of an adapted base weight: W + s B A}`` for one model chunk, each in this rank's shard
    layout and the weight's dtype (the merged model, e.g. for an engine that takes no adapters)."""
    return {name: merged_weight(adapter) for name, adapter in adapters_by_weight(model).items()}


def adapters_by_weight(model) -> dict[str, LoRAAdapter]:
    """``{name of an adapted base weight (``...linear_qkv.weight``): its adapter}`` for one model chunk."""
    return {name.removesuffix(SUFFIX) + ".weight": module for name, module in unwrap_model(model).named_modules()
            if isinstance(module, LoRAAdapter)}


def merged_weight(adapter: LoRAAdapter) -> torch.Tensor:
    """``W + s B A`` of one adapter's layer in this rank's shard layout and the weight's dtype (summed in
    float32)."""
    w = adapter.base.weight.detach()
    return (w.float() + adapter.delta_weight().detach()).to(w.dtype)


def lora_metadata(model) -> Optional[dict]:
    """The LoRA config a model's adapters were made with (targets: those the model has), as checkpoint
    metadata records it so exports rebuild the same adapters; None without adapters."""
    cfg = getattr(unwrap_model(model), "lora_config", None)
    return None if cfg is None else cfg.model_dump()
