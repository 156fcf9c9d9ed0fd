"""Megatron-Core layer specs for the supported families.

``te``: Megatron's Transformer-Engine spec (fused layernorm-linear, TE attention, grouped experts).
``local``: Megatron-Core's native modules with :class:`~megatron_alp.models.norm.RMSNorm`, which
runs on the CPU and supports sequence parallelism there. Both produce the same parameter names
in distributed checkpoints (the local spec maps its norms onto the TE names).
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_alp.models.norm import RMSNorm
from megatron_alp.platform import has_gpu


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def resolve_spec(choice: str) -> str:
    """``auto`` -> ``te`` when Transformer Engine and a GPU are present, else ``local``."""
    if choice == "auto":
        return "te" if (te_available() and has_gpu()) else "local"
    if choice == "te" and not te_available():
        raise RuntimeError("model.layer_spec: te needs transformer-engine, which is not importable here")
    return choice


def local_layer_spec(config: TransformerConfig) -> ModuleSpec:
    backend = LocalSpecProvider()
    mlp = get_mlp_module_spec_for_backend(
        backend=backend,
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
    )
    qk_norm = RMSNorm if config.qk_layernorm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def block_spec(config: TransformerConfig, spec: str, pp_rank: int) -> TransformerBlockSubmodules:
    """The decoder block spec (layers of this pipeline stage + final norm)."""
    if spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")
    n = get_num_layers_to_build(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[local_layer_spec(config)] * n, layer_norm=RMSNorm)
