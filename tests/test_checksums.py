"""Checkpoint checksums: every way a committed checkpoint can be damaged is found (one process)."""

import json

import pytest

from megatron_alp.training.checksums import CHECKSUMS_FILE, damage, write_manifest


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "iter_0000002"
    (d / "hf").mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 4096)
    (d / "metadata.json").write_text('{"a": 1}')
    (d / "hf" / "tokenizer.json").write_text("{}")
    write_manifest(d)
    return d


def test_an_intact_checkpoint_and_one_without_a_manifest_pass(ckpt, tmp_path):
    assert damage(ckpt) is None
    entries = json.loads((ckpt / CHECKSUMS_FILE).read_text())["blake2b-128"]
    assert sorted(entries) == ["__0_0.distcp", "hf/tokenizer.json", "metadata.json"]
    assert entries["__0_0.distcp"][0] == 256 * 4096
    old = tmp_path / "older"
    old.mkdir()
    (old / "metadata.json").write_text("{}")
    assert damage(old) is None  # written before checksums existed


def test_a_cut_file_is_found_by_its_size(ckpt):
    with open(ckpt / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    assert damage(ckpt) == f"__0_0.distcp has 1000 bytes, {256 * 4096} were written"


def test_a_changed_byte_is_found_by_its_digest(ckpt):
    data = bytearray((ckpt / "__0_0.distcp").read_bytes())
    data[123456] ^= 1
    (ckpt / "__0_0.distcp").write_bytes(bytes(data))
    assert damage(ckpt) == "__0_0.distcp does not match its checksum"


def test_a_missing_file_and_a_broken_manifest_are_found(ckpt):
    (ckpt / "hf" / "tokenizer.json").unlink()
    assert damage(ckpt) == "hf/tokenizer.json is missing"
    (ckpt / CHECKSUMS_FILE).write_text('{"blake2b-128": ')
    assert damage(ckpt).startswith(f"{ckpt / CHECKSUMS_FILE} is unreadable")
