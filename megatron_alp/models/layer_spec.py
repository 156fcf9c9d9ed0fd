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
from megatron_alp.runtime.platform import has_gpu


def te_import_error() -> str | None:
    """Why Transformer Engine's PyTorch modules cannot be imported here, or None when they can.
    ``transformer_engine.pytorch`` is what Megatron-Core uses; ``import transformer_engine`` alone
    swallows that submodule's ImportError (e.g. a flash-attn built for another torch), and the run
    would die later in Megatron-Core with an AttributeError."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # a broken build raises more than ImportError (missing CUDA symbols)
        return f"{type(err).__name__}: {err}"
    return None


def resolve_spec(choice: str) -> str:
    """``auto``: ``te`` on a GPU, ``local`` on the CPU. A GPU job whose Transformer Engine does not
    import fails here, loudly: falling back to the local spec would train with unfused attention
    and norms at a fraction of the speed, which a user should choose, not discover."""
    if choice == "local" or (choice == "auto" and not has_gpu()):
        return "local"
    if not has_gpu():
        raise RuntimeError("model.layer_spec: te needs an NVIDIA GPU with Transformer Engine; on the CPU use "
                           "local (or auto)")
    error = te_import_error()
    if error is not None:
        raise RuntimeError(
            f"model.layer_spec: {choice} needs Transformer Engine on this GPU machine, and importing it failed "
            f"({error}). Install a transformer-engine matching torch/CUDA, or set model.layer_spec: local to "
            "run Megatron-Core's unfused modules on purpose."
        )
    return "te"


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
