"""Rewrite a Megatron distributed checkpoint under another TP/PP/EP layout.

``torch_dist`` checkpoints load under any layout already (the trainer can resume at another
one); resharding rewrites the files as if saved by the new layout, for tools that expect it. The
model weights, the ALP sigmas (each on its global layer) and the extra state are carried;
optimizer state is not (Megatron reshards it on load from the original checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from checkpoint_tools import build_model, copy_hf_side_files, is_rank0


def reshard(mcore_dir, out_dir, parallel, *, hf_ref: Optional[str] = None, layer_spec: str = "auto") -> None:
    from megatron_alp.config import PerturbationConfig
    from megatron_alp.dist_checkpoint import HF_SUBDIR, load_checkpoint, read_metadata, save_checkpoint
    from megatron_alp.models.families import load_hf_config
    from megatron_alp.parallel import init_distributed

    mcore_dir = Path(mcore_dir)
    meta = read_metadata(mcore_dir)
    hf_config = meta.get("hf_config") or (load_hf_config(hf_ref) if hf_ref else None)
    if hf_config is None:
        raise ValueError(f"{mcore_dir}: the checkpoint has no HF config; pass --hf-ref with the original HF directory")
    pert = PerturbationConfig(**meta["perturbation"]) if meta.get("perturbation") else None
    init_distributed(parallel)
    model = build_model(hf_config, parallel, meta["dtype"], layer_spec, source=str(mcore_dir), perturbation=pert)
    extra = load_checkpoint(mcore_dir, model)

    def add_hf_files(tmp: Path) -> None:
        src = mcore_dir / HF_SUBDIR if (mcore_dir / HF_SUBDIR).is_dir() else (Path(hf_ref) if hf_ref else None)
        if is_rank0() and src is not None:
            copy_hf_side_files(src, tmp / HF_SUBDIR)

    save_checkpoint(out_dir, model, extra=extra, hf_config=hf_config, before_commit=add_hf_files)
