"""A LoRA checkpoint's adapters -> PEFT adapter directory (adapter_model.safetensors +
adapter_config.json): the export of :func:`megatron_alp.training.export.export_peft`."""

from __future__ import annotations

from typing import Optional

from megatron_alp.training.export import export_peft


def convert(mcore_dir, out_dir, parallel, *, hf_ref: Optional[str] = None, layer_spec: str = "auto",
            base_model: Optional[str] = None, base_dir=None) -> None:
    """Write the PEFT adapter directory ``out_dir`` from the LoRA checkpoint ``mcore_dir`` (``base_dir``:
    its base folder, if not the recorded one)."""
    export_peft(mcore_dir, out_dir, parallel, hf_ref=hf_ref, layer_spec=layer_spec, base_model=base_model,
                base_dir=base_dir)
