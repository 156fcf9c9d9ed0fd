"""The frozen base of a LoRA checkpoint: which Hugging Face folder it is, and whether a folder still
holds it.

A LoRA run trains adapters (and ALP's sigmas) on base weights it never changes, read from an HF
folder (``model.hf_path`` or the run's ``base_model/``: LoRA refuses ``model.load``). Its checkpoints
hold the trained tensors and their optimizer state, and record that folder and a fingerprint of its
weights (:func:`~megatron_alp.models.hf_weights.hf_fingerprint`) instead of the base weights, which
are nearly all of a checkpoint's bytes (61 GiB of a 32B model's). A load reads the base from the
folder again once the fingerprint says it holds the weights the adapters were trained on: adapters
on another base would be another model, silently.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from megatron_alp.config import InputError
from megatron_alp.models.hf_weights import hf_fingerprint


@dataclasses.dataclass(frozen=True)
class LoRABase:
    """What a LoRA checkpoint records of its base (its metadata's ``lora_base``): the folder
    (absolute) and its weights' fingerprint, tensor count and bytes."""

    dir: str
    fingerprint: str
    tensors: int
    bytes: int

    @classmethod
    def of(cls, hf_dir) -> "LoRABase":
        fingerprint, tensors, nbytes = hf_fingerprint(hf_dir)
        return cls(str(Path(hf_dir).absolute()), fingerprint, tensors, nbytes)

    def difference(self, now: "LoRABase") -> Optional[str]:
        """How the weights of ``now`` differ from these (None: they do not)."""
        if (now.tensors, now.bytes) != (self.tensors, self.bytes):
            return f"{now.tensors} tensors of {now.bytes:,} bytes, recorded {self.tensors} of {self.bytes:,}"
        if now.fingerprint != self.fingerprint:
            return (f"the same {self.tensors} tensors ({self.bytes:,} bytes) with other values (fingerprint "
                    f"{now.fingerprint[:12]}, recorded {self.fingerprint[:12]})")
        return None


def verified_base(ckpt, recorded: dict, base_dir=None, hint: str = "") -> LoRABase:
    """The base to read the LoRA checkpoint ``ckpt``'s base weights from: ``base_dir`` (the same
    weights elsewhere), else the folder ``recorded`` (its metadata's ``lora_base``), once it holds the
    recorded weights. One line naming the folder and what differs (:class:`InputError`) when it is gone
    or holds other weights; ``hint`` ends it (what the caller may pass instead, e.g. convert's ``--base``)."""
    saved = LoRABase(**recorded)
    folder = Path(base_dir if base_dir is not None else saved.dir)
    now, problem = None, "is gone"
    if folder.is_dir():
        try:
            now = LoRABase.of(folder)
            differs = saved.difference(now)
            problem = None if differs is None else f"holds other weights than the adapters were trained on: {differs}"
        except (FileNotFoundError, ValueError) as err:  # no safetensors weights, a shard missing or unreadable
            problem = f"has no readable weights ({err})"
    if problem is not None:
        raise InputError(f"{ckpt}: its LoRA base {folder} {problem}; the checkpoint holds the adapters alone, which "
                         f"need that base{hint}")
    return now
