"""Build this rank's Megatron-Core ``GPTModel`` from a Hugging Face config."""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_alp.config import ConfigError, LoRAConfig, ModelConfig, MoEConfig, ParallelConfig, PerturbationConfig
from megatron_alp.models.families import MegatronModelArgs, torch_dtype
from megatron_alp.models.layer_spec import block_spec, resolve_spec
from megatron_alp.models.lora import attach_lora
from megatron_alp.models.output_layer import install_hidden_output
from megatron_alp.models.routing import attach_routing
from megatron_alp.runtime.platform import device, place_on_device
from megatron_alp.training.perturbation import attach_perturbation


def check_parallel_layout(args: MegatronModelArgs, parallel: ParallelConfig) -> None:
    """Refuse layouts Megatron would reject later with an assertion deep inside a layer."""
    t = args.transformer
    tp, pp, ep = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.expert_model_parallel_size,
    )
    checks = [
        (t["num_attention_heads"] % tp == 0, f"num_attention_heads={t['num_attention_heads']}", "tensor_model_parallel_size", tp),
        (t["num_query_groups"] % tp == 0, f"num_key_value_heads={t['num_query_groups']}", "tensor_model_parallel_size", tp),
        (args.vocab_size % tp == 0, f"vocab_size={args.vocab_size}", "tensor_model_parallel_size", tp),
        (t["ffn_hidden_size"] % tp == 0, f"intermediate_size={t['ffn_hidden_size']}", "tensor_model_parallel_size", tp),
        (t["num_layers"] % pp == 0, f"num_hidden_layers={t['num_layers']}", "pipeline_model_parallel_size", pp),
    ]
    if "num_moe_experts" in t:
        checks.append((t["num_moe_experts"] % ep == 0, f"num_experts={t['num_moe_experts']}", "expert_model_parallel_size", ep))
        if tp > 1 and not parallel.sequence_parallel:
            raise ValueError(
                "parallel.sequence_parallel must be true for a mixture-of-experts model with "
                "tensor_model_parallel_size > 1 (Megatron-Core requires it)"
            )
    elif ep > 1:
        raise ValueError("parallel.expert_model_parallel_size > 1 needs a mixture-of-experts model")
    for ok, what, key, size in checks:
        if not ok:
            raise ValueError(f"parallel.{key}={size} does not divide the model's {what}")


def check_moe(args: MegatronModelArgs, moe: MoEConfig) -> None:
    """Routing replay needs routers: refuse it for a dense model, naming the key."""
    if moe.routing_replay != "none" and "num_moe_experts" not in args.transformer:
        raise ConfigError(f"moe.routing_replay={moe.routing_replay} needs a mixture-of-experts model; "
                          f"this {args.family.name} model is dense (set moe.routing_replay: none)")


def transformer_config(
    args: MegatronModelArgs, model_cfg: ModelConfig, parallel: ParallelConfig, moe: MoEConfig | None = None
) -> TransformerConfig:
    moe = moe or MoEConfig()
    dtype = torch_dtype(model_cfg.dtype)
    kw = dict(args.transformer)
    kw.pop("moe_token_dispatcher_type", None)
    if "num_moe_experts" in kw:
        kw["moe_aux_loss_coeff"] = moe.aux_loss_coeff
        kw["moe_grouped_gemm"] = moe.grouped_gemm
    if model_cfg.recompute != "none":
        kw["recompute_granularity"] = model_cfg.recompute
        if model_cfg.recompute == "full":
            kw.update(recompute_method="uniform", recompute_num_layers=model_cfg.recompute_num_layers)
    return TransformerConfig(
        **kw,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=device().type == "cpu",  # where the model lives (GPU-like under the collective checker)
        variable_seq_lengths=True,
        # Megatron refuses the allgather dispatcher with variable sequence lengths, even for dense.
        moe_token_dispatcher_type="alltoall",
        deallocate_pipeline_outputs=True,
    )


def build_gpt_model(
    args: MegatronModelArgs,
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    perturbation: PerturbationConfig | None = None,
    moe: MoEConfig | None = None,
    lora: LoRAConfig | None = None,
) -> GPTModel:
    """The GPTModel stage owned by this rank (pre/post-process by pipeline position), with ALP
    perturbation attached when ``perturbation`` is given and ``enabled`` (a loaded
    :class:`~megatron_alp.config.Config` has resolved it from the loss; a section built by hand must
    say ``enabled=True``), LoRA adapters on a frozen base when ``lora`` is given and enabled
    (:mod:`megatron_alp.models.lora`) and, for an MoE model, a routing tap on every router
    (:mod:`megatron_alp.models.routing`). Parallel state must be initialised (see
    :func:`megatron_alp.runtime.parallel.init_distributed`)."""
    check_parallel_layout(args, parallel)
    if moe is not None:
        check_moe(args, moe)
    config = transformer_config(args, model_cfg, parallel, moe)
    spec = block_spec(config, resolve_spec(model_cfg.layer_spec), ps.get_pipeline_model_parallel_rank())
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        **args.rope,
    )
    install_hidden_output(model)
    attach_routing(model)
    if perturbation is not None and perturbation.enabled:
        attach_perturbation(model, perturbation)
    if lora is not None and lora.enabled:
        attach_lora(model, lora)
    return place_on_device(model)  # after attaching: the ALP sigmas and adapters train on the GPU too
