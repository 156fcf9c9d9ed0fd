"""Checksums of a checkpoint directory, so a damaged checkpoint cannot poison a resume.

A save can be cut short in ways the atomic rename does not see: a shard truncated by a full or
failing file system after it was written, a file lost from a copied run directory, a metadata
file overwritten by hand. :func:`write_manifest` records the size and BLAKE2b digest of every file
of a checkpoint (``checksums.json``) before the checkpoint is committed; :func:`damage` checks
them. Both are collective and split the files over the ranks, so a checkpoint of hundreds of GB is
hashed at the speed of all ranks' reads, not rank 0's. A checkpoint written before checksums
existed (no manifest) counts as intact.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch.distributed as dist

CHECKSUMS_FILE = "checksums.json"
_CHUNK = 8 << 20


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(ckpt_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*")
                  if p.is_file() and p.name != CHECKSUMS_FILE)


def _share(names: list[str]) -> list[str]:
    """This rank's files: every world-size-th, so the ranks read the checkpoint in parallel."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    return names[rank::world]


def _everyone(mine) -> list:
    if not dist.is_initialized():
        return [mine]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def write_manifest(ckpt_dir: Path) -> None:
    """Collective: record every file's size and digest in ``ckpt_dir/checksums.json`` (rank 0 writes)."""
    ckpt_dir = Path(ckpt_dir)
    names = _files(ckpt_dir) if not dist.is_initialized() or dist.get_rank() == 0 else None
    if dist.is_initialized():
        box = [names]
        dist.broadcast_object_list(box, src=0)
        names = box[0]
    mine = {n: [(ckpt_dir / n).stat().st_size, _digest(ckpt_dir / n)] for n in _share(names)}
    entries = {k: v for part in _everyone(mine) for k, v in part.items()}
    if not dist.is_initialized() or dist.get_rank() == 0:
        (ckpt_dir / CHECKSUMS_FILE).write_text(json.dumps({"blake2b-128": entries}, indent=1, sort_keys=True))


def damage(ckpt_dir: Path) -> Optional[str]:
    """Collective: None when every file the manifest lists is there with its size and digest (or
    there is no manifest), else what is wrong, the same on every rank."""
    ckpt_dir = Path(ckpt_dir)
    manifest = ckpt_dir / CHECKSUMS_FILE
    if not manifest.is_file():
        return None
    try:
        entries = json.loads(manifest.read_text())["blake2b-128"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return f"{manifest} is unreadable ({err})"
    problem = None
    for name in sorted(entries):  # sizes first, everywhere: cheap, and a cut file shows at once
        path, (size, _) = ckpt_dir / name, entries[name]
        if not path.is_file():
            problem = f"{name} is missing"
        elif path.stat().st_size != size:
            problem = f"{name} has {path.stat().st_size} bytes, {size} were written"
        if problem:
            return problem
    mine = next((f"{n} does not match its checksum" for n in _share(sorted(entries))
                 if _digest(ckpt_dir / n) != entries[n][1]), None)
    return next((p for p in _everyone(mine) if p), None)
