"""Hugging Face <-> Megatron-Core parameter names and layouts of one model, by its family's rule
table (:mod:`~megatron_alp.models.weight_rules`).

Every consumer of weights -- loading an HF checkpoint into a Megatron model, the offline
converters, and the online weight export to the rollout engine -- goes through this mapping, so a
weight is placed by exactly one rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megatron_alp.models.families import MegatronModelArgs, hf_to_megatron
from megatron_alp.models.weight_rules import DENSE, LORA_PARAM, MOE, SIGMA_MARKER, Rule, RuleTable

# HF tensors some checkpoints carry that hold no weights (recomputed buffers).
IGNORED_HF = (re.compile(r".*\.rotary_emb\.inv_freq$"),)


@dataclass(frozen=True)
class Match:
    """A rule applied to one parameter: its global layer/expert and resolved names."""

    rule: Rule
    layer: Optional[int]
    expert: Optional[int]

    def _fmt(self, pattern: str) -> str:
        return pattern.format(layer=self.layer, expert=self.expert)

    @property
    def name(self) -> str:
        """Canonical (local-spec, global-index) Megatron name."""
        return self._fmt(self.rule.mcore)

    @property
    def hf_names(self) -> list[str]:
        return [self._fmt(p) for p in self.rule.hf]


def _pattern_regex(pattern: str) -> re.Pattern:
    out = re.escape(pattern).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    return re.compile(out + "$")


class WeightMapping:
    """The mapping of one model: its family's rule table filtered by the model's flags."""

    def __init__(self, table: RuleTable, *, num_layers: int, num_experts: int, heads: int, groups: int,
                 head_dim: int, tied: bool, qkv_bias: bool, linear_bias: bool, qk_norm: bool,
                 family: str = "model"):
        self.family = family
        self.num_layers, self.num_experts = int(num_layers), int(num_experts or 0)
        self.heads, self.groups, self.head_dim = int(heads), int(groups), int(head_dim)
        self.flags = {"untied": not tied, "qkv_bias": bool(qkv_bias), "linear_bias": bool(linear_bias),
                      "qk_norm": bool(qk_norm)}
        self.head_rules, self.layer_rules, self.tail_rules = (
            tuple(r for r in rules if r.when is None or self.flags[r.when]) for rules in table
        )
        self._regexes = [
            (rule, _pattern_regex(p))
            for rule in self.head_rules + self.layer_rules + self.tail_rules
            for p in (rule.mcore, rule.te)
            if p is not None
        ]

    @classmethod
    def from_args(cls, args: MegatronModelArgs) -> "WeightMapping":
        """The mapping of a model described by an HF config (see :func:`families.hf_to_megatron`)."""
        t = args.transformer
        return cls(
            args.family.rules, num_layers=t["num_layers"], num_experts=t.get("num_moe_experts") or 0,
            heads=t["num_attention_heads"], groups=t["num_query_groups"], head_dim=t["kv_channels"],
            tied=args.tie_word_embeddings, qkv_bias=t["add_qkv_bias"], linear_bias=t["add_bias_linear"],
            qk_norm=t["qk_layernorm"], family=args.family.name,
        )

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> "WeightMapping":
        return cls.from_args(hf_to_megatron(hf_config))

    @classmethod
    def from_model(cls, model) -> "WeightMapping":
        """The mapping of a built GPTModel, from its config alone (the supported dense families
        share one table, so the MoE-ness of the config picks it)."""
        c = model.config
        moe = bool(c.num_moe_experts)
        return cls(
            MOE if moe else DENSE, num_layers=c.num_layers, num_experts=c.num_moe_experts or 0,
            heads=c.num_attention_heads, groups=c.num_query_groups or c.num_attention_heads,
            head_dim=c.kv_channels, tied=model.share_embeddings_and_output_weights, qkv_bias=c.add_qkv_bias,
            linear_bias=c.add_bias_linear, qk_norm=c.qk_layernorm, family="moe" if moe else "dense",
        )

    # ------------------------------------------------------------------------------ names

    def match(self, mcore_name: str) -> Match:
        """The rule of a Megatron parameter given by its *global* name (local or TE spec)."""
        for rule, rx in self._regexes:
            m = rx.match(mcore_name)
            if m:
                gd = m.groupdict()
                layer = int(gd["layer"]) if "layer" in gd else None
                expert = int(gd["expert"]) if "expert" in gd else None
                if layer is not None and layer >= self.num_layers:
                    raise ValueError(f"{mcore_name}: layer {layer} >= num_hidden_layers={self.num_layers}")
                if expert is not None and expert >= self.num_experts:
                    raise ValueError(f"{mcore_name}: expert {expert} >= num_experts={self.num_experts}")
                return Match(rule, layer, expert)
        raise KeyError(f"{mcore_name}: no {self.family} weight-mapping rule for this Megatron parameter")

    def matches(self) -> Iterator[Match]:
        """Every parameter of the full model, in the canonical (HF file) order."""
        for rule in self.head_rules:
            yield Match(rule, None, None)
        for layer in range(self.num_layers):
            for rule in self.layer_rules:
                if "{expert}" in rule.mcore:
                    for e in range(self.num_experts):
                        yield Match(rule, layer, e)
                else:
                    yield Match(rule, layer, None)
        for rule in self.tail_rules:
            yield Match(rule, None, None)

    def hf_names(self) -> list[str]:
        return [n for m in self.matches() for n in m.hf_names]

    @staticmethod
    def is_ignored_hf(name: str) -> bool:
        return any(rx.match(name) for rx in IGNORED_HF)

    # ------------------------------------------------------------------------- transforms

    def to_mcore(self, m: Match, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The full Megatron tensor of ``m`` from its HF tensors (in ``m.hf_names`` order)."""
        names = m.hf_names
        if m.rule.transform == "copy":
            return tensors[0]
        if m.rule.transform == "gate_up":
            gate, up = tensors
            if gate.shape != up.shape:
                raise ValueError(
                    f"{names[0]} has shape {tuple(gate.shape)} but {names[1]} has {tuple(up.shape)}; "
                    "gate and up projections must match"
                )
            return torch.cat([gate, up], dim=0)
        if m.rule.transform == "qkv":
            return self._fuse_qkv(names, tensors)
        raise ValueError(f"unknown transform {m.rule.transform!r}")

    def to_hf(self, m: Match, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """HF (name, tensor) pairs of a full Megatron tensor (inverse of :meth:`to_mcore`)."""
        names = m.hf_names
        if m.rule.transform == "copy":
            return [(names[0], full)]
        if m.rule.transform == "gate_up":
            gate, up = torch.chunk(full, 2, dim=0)
            return [(names[0], gate.contiguous()), (names[1], up.contiguous())]
        if m.rule.transform == "qkv":
            per_group = self.heads // self.groups
            d = self.head_dim
            grouped = full.reshape(self.groups, (per_group + 2) * d, *full.shape[1:])
            q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
            return [
                (n, t.reshape(-1, *full.shape[1:]).contiguous()) for n, t in zip(names, (q, k, v))
            ]
        raise ValueError(f"unknown transform {m.rule.transform!r}")

    def _fuse_qkv(self, names: list[str], tensors: list[torch.Tensor]) -> torch.Tensor:
        per_group, d, g = self.heads // self.groups, self.head_dim, self.groups
        rows = (self.heads * d, g * d, g * d)
        q = tensors[0]
        for name, t, n in zip(names, tensors, rows):
            if t.shape[0] != n or t.shape[1:] != q.shape[1:]:
                raise ValueError(
                    f"{name}: shape {tuple(t.shape)} does not match the config, which implies "
                    f"{(n, *q.shape[1:])} (attention heads x head_dim = {self.heads} x {d}, "
                    f"key/value heads = {g})"
                )
        parts = [
            tensors[0].reshape(g, per_group * d, *q.shape[1:]),
            tensors[1].reshape(g, d, *q.shape[1:]),
            tensors[2].reshape(g, d, *q.shape[1:]),
        ]
        return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def is_sigma(name: str) -> bool:
    """ALP sigma parameters: Megatron-checkpoint state that never goes to HF."""
    return SIGMA_MARKER in name


def is_adapter(name: str) -> bool:
    """LoRA factors (``...linear_qkv_lora.A``): exported merged into their weight, or by
    :mod:`~megatron_alp.models.lora_export` in PEFT's names, never under their own."""
    return LORA_PARAM.search(name) is not None
