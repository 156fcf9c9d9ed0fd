"""A megatron-alp checkpoint as a Hugging Face model directory: what ``megatron-alp convert
mcore-to-hf`` writes and what ``megatron-alp eval --model RUN/checkpoints/iter_N`` evaluates.

The weights stream out of :func:`megatron_alp.models.hf_weights.iter_hf_weights` (gathered across
TP/PP/EP, HF names, the checkpoint's dtype, ALP sigmas never included) and rank 0 writes them with
:func:`megatron_alp.models.hf_weights.write_hf_folder` into safetensors shards of at most
``max_shard_bytes``, so memory stays at the model stage plus one shard. The config and tokenizer
come from the checkpoint (or ``hf_ref``); the folder appears only when complete.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from megatron_alp.config import ModelConfig
from megatron_alp.models.families import hf_to_megatron, load_hf_config
from megatron_alp.models.hf_weights import copy_hf_side_files, iter_hf_weights, write_hf_folder
from megatron_alp.runtime.parallel import init_distributed
from megatron_alp.training.builder import build_gpt_model
from megatron_alp.training.dist_checkpoint import HF_SUBDIR, META_FILE, load_checkpoint, read_metadata


def weightless_model(hf_config: dict, parallel, dtype: str, layer_spec: str, source: str, perturbation=None):
    """This rank's GPTModel stage for ``hf_config`` (parallel state must be initialised), its
    weights left uninitialised: every one is overwritten from a checkpoint, and Megatron's random
    initialisation on the CPU materialises each full weight in float32 first, which would make the
    model's construction, not the conversion, the memory peak."""
    cfg = ModelConfig(hf_path=source, dtype=dtype, layer_spec=layer_spec)
    args = hf_to_megatron(hf_config).replace(perform_initialization=False)
    return build_gpt_model(args, cfg, parallel, perturbation)


def hf_source(mcore_dir, hf_ref: Optional[str] = None, *, need_tokenizer: bool) -> tuple[dict, Optional[Path]]:
    """The HF config a checkpoint recorded and the folder of its tokenizer files (None if it has
    none). ``hf_ref`` (``--hf-ref``) replaces both: checkpoints saved without them need it. The
    errors name what the checkpoint lacks and the option."""
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


def hf_config_for_export(hf_config: dict, dtype: str) -> dict:
    """The config to write: the checkpoint's dtype, under both transformers 5 and 4 keys."""
    cfg = dict(hf_config)
    cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    return cfg


def export_hf(mcore_dir, out_dir, parallel, *, hf_ref: Optional[str] = None, layer_spec: str = "auto",
              max_shard_bytes: int = 5 << 30) -> None:
    """Write the HF directory ``out_dir`` from the checkpoint ``mcore_dir`` (every rank of the
    layout ``parallel`` calls it; rank 0 writes)."""
    mcore_dir = Path(mcore_dir)
    dtype = read_metadata(mcore_dir)["dtype"]
    hf_config, hf_files = hf_source(mcore_dir, hf_ref, need_tokenizer=True)
    init_distributed(parallel)
    model = weightless_model(hf_config, parallel, dtype, layer_spec, source=str(mcore_dir))
    load_checkpoint(mcore_dir, model)
    weights = iter_hf_weights(model, bucket_bytes=min(512 << 20, max(max_shard_bytes // 4, 1)))

    def add_files(tmp: Path) -> None:
        copy_hf_side_files(hf_files, tmp)
        (tmp / "config.json").write_text(json.dumps(hf_config_for_export(hf_config, dtype), indent=2))

    if dist.get_rank() == 0:
        write_hf_folder(weights, out_dir, max_shard_bytes=max_shard_bytes, add_files=add_files)
    else:
        for _ in weights:  # a collective: every rank takes part in every bucket
            pass
    dist.barrier()
