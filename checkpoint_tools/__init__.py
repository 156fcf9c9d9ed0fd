"""Hugging Face <-> Megatron-Core checkpoint conversion, resharding and logits verification.

Command line: ``megatron-alp convert {hf-to-mcore,mcore-to-hf,reshard,verify}`` (see
:mod:`checkpoint_tools.cli`). Weight placement comes from
:mod:`megatron_alp.models.weight_mapping`, the same table the trainer's HF loading and the rollout
weight sync use. This module holds what the conversion jobs share.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# Files of an HF model directory that are not weights (config, tokenizer, chat template, ...).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


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
    from megatron_alp.models.builder import build_gpt_model
    from megatron_alp.models.families import hf_to_megatron

    cfg = ModelConfig(hf_path=source, dtype=dtype, layer_spec=layer_spec)
    args = hf_to_megatron(hf_config).replace(perform_initialization=False)
    return build_gpt_model(args, cfg, parallel, perturbation)


def copy_hf_side_files(src: Path, dst: Path) -> None:
    """Copy config, tokenizer and generation files (everything but weights) from ``src``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name not in WEIGHT_INDEXES:
            shutil.copy2(f, dst / f.name)


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
