"""Exports of a LoRA model (megatron_alp/models/lora_export.py and the merged HF export): tiny fp32
Qwen3 (every dense target) and Qwen3-MoE (attention and routed experts) with random A and nonzero B.

- peft's ``PeftModel.from_pretrained(hf_base, adapter_dir)`` gives Megatron's log-probabilities;
- transformers on the merged export (iter_hf_weights) gives them too, and its tensors are the base
  model's names only (no ``*_lora.*``);
- the adapter and merged folders written at TP=2 (and EP=2, MoE) equal the 1-rank ones bit for bit;
- ``megatron-alp convert`` of a LoRA checkpoint, saved as a run saves it (adapters without the base,
  its folder recorded): ``mcore-to-peft`` writes that adapter folder and ``mcore-to-hf`` that merged
  folder, which ``verify`` matches with the checkpoint; ``mcore-to-peft`` of a checkpoint without
  adapters is refused naming its metadata file;
- its recorded base folder moved: refused naming ``--base``, exported with ``--base``, and resharded
  with ``--base`` into a checkpoint that records the new folder; ``--base`` naming other weights of the
  same shapes is refused.

Megatron's side runs in tests/dist/check_lora_export.py: once on 1 rank (the base models, the
reference: adapters, log-probabilities, exports; then the ``convert`` commands by the CLI's entry)
and once under torchrun on 2 ranks; the expected values here come from transformers and peft
forwards in this process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import dist_job
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from megatron_alp.config import LoRAConfig
from megatron_alp.models.lora_export import ADAPTER_FILE, CONFIG_FILE, peft_adapter_config, write_peft_adapter

FAMILIES = ["qwen3", "qwen3_moe"]
TOL = 1e-5  # fp32 max |log-probability diff|: the same weights, other kernels
LAYOUTS = [("qwen3", "tp2"), ("qwen3_moe", "tp2"), ("qwen3_moe", "ep2")]

dist_job("lora_export_reference", "check_lora_export.py", "{dir}", nproc=1)
EXPORTS = dist_job("lora_export", "check_lora_export.py", "{dir:lora_export_reference}",
                   after=("lora_export_reference",))


@pytest.fixture(scope="module")
def work(dist_jobs) -> Path:
    dist_jobs.run("lora_export")
    return dist_jobs.run("lora_export_reference")


def _logprobs(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=tokens).logits.float(), dim=-1)


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@EXPORTS
@pytest.mark.parametrize("family", FAMILIES)
def test_peft_adapter_gives_megatrons_logprobs(work, family):
    from peft import PeftModel

    ref = torch.load(work / f"{family}_ref.pt")
    base = _hf(work / family)
    shift = (_logprobs(base, ref["tokens"]) - ref["logprobs"]).abs().max().item()
    model = PeftModel.from_pretrained(base, work / f"{family}_1rank" / "peft").eval()
    diff = (_logprobs(model, ref["tokens"]) - ref["logprobs"]).abs().max().item()
    assert diff < TOL and shift > 0.1, (diff, shift)  # the adapters change the model, PEFT's is Megatron's


@EXPORTS
@pytest.mark.parametrize("family", FAMILIES)
def test_merged_export_gives_megatrons_logprobs(work, family):
    ref = torch.load(work / f"{family}_ref.pt")
    merged = work / f"{family}_1rank" / "merged"
    names = sorted(load_file(merged / "model.safetensors"))
    assert names == sorted(load_file(work / family / "model.safetensors")), "not the base model's tensor names"
    diff = (_logprobs(_hf(merged), ref["tokens"]) - ref["logprobs"]).abs().max().item()
    assert diff < TOL, diff


@EXPORTS
def test_adapter_config(work):
    dense = json.loads((work / "qwen3_1rank" / "peft" / CONFIG_FILE).read_text())
    assert dense["peft_type"] == "LORA" and dense["task_type"] == "CAUSAL_LM"
    assert (dense["r"], dense["lora_alpha"], dense["lora_dropout"]) == (4, 8, 0.0)
    assert dense["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert dense["target_parameters"] is None and dense["base_model_name_or_path"] == str(work / "qwen3")
    moe = json.loads((work / "qwen3_moe_1rank" / "peft" / CONFIG_FILE).read_text())
    assert moe["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert moe["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    tensors = load_file(work / "qwen3_moe_1rank" / "peft" / ADAPTER_FILE)
    assert tensors["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape == (4 * 4, 128)
    assert tensors["base_model.model.model.layers.0.mlp.experts.lora_B.weight"].shape == (128, 4 * 4)


@EXPORTS
@pytest.mark.parametrize("family, layout", LAYOUTS)
def test_parallel_exports_equal_one_rank(work, family, layout):
    for kind, file in (("peft", ADAPTER_FILE), ("merged", "model.safetensors")):
        _assert_same_tensors(work / f"{family}_1rank" / kind / file, work / f"{family}_{layout}" / kind / file)
    config = [(work / f"{family}_{at}" / "peft" / CONFIG_FILE).read_text() for at in ("1rank", layout)]
    assert config[0] == config[1]


def _assert_same_tensors(a_file: Path, b_file: Path) -> None:
    a, b = load_file(a_file), load_file(b_file)
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))[:5]
    changed = [n for n in a if not torch.equal(a[n], b[n])]
    assert not changed, f"{b_file} differs from {a_file}: {changed[:5]}"


REFUSED = ("hf_gone", "hf_other")  # convert steps of commands.json that must fail


@EXPORTS
def test_convert_lora_checkpoint(work, tmp_path, capsys):
    from megatron_alp.cli import main

    ckpt, peft_dir, hf_dir = work / "qwen3_ckpt", work / "cli_peft", work / "cli_hf"
    commands = json.loads((work / "commands.json").read_text())
    for step, c in commands.items():
        if step not in REFUSED:
            assert c["rc"] == 0, f"convert {step} failed:\n{c['err'][-4000:]}"
    meta = json.loads((ckpt / "megatron_alp.json").read_text())
    assert meta["lora"]["rank"] == 4 and meta["lora_base"]["dir"] == str(work / "qwen3")
    stored = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert "embedding.word_embeddings.weight" not in stored and any(k.endswith("_lora.B") for k in stored)
    reference = work / "qwen3_1rank"
    _assert_same_tensors(reference / "peft" / ADAPTER_FILE, peft_dir / ADAPTER_FILE)
    assert (peft_dir / CONFIG_FILE).read_text() == (reference / "peft" / CONFIG_FILE).read_text()
    _assert_same_tensors(reference / "merged" / "model.safetensors", hf_dir / "model.safetensors")
    m = re.search(r"max \|logit diff\| = ([0-9.e+-]+)", commands["verify"]["out"])  # runs with its adapters
    assert m and float(m.group(1)) < 1e-4, commands["verify"]["out"][-3000:]

    base = work / "qwen3_base_ckpt"  # refused before any rank starts: by the command's entry, here
    capsys.readouterr()
    rc = main(["convert", "mcore-to-peft", "--mcore", str(base), "--out", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert f"{base / 'megatron_alp.json'}: the checkpoint records no LoRA adapters" in err
    assert not (tmp_path / "none").exists()


@EXPORTS
def test_convert_takes_the_base_folder_where_it_moved(work):
    """The recorded base folder is gone: refused naming it and ``--base``, nothing written; exported and
    resharded with ``--base`` (the reshard records the new folder and exports without it); ``--base``
    naming a model of the same shapes and other weights is refused naming what differs."""
    commands = json.loads((work / "commands.json").read_text())
    moved_ckpt, gone = work / "qwen3_ckpt_moved", commands["hf_gone"]
    assert gone["rc"] == 2 and not (work / "cli_hf_gone").exists(), gone["err"][-2000:]
    assert (f"megatron-alp convert mcore-to-hf: error: {moved_ckpt}: its LoRA base {work / 'qwen3_to_move'} is gone; "
            "the checkpoint holds the adapters alone, which need that base; pass --base DIR naming a folder that holds "
            "it\n") in gone["err"], gone["err"][-2000:]
    other = commands["hf_other"]
    assert other["rc"] == 2 and not (work / "cli_hf_other").exists(), other["err"][-2000:]
    assert (f"{work / 'qwen3_ckpt'}: its LoRA base {work / 'qwen3_other'} holds other weights than the adapters were "
            "trained on: the same ") in other["err"], other["err"][-2000:]
    merged = work / "qwen3_1rank" / "merged" / "model.safetensors"
    for out in ("cli_hf_moved", "cli_hf_resharded"):
        _assert_same_tensors(merged, work / out / "model.safetensors")
    resharded = json.loads((work / "resharded" / "megatron_alp.json").read_text())["lora_base"]
    recorded = json.loads((moved_ckpt / "megatron_alp.json").read_text())["lora_base"]
    assert resharded == {**recorded, "dir": str(work / "qwen3_moved")}, (resharded, recorded)


def test_bad_input_is_refused(tmp_path):
    cfg = LoRAConfig(enabled=True, rank=4)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.weight: not a PEFT LoRA tensor name"):
        peft_adapter_config(cfg, ["model.layers.0.self_attn.q_proj.weight"])
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        write_peft_adapter([], tmp_path / "out", cfg)
    with pytest.raises(ValueError, match="no PEFT LoRA tensors"):
        write_peft_adapter([], tmp_path / "empty", cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "a failed write left files behind"
