"""Hugging Face <-> Megatron-Core parameter names and layouts: one declarative table per family.

Every consumer of weights -- loading an HF checkpoint into a Megatron model, the offline
converters, and the online weight export to the rollout engine -- goes through this table, so a
weight is placed by exactly one rule. A :class:`Rule` names one Megatron parameter (local-spec
name, global layer ``{layer}`` / expert ``{expert}`` indices; the Transformer-Engine spec name
when it differs) and the HF tensor(s) it is made of, plus the transform between the two layouts:

- ``copy``: same tensor.
- ``qkv``: HF keeps q, k and v apart; Megatron fuses them grouped per query group,
  ``[q heads of group g, k_g, v_g]`` for each group g, so that TP shards are whole groups.
- ``gate_up``: Megatron's gated ``linear_fc1`` is ``[gate; up]`` along the output dimension.

``tp_dim`` states how Megatron splits the parameter over tensor parallelism (column-parallel and
vocab-parallel: dim 0; row-parallel: dim 1; absent: replicated), so loading and export do not
depend on attributes Megatron sets only while randomly initialising weights.

Tied embeddings have no ``lm_head`` rule (the HF file has no such tensor); ALP sigmas
(``alp_perturbation``) are Megatron-only state and never map to HF.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megatron_alp.models.families import MegatronModelArgs, hf_to_megatron

SIGMA_MARKER = "alp_perturbation"


@dataclass(frozen=True)
class Rule:
    mcore: str
    hf: tuple[str, ...]
    transform: str = "copy"
    tp_dim: Optional[int] = None  # dimension split over tensor parallelism (None: replicated)
    te: Optional[str] = None
    when: Optional[str] = None  # a flag of the model (see WeightMapping.flags) the rule needs

    @property
    def is_expert(self) -> bool:
        """Expert weights are split over the expert tensor-parallel group, not the TP group."""
        return "{expert}" in self.mcore


COL, ROW = 0, 1  # column-parallel (output dim split, incl. vocab-parallel) / row-parallel


def _r(mcore: str, hf, transform: str = "copy", tp_dim: int | None = None, te: str | None = None,
       when: str | None = None) -> Rule:
    return Rule(mcore, (hf,) if isinstance(hf, str) else tuple(hf), transform, tp_dim, te, when)


L, HL = "decoder.layers.{layer}.", "model.layers.{layer}."

_EMBEDDING = (_r("embedding.word_embeddings.weight", "model.embed_tokens.weight", tp_dim=COL),)
_HEAD = (
    _r("decoder.final_layernorm.weight", "model.norm.weight"),
    _r("output_layer.weight", "lm_head.weight", tp_dim=COL, when="untied"),
)
_ATTENTION = (
    _r(L + "input_layernorm.weight", HL + "input_layernorm.weight",
       te=L + "self_attention.linear_qkv.layer_norm_weight"),
    _r(L + "self_attention.linear_qkv.weight",
       [HL + f"self_attn.{p}_proj.weight" for p in "qkv"], "qkv", COL),
    _r(L + "self_attention.linear_qkv.bias",
       [HL + f"self_attn.{p}_proj.bias" for p in "qkv"], "qkv", COL, when="qkv_bias"),
    _r(L + "self_attention.q_layernorm.weight", HL + "self_attn.q_norm.weight", when="qk_norm"),
    _r(L + "self_attention.k_layernorm.weight", HL + "self_attn.k_norm.weight", when="qk_norm"),
    _r(L + "self_attention.linear_proj.weight", HL + "self_attn.o_proj.weight", tp_dim=ROW),
    _r(L + "self_attention.linear_proj.bias", HL + "self_attn.o_proj.bias", when="linear_bias"),
)
_DENSE_MLP = (
    _r(L + "pre_mlp_layernorm.weight", HL + "post_attention_layernorm.weight",
       te=L + "mlp.linear_fc1.layer_norm_weight"),
    _r(L + "mlp.linear_fc1.weight", [HL + "mlp.gate_proj.weight", HL + "mlp.up_proj.weight"], "gate_up", COL),
    _r(L + "mlp.linear_fc1.bias", [HL + "mlp.gate_proj.bias", HL + "mlp.up_proj.bias"], "gate_up", COL,
       when="linear_bias"),
    _r(L + "mlp.linear_fc2.weight", HL + "mlp.down_proj.weight", tp_dim=ROW),
    _r(L + "mlp.linear_fc2.bias", HL + "mlp.down_proj.bias", when="linear_bias"),
)
_EXPERT, _HEXPERT = L + "mlp.experts.local_experts.{expert}.", HL + "mlp.experts.{expert}."
_MOE_MLP = (
    # The TE spec keeps a separate pre-MLP norm for MoE layers (the router reads its output).
    _r(L + "pre_mlp_layernorm.weight", HL + "post_attention_layernorm.weight"),
    _r(L + "mlp.router.weight", HL + "mlp.gate.weight"),
    _r(_EXPERT + "linear_fc1.weight", [_HEXPERT + "gate_proj.weight", _HEXPERT + "up_proj.weight"], "gate_up", COL,
       te=L + "mlp.experts.linear_fc1.weight{expert}"),
    _r(_EXPERT + "linear_fc2.weight", _HEXPERT + "down_proj.weight", tp_dim=ROW,
       te=L + "mlp.experts.linear_fc2.weight{expert}"),
)

# (rules applied once before the layers, rules applied per layer, rules after the layers)
RuleTable = tuple[tuple[Rule, ...], tuple[Rule, ...], tuple[Rule, ...]]
DENSE: RuleTable = (_EMBEDDING, _ATTENTION + _DENSE_MLP, _HEAD)
MOE: RuleTable = (_EMBEDDING, _ATTENTION + _MOE_MLP, _HEAD)

# family name (see families.FAMILIES) -> its table. Families whose HF files are laid out alike share
# a table (differences such as q/k/v biases or qk-norm come from the config flags); a family with
# other HF names gets a table of its own.
FAMILY_RULES: dict[str, RuleTable] = {"qwen2": DENSE, "qwen3": DENSE, "llama": DENSE, "qwen3_moe": MOE}

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
        if args.family.name not in FAMILY_RULES:
            raise ValueError(f"no weight mapping for model family {args.family.name!r}")
        t = args.transformer
        return cls(
            FAMILY_RULES[args.family.name], num_layers=t["num_layers"], num_experts=t.get("num_moe_experts") or 0,
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
