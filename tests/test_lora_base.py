"""What a LoRA checkpoint records of its frozen base and how a load checks it
(megatron_alp/training/lora_base.py, megatron_alp/models/hf_weights.py hf_fingerprint): the fingerprint
is the documented digest, computed here from the tensors as safetensors reads them; a copy of the
weights split over other shard files has the same one and is accepted in the recorded folder's place;
other values, a tensor fewer, a folder that is gone or holds no weights are refused in one line naming
the folder and what differs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_alp.config import InputError
from megatron_alp.models.hf_weights import FINGERPRINT_WINDOW, FINGERPRINT_WINDOWS, write_hf_folder
from megatron_alp.training.lora_base import LoRABase, verified_base

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
TAIL = "; the checkpoint holds the adapters alone, which need that base; pass --base DIR"


def _tensors(folder) -> dict[str, torch.Tensor]:
    return {name: t for f in sorted(folder.glob("*.safetensors")) for name, t in load_file(f).items()}


def _documented(folder) -> tuple[str, int, int]:
    """The docstring's digest: per tensor in name order, [name, dtype, shape] as JSON, then its bytes at
    FINGERPRINT_WINDOWS evenly spread windows of FINGERPRINT_WINDOW bytes (all of a tensor that small)."""
    tensors, digest = _tensors(folder), hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        digest.update(json.dumps([name, SAFETENSORS_DTYPES[t.dtype], list(t.shape)]).encode())
        if len(raw) <= FINGERPRINT_WINDOW * FINGERPRINT_WINDOWS:
            digest.update(raw)
            continue
        for i in range(FINGERPRINT_WINDOWS):
            at = (len(raw) - FINGERPRINT_WINDOW) * i // (FINGERPRINT_WINDOWS - 1)
            digest.update(raw[at:at + FINGERPRINT_WINDOW])
    return digest.hexdigest(), len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.fixture
def base(tiny_model, tmp_path):
    folder = tmp_path / "base"
    shutil.copytree(tiny_model("qwen3"), folder)
    return folder


def test_the_fingerprint_is_the_documented_digest(base):
    got = LoRABase.of(base)
    assert (got.fingerprint, got.tensors, got.bytes) == _documented(base)
    assert got.dir == str(base.absolute()) and got.tensors > 10


def test_the_same_weights_in_other_shard_files_are_the_same_base(base, tmp_path):
    split = write_hf_folder(iter(_tensors(base).items()), tmp_path / "split", max_shard_bytes=256 << 10)
    assert len(list(split.glob("*.safetensors"))) > 3
    recorded = LoRABase.of(base)
    assert verified_base("ckpt", dataclasses.asdict(recorded), split) == dataclasses.replace(recorded, dir=str(split))
    assert verified_base("ckpt", dataclasses.asdict(recorded)) == recorded  # no base_dir: the recorded folder


def _refusal(recorded: LoRABase, folder) -> str:
    with pytest.raises(InputError) as err:
        verified_base("ckpt", dataclasses.asdict(recorded), folder, hint="; pass --base DIR")
    return str(err.value)


def test_other_values_are_refused_naming_the_folder_and_the_fingerprints(base, tmp_path):
    recorded = LoRABase.of(base)
    tensors = _tensors(base)
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0  # one element, inside the first window
    changed = tmp_path / "changed"
    changed.mkdir()
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    now = _documented(changed)[0]
    assert _refusal(recorded, changed) == (
        f"ckpt: its LoRA base {changed} holds other weights than the adapters were trained on: the same "
        f"{recorded.tensors} tensors ({recorded.bytes:,} bytes) with other values (fingerprint {now[:12]}, "
        f"recorded {recorded.fingerprint[:12]}){TAIL}")


def test_a_tensor_fewer_is_refused_naming_the_counts(base, tmp_path):
    recorded = LoRABase.of(base)
    tensors = _tensors(base)
    dropped = tensors.pop(sorted(tensors)[0])
    fewer = tmp_path / "fewer"
    fewer.mkdir()
    save_file(tensors, str(fewer / "model.safetensors"), metadata={"format": "pt"})
    nbytes = recorded.bytes - dropped.numel() * dropped.element_size()
    assert _refusal(recorded, fewer) == (
        f"ckpt: its LoRA base {fewer} holds other weights than the adapters were trained on: "
        f"{recorded.tensors - 1} tensors of {nbytes:,} bytes, recorded {recorded.tensors} of {recorded.bytes:,}{TAIL}")


def test_a_folder_gone_or_without_weights_is_refused(base, tmp_path):
    recorded = LoRABase.of(base)
    assert _refusal(recorded, tmp_path / "nowhere") == f"ckpt: its LoRA base {tmp_path / 'nowhere'} is gone{TAIL}"
    shutil.rmtree(base)
    assert _refusal(recorded, None) == f"ckpt: its LoRA base {base.absolute()} is gone{TAIL}"  # the recorded one
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _refusal(recorded, empty)
    assert line.startswith(f"ckpt: its LoRA base {empty} has no readable weights ({empty}: no safetensors") and "\n" not in line
