"""HF safetensors directory -> Megatron distributed checkpoint.

Runs on every rank of a job whose layout is ``parallel``: each rank builds its model stage, reads
only the HF tensors it needs (:func:`megatron_alp.models.hf_weights.load_hf_weights`) and writes
its shards. The checkpoint also records the HF config and keeps the tokenizer files, so the
export back needs nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from checkpoint_tools import dtype_name
from megatron_alp.training.export import weightless_model


def convert(hf_dir, out_dir, parallel, *, layer_spec: str = "auto", dtype: Optional[str] = None) -> None:
    """Write ``out_dir`` from ``hf_dir`` (dtype: the HF weights' own unless given)."""
    from megatron_alp.models.hf_weights import load_hf_weights, open_hf_checkpoint
    from megatron_alp.runtime.parallel import init_distributed
    from megatron_alp.training.dist_checkpoint import save_checkpoint

    hf_dir = Path(hf_dir)
    hf_config, _, ckpt = open_hf_checkpoint(hf_dir)
    dtype = dtype or dtype_name(ckpt.dtype())
    init_distributed(parallel)
    model = weightless_model(hf_config, parallel, dtype, layer_spec, source=str(hf_dir))
    load_hf_weights(model, hf_dir)
    save_checkpoint(out_dir, model, hf_config=hf_config, hf_dir=hf_dir,
                    extra={"converted_from": str(hf_dir.resolve())})
