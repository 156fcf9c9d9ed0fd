"""Megatron distributed checkpoint -> HF directory (safetensors + config + tokenizer): the export of
:mod:`megatron_alp.training.export`."""

from __future__ import annotations

from typing import Optional

from megatron_alp.training.export import export_hf


def convert(mcore_dir, out_dir, parallel, *, hf_ref: Optional[str] = None, layer_spec: str = "auto",
            max_shard_bytes: int = 5 << 30, base_dir=None) -> None:
    """Write the HF directory ``out_dir`` from the Megatron checkpoint ``mcore_dir`` (``base_dir``: a
    LoRA checkpoint's base folder, if not the recorded one)."""
    export_hf(mcore_dir, out_dir, parallel, hf_ref=hf_ref, layer_spec=layer_spec, max_shard_bytes=max_shard_bytes,
              base_dir=base_dir)
