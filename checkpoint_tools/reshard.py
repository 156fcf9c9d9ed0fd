"""Rewrite a Megatron distributed checkpoint under another TP/PP/EP layout.

``torch_dist`` checkpoints load under any layout already (the trainer can resume at another
one); resharding rewrites the files as if saved by the new layout, for tools that expect it. The
model weights, the ALP sigmas (each on its global layer), the LoRA adapters, the extra state, the HF
config and the tokenizer files are carried; optimizer state is not (Megatron reshards it on load from the
original checkpoint). A LoRA checkpoint without base weights stays so: its base is read from the
recorded folder (or ``base_dir``) and that folder is recorded in the new one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from megatron_alp.training.export import checkpoint_lora, hf_source, weightless_model
from megatron_alp.training.lora_base import verified_base


def reshard(mcore_dir, out_dir, parallel, *, hf_ref: Optional[str] = None, layer_spec: str = "auto",
            base_dir=None) -> None:
    from megatron_alp.config import PerturbationConfig
    from megatron_alp.runtime.parallel import init_distributed
    from megatron_alp.training.dist_checkpoint import load_checkpoint, read_metadata, save_checkpoint

    mcore_dir = Path(mcore_dir)
    meta = read_metadata(mcore_dir)
    hf_config, hf_files = hf_source(mcore_dir, hf_ref, need_tokenizer=False)
    pert = PerturbationConfig(**meta["perturbation"]) if meta.get("perturbation") else None
    init_distributed(parallel)
    model = weightless_model(hf_config, parallel, meta["dtype"], layer_spec, source=str(mcore_dir), perturbation=pert,
                             lora=checkpoint_lora(mcore_dir))
    base = verified_base(mcore_dir, meta["lora_base"], base_dir) if meta.get("lora_base") else None
    extra = load_checkpoint(mcore_dir, model, base_dir=None if base is None else base.dir)
    save_checkpoint(out_dir, model, extra=extra, hf_config=hf_config, hf_dir=hf_files, lora_base=base)
