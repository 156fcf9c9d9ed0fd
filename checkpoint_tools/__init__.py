"""Hugging Face <-> Megatron-Core checkpoint conversion, resharding and logits verification.

Command line: ``megatron-alp convert {hf-to-mcore,mcore-to-hf,reshard,verify}`` (see
:mod:`checkpoint_tools.cli`). Weight placement comes from
:mod:`megatron_alp.models.weight_mapping`, the same table the trainer's HF loading and the rollout
weight sync use. This module holds what the conversion jobs share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def parallel_config(tp: int, pp: int, ep: int, moe: bool):
    """The layout; MoE with TP > 1 gets sequence parallelism (Megatron requires it; the weights
    are unaffected)."""
    from megatron_alp.config import ParallelConfig

    return ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=moe and tp > 1,
    )


def world_size(tp: int, pp: int, ep: int) -> int:
    """Ranks a layout needs: each stage holds TP ranks and EP x (expert TP = TP) expert ranks."""
    return tp * pp * ep


def build_model(hf_config: dict, parallel, dtype: str, layer_spec: str, source: str, perturbation=None):
    """This rank's GPTModel stage for ``hf_config`` (parallel state must be initialised).

    Weights are left uninitialised: every one is overwritten from a checkpoint, and Megatron's
    random initialisation on the CPU materialises each full weight in float32 first, which would
    make the model's construction, not the conversion, the memory peak."""
    from megatron_alp.config import ModelConfig
    from megatron_alp.models.families import hf_to_megatron
    from megatron_alp.training.builder import build_gpt_model

    cfg = ModelConfig(hf_path=source, dtype=dtype, layer_spec=layer_spec)
    args = hf_to_megatron(hf_config).replace(perform_initialization=False)
    return build_gpt_model(args, cfg, parallel, perturbation)


def hf_source(mcore_dir, hf_ref: Optional[str] = None, *, need_tokenizer: bool) -> tuple[dict, Optional[Path]]:
    """The HF config a Megatron checkpoint recorded and the folder of its tokenizer files (None if
    it has none). ``hf_ref`` (``--hf-ref``) replaces both: checkpoints saved without them need it.
    The errors name what the checkpoint lacks and the option."""
    from megatron_alp.models.families import load_hf_config
    from megatron_alp.training.dist_checkpoint import HF_SUBDIR, META_FILE, read_metadata

    mcore_dir = Path(mcore_dir)
    meta = read_metadata(mcore_dir)
    if hf_ref:
        return load_hf_config(hf_ref), Path(hf_ref)
    if not meta.get("hf_config"):
        raise ValueError(f"{mcore_dir / META_FILE}: the checkpoint records no HF config (saved without one); "
                         "pass --hf-ref with the HF model directory it was trained from")
    files = mcore_dir / HF_SUBDIR
    if not files.is_dir():
        if need_tokenizer:
            raise FileNotFoundError(f"{files}: the checkpoint holds no tokenizer files (saved without them); "
                                    "pass --hf-ref with the HF model directory it was trained from")
        files = None
    return meta["hf_config"], files


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
