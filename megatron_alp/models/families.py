"""Model families: the registry of supported architectures, and how a Hugging Face config
becomes Megatron-Core ``TransformerConfig`` arguments.

A family is one registered :class:`ModelFamily` that declares everything the project needs to
know about it: which HF architectures it covers, what the HF config leaves implicit (Qwen2 always
has q/k/v biases, Qwen3 always normalises q and k per head), whether it is a mixture of experts,
its weight-mapping rule table (:mod:`~megatron_alp.models.weight_rules`) and the config of its tiny
test model (``model.tiny``, ``megatron-alp smoke --family``). :func:`hf_to_megatron` reads the rest
from the config and refuses what Megatron-Core would silently compute differently (an unsupported
RoPE scaling, activation, or sliding window). Adding a family is one :func:`register_family` call.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron_alp.models.weight_rules import DENSE, MOE, RuleTable


@dataclass(frozen=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    qkv_bias: Optional[bool]  # None: read `attention_bias` from the config
    qk_layernorm: bool
    rules: RuleTable  # HF <-> Megatron weight names and layouts
    tiny: dict  # HF config of the family's tiny test model (random weights, local tokenizer)
    moe: bool = False


FAMILIES: dict[str, ModelFamily] = {}

# Hugging Face configs of published models (config.json only), bundled so that `megatron-alp plan`
# can size a config whose model.hf_path is not on this machine.
PUBLISHED = Path(__file__).parent / "published"


def register_family(family: ModelFamily) -> ModelFamily:
    """Add ``family`` to the registry under its name (``model.tiny``, ``smoke --family``)."""
    if family.name in FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


# The tiny models' shared dimensions. vLLM's CPU attention needs head_dim >= 32: hidden 128 over 4 heads.
TINY_VOCAB = 512
_TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=1024, rms_norm_eps=1e-6,
             hidden_act="silu", initializer_range=0.02, bos_token_id=0, eos_token_id=2, pad_token_id=0)

register_family(ModelFamily(
    "qwen2", ("Qwen2ForCausalLM",), ("qwen2",), qkv_bias=True, qk_layernorm=False, rules=DENSE,
    tiny=dict(_TINY, model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True,
              rope_theta=10000.0)))
register_family(ModelFamily(
    "qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qkv_bias=None, qk_layernorm=True, rules=DENSE,
    tiny=dict(_TINY, model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True,
              head_dim=64, rope_theta=1000000.0, attention_bias=False)))
register_family(ModelFamily(
    "llama", ("LlamaForCausalLM",), ("llama",), qkv_bias=None, qk_layernorm=False, rules=DENSE,
    tiny=dict(_TINY, model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
              rope_theta=500000.0, attention_bias=False, mlp_bias=False)))
register_family(ModelFamily(
    "qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), qkv_bias=None, qk_layernorm=True, rules=MOE, moe=True,
    tiny=dict(_TINY, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], tie_word_embeddings=False,
              head_dim=32, rope_theta=1000000.0, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0)))


def family_of(hf: dict) -> ModelFamily:
    """The registered family of an HF config dict, by `architectures` or `model_type`."""
    archs = tuple(hf.get("architectures") or ())
    for fam in FAMILIES.values():
        if any(a in fam.architectures for a in archs) or hf.get("model_type") in fam.model_types:
            return fam
    known = ", ".join(a for f in FAMILIES.values() for a in f.architectures)
    raise ValueError(
        f"unsupported architecture {list(archs) or hf.get('model_type')!r}: supported are {known}"
    )


def load_hf_config(path: str | Path) -> dict:
    """Read ``config.json`` of an HF model directory as a plain dict."""
    path = Path(path)
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: no Hugging Face config.json there")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{cfg_file}: not valid JSON ({err})") from None


def num_experts(hf: dict) -> int:
    """Routed experts per MoE layer of an HF config (``num_experts``, or ``num_local_experts`` as
    transformers 5 writes it); 0 for a dense model."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def _req(hf: dict, key: str) -> Any:
    if key not in hf:
        raise ValueError(f"HF config is missing `{key}`")
    return hf[key]


def rope_settings(hf: dict) -> dict:
    """RoPE base and scaling from either the transformers 4.x or 5.x config layout."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = (scaling or params).get("rope_type", (scaling or params).get("type", "default"))
    out = {"rotary_base": float(theta), "rope_scaling": False, "rope_scaling_factor": 8.0}
    if rope_type in (None, "default"):
        return out
    src = scaling or params
    if rope_type == "llama3":
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for k, v in expected.items():
            if float(src.get(k, v)) != float(v):
                raise ValueError(
                    f"rope scaling `{k}`={src.get(k)} is not supported by Megatron-Core's llama3 "
                    f"RoPE scaling (expects {v})"
                )
        out.update(rope_scaling=True, rope_scaling_factor=float(src["factor"]))
        return out
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: default, llama3)")


@dataclass
class MegatronModelArgs:
    """Everything needed to build the Megatron model besides the parallel layout."""

    family: ModelFamily
    transformer: dict  # TransformerConfig keyword arguments
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: dict

    def replace(self, **transformer_overrides) -> "MegatronModelArgs":
        return dataclasses.replace(self, transformer={**self.transformer, **transformer_overrides})


def hf_to_megatron(hf: dict) -> MegatronModelArgs:
    """Translate an HF config dict into Megatron-Core model arguments (architecture only)."""
    fam = family_of(hf)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (these families use silu)")
    if hf.get("use_sliding_window"):
        raise ValueError("sliding-window attention (`use_sliding_window: true`) is not supported")
    heads = int(_req(hf, "num_attention_heads"))
    hidden = int(_req(hf, "hidden_size"))
    head_dim = hf.get("head_dim") or hidden // heads
    qkv_bias = fam.qkv_bias if fam.qkv_bias is not None else bool(hf.get("attention_bias", False))
    tcfg: dict[str, Any] = dict(
        num_layers=int(_req(hf, "num_hidden_layers")),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        kv_channels=int(head_dim),
        ffn_hidden_size=int(_req(hf, "intermediate_size")),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=bool(hf.get("mlp_bias", False)),
        add_qkv_bias=qkv_bias,
        qk_layernorm=fam.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(hf.get("initializer_range", 0.02)),
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    if fam.moe:
        if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
            raise ValueError(
                "Qwen3-MoE with dense layers (`mlp_only_layers` / `decoder_sparse_step` != 1) is not supported"
            )
        experts = num_experts(hf)
        if not experts:
            raise ValueError("HF MoE config is missing `num_experts`")
        tcfg.update(
            num_moe_experts=experts,
            moe_router_topk=int(_req(hf, "num_experts_per_tok")),
            moe_ffn_hidden_size=int(_req(hf, "moe_intermediate_size")),
            # HF: softmax over all experts, top-k, renormalise iff norm_topk_prob.
            # Megatron: pre_softmax=False takes top-k of logits then softmax == renormalised.
            moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", True)),
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="aux_loss",
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="alltoall",
        )
    vocab = int(_req(hf, "vocab_size"))
    return MegatronModelArgs(
        family=fam,
        transformer=tcfg,
        vocab_size=vocab,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope=rope_settings(hf),
    )


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
