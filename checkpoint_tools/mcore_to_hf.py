"""Megatron distributed checkpoint -> HF directory (safetensors + config + tokenizer).

The weights stream out of :func:`megatron_alp.models.hf_weights.iter_hf_weights` (gathered
across TP/PP/EP, HF names, the checkpoint's dtype, ALP sigmas never included) and rank 0 writes
them into safetensors shards of at most ``max_shard_bytes``, so memory stays at the model stage
plus one shard. The result is written into ``<out>.tmp-XXXX`` and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from checkpoint_tools import build_model, copy_hf_side_files, is_rank0
from megatron_alp.models.hf_weights import INDEX_FILE



_SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors file tensor by tensor (``safetensors.torch.save_file`` first copies
    every tensor into one bytes object, doubling a shard's memory)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)


class ShardWriter:
    """Collects tensors into safetensors files of at most ``max_bytes`` (HF's sharded layout)."""

    def __init__(self, out_dir: Path, max_bytes: int):
        self.out, self.max_bytes = Path(out_dir), max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` (kept by reference: the export's buckets are never reused)."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.detach().cpu()  # export buckets live on the model's device
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        path = self.out / f"part-{len(self.files):05d}.safetensors"
        write_safetensors(path, self.pending, {"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Name the files as transformers does and write the index when there are several."""
        if self.pending:
            self._flush()
        if len(self.files) == 1:
            os.replace(self.files[0][0], self.out / "model.safetensors")
            return
        weight_map = {}
        n = len(self.files)
        for i, (path, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, self.out / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2))


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

    from megatron_alp.dist_checkpoint import HF_SUBDIR, commit_dir, load_checkpoint, make_tmp_dir, read_metadata
    from megatron_alp.models.families import load_hf_config
    from megatron_alp.models.hf_weights import iter_hf_weights
    from megatron_alp.parallel import init_distributed

    mcore_dir, out = Path(mcore_dir), Path(out_dir).absolute()
    meta = read_metadata(mcore_dir)
    side_files = Path(hf_ref) if hf_ref else mcore_dir / HF_SUBDIR
    hf_config = meta.get("hf_config") or (load_hf_config(hf_ref) if hf_ref else None)
    if hf_config is None:
        raise ValueError(f"{mcore_dir}: the checkpoint has no HF config; pass --hf-ref with the original HF directory")
    if not side_files.is_dir():
        raise FileNotFoundError(f"{side_files}: no HF config/tokenizer files to copy; pass --hf-ref")
    init_distributed(parallel)
    model = build_model(hf_config, parallel, meta["dtype"], layer_spec, source=str(mcore_dir))
    load_checkpoint(mcore_dir, model)
    tmp = None
    if is_rank0():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(make_tmp_dir(out))
    try:
        writer = ShardWriter(tmp, max_shard_bytes) if tmp else None
        for name, tensor in iter_hf_weights(model, bucket_bytes=min(512 << 20, max(max_shard_bytes // 4, 1))):
            if writer:
                writer.add(name, tensor)
        if writer:
            writer.finish()
            copy_hf_side_files(side_files, tmp)
            (tmp / "config.json").write_text(json.dumps(hf_config_for_export(hf_config, meta["dtype"]), indent=2))
            commit_dir(tmp, out)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dist.is_initialized():
        dist.barrier()
