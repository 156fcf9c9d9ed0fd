"""Hugging Face <-> Megatron-Core parameter names and layouts: the rule tables, declared once.

A :class:`Rule` names one Megatron parameter (local-spec name, global layer ``{layer}`` / expert
``{expert}`` indices; the Transformer-Engine spec name when it differs) and the HF tensor(s) it is
made of, plus the transform between the two layouts:

- ``copy``: same tensor.
- ``qkv``: HF keeps q, k and v apart; Megatron fuses them grouped per query group,
  ``[q heads of group g, k_g, v_g]`` for each group g, so that TP shards are whole groups.
- ``gate_up``: Megatron's gated ``linear_fc1`` is ``[gate; up]`` along the output dimension.

``tp_dim`` states how Megatron splits the parameter over tensor parallelism (column-parallel and
vocab-parallel: dim 0; row-parallel: dim 1; absent: replicated), so loading and export do not
depend on attributes Megatron sets only while randomly initialising weights.

Tied embeddings have no ``lm_head`` rule (the HF file has no such tensor); ALP sigmas
(``alp_perturbation``) are Megatron-only state and never map to HF; neither do LoRA factors
(``*_lora.A``/``B``), which go out merged into their weight or as a PEFT adapter. Each model family
(:mod:`~megatron_alp.models.families`) names its table; families whose HF files are laid out alike
share one (differences such as q/k/v biases or qk-norm come from the config flags).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

SIGMA_MARKER = "alp_perturbation"
LORA_PARAM = re.compile(r"_lora\.[AB]$")  # LoRA factors beside their layer (models/lora.py)


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
