"""A Megatron model's LoRA adapters as a Hugging Face PEFT adapter (``adapter_model.safetensors`` +
``adapter_config.json``), loadable with ``peft.PeftModel.from_pretrained(base, dir)`` and sent as-is
to engines that apply adapters themselves (vLLM, ``lora.sync: adapter``).

The tensors are gathered over TP/PP/EP by the HF export's collective
(:func:`~megatron_alp.models.hf_weights.gather_full`) and renamed the way PEFT saves them
(``base_model.model.<HF module>.lora_A.weight`` / ``.lora_B.weight``). Megatron fuses layers that HF
keeps apart, and one adapter on a fused layer is exactly one adapter per HF layer: the input side A
is shared, B's rows are split as the layer's weight rows are (the weight mapping's own ``to_hf``):

- ``linear_qkv`` -> ``q_proj``, ``k_proj``, ``v_proj``: lora_A = A for each, lora_B = B's rows of that
  projection out of Megatron's per-query-group interleaving;
- ``linear_fc1`` -> ``gate_proj``, ``up_proj`` (B's halves); ``linear_proj`` -> ``o_proj``;
  ``linear_fc2`` -> ``down_proj``.

Routed experts: transformers 5 keeps a Qwen3-MoE layer's experts as two 3-D parameters
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]), not per-expert
linears, and PEFT adapts them with ``target_parameters`` (its ``ParamWrapper``): one rank-r adapter
per expert, stored stacked as lora_A [E*r, in] (expert e at rows e*r..) and lora_B [out, r*E] (expert
e at columns e, e+E, ..), read from ``peft/tuners/lora/layer.py`` (``ParamWrapper.get_delta_weight``).
Two wrapped parameters of one module nest: the first listed (``gate_up_proj``) is the inner one and
its tensors are named ``mlp.experts.base_layer.lora_*``, ``down_proj``'s ``mlp.experts.lora_*``, so
the config lists them in that order. PEFT refuses dropout on such adapters: with experts adapted the
config says ``lora_dropout: 0`` (dropout acts in training only; the adapter's function is the same).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_alp.config import LoRAConfig
from megatron_alp.models.hf_weights import (
    ExportPlan,
    LocalTensor,
    gather_full,
    global_name,
    make_tmp_dir,
    write_safetensors,
)
from megatron_alp.models.sharding import partition_dim_of
from megatron_alp.models.weight_mapping import Match, WeightMapping

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # order fixes PEFT's nesting
_EXPERT_MODULE = {"linear_fc1": "experts.base_layer", "linear_fc2": "experts"}
_ADAPTED = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
_FACTORS = ("A", "B")
_PEFT_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_[AB]\.weight$")


def _factor_names(weight: str) -> list[str]:
    """``...linear_qkv.weight`` -> its adapter's ``...linear_qkv_lora.A`` and ``.B``."""
    return [f"{weight.removesuffix('.weight')}_lora.{f}" for f in _FACTORS]


def _plan(model) -> tuple[ExportPlan, dict[str, Match], WeightMapping]:
    """The export plan of the adapters (cached on the model), their base weights' matches by adapter
    factor name, and the model's weight mapping."""
    from megatron_alp.models.lora import adapters_by_weight

    cached = getattr(model, "_peft_export_plan", None)
    if cached is not None:
        return cached
    mapping = WeightMapping.from_model(model)
    local = {}
    for weight, adapter in adapters_by_weight(model).items():
        canonical = mapping.match(global_name(weight, model)).name
        for name, param in zip(_factor_names(canonical), (adapter.A, adapter.B)):
            local[name] = LocalTensor(name, param, partition_dim_of(param), adapter.layout.expert)
    matches = {f: m for m in mapping.matches() if m.name.endswith(_ADAPTED) for f in _factor_names(m.name)}
    plan = ExportPlan(model, local, matches, required=False)
    if not plan.entries:
        raise ValueError("the model has no LoRA adapters: nothing to export as a PEFT adapter")
    model._peft_export_plan = cached = (plan, matches, mapping)
    return cached


