"""Megatron distributed checkpoint -> HF directory (safetensors + config + tokenizer).

The weights stream out of :func:`megatron_alp.models.hf_weights.iter_hf_weights` (gathered
across TP/PP/EP, HF names, the checkpoint's dtype, ALP sigmas never included) and rank 0 writes
them with :func:`megatron_alp.models.hf_weights.write_hf_folder` into safetensors shards of at
most ``max_shard_bytes``, so memory stays at the model stage plus one shard. The config and
tokenizer come from the checkpoint (or ``--hf-ref``); the folder appears only when complete.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from checkpoint_tools import build_model, hf_source, is_rank0


def hf_config_for_export(hf_config: dict, dtype: str) -> dict:
    """The config to write: the checkpoint's dtype, under both transformers 5 and 4 keys."""
    cfg = dict(hf_config)
    cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    return cfg


def convert(mcore_dir, out_dir, parallel, *, hf_ref: Optional[str] = None, layer_spec: str = "auto",
            max_shard_bytes: int = 5 << 30) -> None:
    """Write the HF directory ``out_dir`` from the Megatron checkpoint ``mcore_dir``."""
    import torch.distributed as dist

    from megatron_alp.models.hf_weights import copy_hf_side_files, iter_hf_weights, write_hf_folder
    from megatron_alp.runtime.parallel import init_distributed
    from megatron_alp.training.dist_checkpoint import load_checkpoint, read_metadata

    mcore_dir = Path(mcore_dir)
    dtype = read_metadata(mcore_dir)["dtype"]
    hf_config, hf_files = hf_source(mcore_dir, hf_ref, need_tokenizer=True)
    init_distributed(parallel)
    model = build_model(hf_config, parallel, dtype, layer_spec, source=str(mcore_dir))
    load_checkpoint(mcore_dir, model)
    weights = iter_hf_weights(model, bucket_bytes=min(512 << 20, max(max_shard_bytes // 4, 1)))

    def add_files(tmp: Path) -> None:
        copy_hf_side_files(hf_files, tmp)
        (tmp / "config.json").write_text(json.dumps(hf_config_for_export(hf_config, dtype), indent=2))

    if is_rank0():
        write_hf_folder(weights, out_dir, max_shard_bytes=max_shard_bytes, add_files=add_files)
    else:
        for _ in weights:  # a collective: every rank takes part in every bucket
            pass
    if dist.is_initialized():
        dist.barrier()
