"""A megatron-alp checkpoint as a Hugging Face model directory: what ``megatron-alp convert
mcore-to-hf`` writes and what ``megatron-alp eval --model RUN/checkpoints/iter_N`` evaluates; and
a LoRA checkpoint's adapters as a PEFT adapter directory (``megatron-alp convert mcore-to-peft``).

The weights stream out of :func:`megatron_alp.models.hf_weights.iter_hf_weights` (gathered across
TP/PP/EP, HF names, the checkpoint's dtype, ALP sigmas never included) and rank 0 writes them with
:func:`megatron_alp.models.hf_weights.write_hf_folder` into safetensors shards of at most
``max_shard_bytes``, so memory stays at the model stage plus one shard. The config and tokenizer
come from the checkpoint (or ``hf_ref``); the folder appears only when complete. A checkpoint
trained with LoRA records its adapters' config (``lora`` in its metadata): the model is rebuilt
with the same adapters, so the HF export is the merged model ``W + s B A`` and the PEFT export
(:mod:`megatron_alp.models.lora_export`) the adapters alone. A LoRA checkpoint without base weights
reads them from the base folder it records, or from ``base_dir`` (``--base``) when that folder moved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from megatron_alp.config import LoRAConfig, ModelConfig
from megatron_alp.models.families import hf_to_megatron, load_hf_config
from megatron_alp.models.hf_weights import copy_hf_side_files, iter_hf_weights, write_hf_folder
from megatron_alp.models.lora_export import export_peft_adapter
from megatron_alp.runtime.parallel import init_distributed
from megatron_alp.training.builder import build_gpt_model
from megatron_alp.training.dist_checkpoint import HF_SUBDIR, META_FILE, load_checkpoint, read_metadata


def weightless_model(hf_config: dict, parallel, dtype: str, layer_spec: str, source: str, perturbation=None,
                     lora: Optional[LoRAConfig] = None):
    """This rank's GPTModel stage for ``hf_config`` (parallel state must be initialised), its
    weights left uninitialised: every one is overwritten from a checkpoint, and Megatron's random
    initialisation on the CPU materialises each full weight in float32 first, which would make the
    model's construction, not the conversion, the memory peak. ``lora``: with these adapters."""
    cfg = ModelConfig(hf_path=source, dtype=dtype, layer_spec=layer_spec)
    args = hf_to_megatron(hf_config).replace(perform_initialization=False)
    return build_gpt_model(args, cfg, parallel, perturbation, lora=lora)


def checkpoint_lora(mcore_dir) -> Optional[LoRAConfig]:
    """The LoRA config a checkpoint's adapters were made with (its metadata's ``lora``); None for a
    checkpoint without adapters."""
    meta = read_metadata(mcore_dir)
    return LoRAConfig(**meta["lora"]) if meta.get("lora") else None


def adapter_lora(mcore_dir) -> LoRAConfig:
    """:func:`checkpoint_lora` of a checkpoint whose adapters are to be exported; an error naming
    the metadata file for one without."""
    lora = checkpoint_lora(mcore_dir)
    if lora is None:
        raise ValueError(f"{Path(mcore_dir) / META_FILE}: the checkpoint records no LoRA adapters (`lora` is "
                         "null); export the full model with mcore-to-hf")
    return lora


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
              max_shard_bytes: int = 5 << 30, base_dir=None) -> None:
    """Write the HF directory ``out_dir`` from the checkpoint ``mcore_dir`` (every rank of the
    layout ``parallel`` calls it; rank 0 writes); ``base_dir``: a LoRA checkpoint's base folder, if
    not the recorded one."""
    mcore_dir = Path(mcore_dir)
    dtype = read_metadata(mcore_dir)["dtype"]
    hf_config, hf_files = hf_source(mcore_dir, hf_ref, need_tokenizer=True)
    init_distributed(parallel)
    model = weightless_model(hf_config, parallel, dtype, layer_spec, source=str(mcore_dir),
                             lora=checkpoint_lora(mcore_dir))
    load_checkpoint(mcore_dir, model, base_dir=base_dir)
    weights = iter_hf_weights(model, bucket_bytes=min(512 << 20, max(max_shard_bytes // 4, 1)))  # merged

    def add_files(tmp: Path) -> None:
        copy_hf_side_files(hf_files, tmp)
        (tmp / "config.json").write_text(json.dumps(hf_config_for_export(hf_config, dtype), indent=2))

    if dist.get_rank() == 0:
        write_hf_folder(weights, out_dir, max_shard_bytes=max_shard_bytes, add_files=add_files)
    else:
        for _ in weights:  # a collective: every rank takes part in every bucket
            pass
    dist.barrier()


def export_peft(mcore_dir, out_dir, parallel, *, hf_ref: Optional[str] = None, layer_spec: str = "auto",
                base_model: Optional[str] = None, base_dir=None) -> None:
    """Write the adapters of the LoRA checkpoint ``mcore_dir`` as the PEFT adapter directory
    ``out_dir``, recording ``base_model`` as its ``base_model_name_or_path`` (every rank of the
    layout ``parallel`` calls it; rank 0 writes); ``base_dir`` as for :func:`export_hf`."""
    mcore_dir = Path(mcore_dir)
    lora = adapter_lora(mcore_dir)
    hf_config, _ = hf_source(mcore_dir, hf_ref, need_tokenizer=False)
    init_distributed(parallel)
    model = weightless_model(hf_config, parallel, read_metadata(mcore_dir)["dtype"], layer_spec,
                             source=str(mcore_dir), lora=lora)
    load_checkpoint(mcore_dir, model, base_dir=base_dir)
    export_peft_adapter(model, out_dir, lora, base_model_name_or_path=base_model)