def peft_adapter_tensors(model, bucket_bytes: int = 64 << 20, receivers: Optional[Iterable[int]] = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(PEFT name, full tensor)`` for every adapter of the model, in layer order, on every rank
    of ``receivers`` (global ranks, the same on every rank; None: every rank): exactly the tensors of
    the PEFT adapter file. Collective over all ranks of the job, like
    :func:`~megatron_alp.models.hf_weights.iter_hf_weights`; every rank must iterate it to the end.
    Tensors may share storage (lora_A of q/k/v is one tensor)."""
    from megatron.core.utils import unwrap_model

    model = unwrap_model(model)
    plan, matches, mapping = _plan(model)
    experts: dict[tuple, dict[int, torch.Tensor]] = {}
    for name, full in gather_full(model, plan, bucket_bytes, receivers):
        m, factor = matches[name], name[-1]
        if m.expert is None:
            yield from _dense(mapping, m, factor, full)
            continue
        key = (m.layer, m.name.split(".")[-2], factor)  # e.g. (0, "linear_fc1", "A")
        experts.setdefault(key, {})[m.expert] = full
        if len(experts[key]) == mapping.num_experts:
            yield _stacked(m, key[1], factor, experts.pop(key))


def _dense(mapping: WeightMapping, m: Match, factor: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The PEFT tensors of one fused-or-not layer's factor: A shared by its HF layers, B split like W."""
    if factor == "A":
        return [(_peft_name(hf, "A"), full) for hf in m.hf_names]
    return [(_peft_name(hf, "B"), t) for hf, t in mapping.to_hf(m, full)]


def _peft_name(hf_weight: str, factor: str) -> str:
    return f"{PREFIX}{hf_weight.removesuffix('.weight')}.lora_{factor}.weight"


def _stacked(m: Match, layer_name: str, factor: str, per_expert: dict[int, torch.Tensor]) -> tuple[str, torch.Tensor]:
    """One layer's expert factors in PEFT's stacked ``ParamWrapper`` layout (module docstring)."""
    ordered = [per_expert[e] for e in sorted(per_expert)]
    if factor == "A":  # [r, in] each -> [E*r, in], expert-major
        stacked = torch.cat(ordered, dim=0)
    else:  # [out, r] each -> [out, r*E], expert-minor
        stacked = torch.stack(ordered, dim=2).reshape(ordered[0].shape[0], -1)
    experts_module = m.hf_names[0].rsplit(".", 3)[0]  # model.layers.{L}.mlp.experts.{e}.gate_proj.weight
    module = experts_module.removesuffix("experts") + _EXPERT_MODULE[layer_name]
    return f"{PREFIX}{module}.lora_{factor}.weight", stacked


def peft_adapter_config(cfg: LoRAConfig, names: Iterable[str], base_model_name_or_path: Optional[str] = None
                        ) -> dict:
    """``adapter_config.json`` for the PEFT tensors ``names`` (as :func:`peft_adapter_tensors` yields
    them) of adapters made with ``cfg``: the HF modules they adapt, rank, alpha and dropout."""
    modules, expert_params = set(), False
    for name in names:
        m = _PEFT_NAME.match(name)
        if m is None:
            raise ValueError(f"{name}: not a PEFT LoRA tensor name (base_model.model.<module>.lora_A/B.weight)")
        leaf = m.group("module").rsplit(".", 1)[-1]
        if leaf in ("experts", "base_layer"):
            expert_params = True
        else:
            modules.add(leaf)
    if not modules and not expert_params:
        raise ValueError("no PEFT LoRA tensors: nothing to describe in an adapter config")
    alpha = cfg.scaling * cfg.rank
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank,
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "lora_dropout": 0.0 if expert_params else cfg.dropout,
        "target_modules": sorted(modules),
        "target_parameters": list(EXPERT_PARAMETERS) if expert_params else None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft_adapter(tensors: Iterable[tuple[str, torch.Tensor]], out_dir, cfg: LoRAConfig,
                       base_model_name_or_path: Optional[str] = None) -> Path:
    """Write ``(PEFT name, tensor)`` pairs and their config as the PEFT adapter folder ``out_dir``;
    returns it. Atomic: built in ``<out>.tmp-XXXX`` and renamed, so the folder appears complete or not
    at all. An existing ``out_dir`` is refused."""
    out = Path(out_dir).absolute()
    if out.exists():
        raise FileExistsError(f"{out}: refusing to overwrite an existing folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(make_tmp_dir(out))
    try:
        state: dict[str, torch.Tensor] = {}
        for name, tensor in tensors:
            if name in state:
                raise ValueError(f"adapter tensor {name} appears twice in the stream")
            state[name] = tensor.detach().cpu()
        config = peft_adapter_config(cfg, state, base_model_name_or_path)
        write_safetensors(tmp / ADAPTER_FILE, state)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_peft_adapter(model, out_dir, cfg: LoRAConfig, *, base_model_name_or_path: Optional[str] = None,
                        bucket_bytes: int = 64 << 20) -> None:
    """Write the model's adapters as the PEFT folder ``out_dir`` (every rank calls it; rank 0 writes)."""
    tensors = peft_adapter_tensors(model, bucket_bytes, receivers=[0])
    if dist.get_rank() == 0:
        write_peft_adapter(tensors, out_dir, cfg, base_model_name_or_path)
    else:
        for _ in tensors:  # a collective: every rank takes part in every bucket
            pass
    dist.barrier()
