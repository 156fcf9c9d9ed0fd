"""Exports of a LoRA model: the merged HF folder (iter_hf_weights) and the PEFT adapter folder
(lora_export), written for tests/test_lora_export.py to load with transformers and peft.

Usage: python check_lora_export.py WORK (1 rank)  |  torchrun --nproc_per_node 2 check_lora_export.py WORK

On one rank, first the tiny HF base models (``WORK/<family>/``, seeds SEEDS), then for each family: build the
Megatron model with LoRA, load the HF base, draw a nonzero B for every adapter (A is random already),
save the full adapters and the fp32 log-probabilities of a fixed batch to ``WORK/<family>_ref.pt``,
and write ``WORK/<family>_1rank/{merged,peft}``; for Qwen3 also save the model as a Megatron
checkpoint as a LoRA run does, its base folder ``WORK/qwen3`` recorded (``WORK/qwen3_ckpt``), the same
recording a copy of that folder that then moves to ``WORK/qwen3_moved`` (``WORK/qwen3_ckpt_moved``),
and its base model without adapters (``WORK/qwen3_base_ckpt``), for the ``convert`` command; last, that
command by the CLI's own entry (``WORK/commands.json``: step -> rc, out, err): ``mcore-to-peft`` of
qwen3_ckpt -> ``WORK/cli_peft``, ``mcore-to-hf`` -> ``WORK/cli_hf`` and ``verify`` of that against the
checkpoint; ``mcore-to-hf`` of qwen3_ckpt_moved without ``--base`` (refused), with ``--base
WORK/qwen3_moved`` (-> ``WORK/cli_hf_moved``), and of qwen3_ckpt with ``--base`` naming a model of
the same shapes and other weights (refused); ``reshard`` of qwen3_ckpt_moved with ``--base`` (->
``WORK/resharded``) and ``mcore-to-hf`` of that (-> ``WORK/cli_hf_resharded``). On two ranks, at each
layout of LAYOUTS: the same base and adapters (loaded from the 1-rank run) written to
``WORK/<family>_<layout>/{merged,peft}``.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from common import build, full_state, load_full_state, reinit, run_command, tokens
from megatron_alp.config import LoRAConfig
from megatron_alp.models.hf_weights import iter_hf_weights, load_hf_weights, write_hf_folder
from megatron_alp.models.lora import lora_state
from megatron_alp.models.lora_export import export_peft_adapter
from megatron_alp.models.tiny import make_tiny_model
from megatron_alp.training.dist_checkpoint import save_checkpoint
from megatron_alp.training.lora_base import LoRABase

LORA = {"qwen3": LoRAConfig(enabled=True, rank=4, alpha=8.0),  # every dense target
        "qwen3_moe": LoRAConfig(enabled=True, rank=4, alpha=8.0,
                                target_modules=["linear_qkv", "linear_proj", "experts"])}
SEEDS = {"qwen3": 20, "qwen3_moe": 21}
LAYOUTS = {"qwen3": {"tp2": dict(tp=2)}, "qwen3_moe": {"tp2": dict(tp=2, sp=True), "ep2": dict(ep=2)}}


def build_lora(family: str, work: Path, **layout):
    model = build(family, reinit(**layout), lora=LORA[family])
    load_hf_weights(model, work / family)
    return model


def write_exports(model, family: str, work: Path, out: Path) -> None:
    def add_files(tmp: Path) -> None:
        shutil.copy(work / family / "config.json", tmp / "config.json")

    weights = iter_hf_weights(model, bucket_bytes=64 << 10)
    if dist.get_rank() == 0:
        write_hf_folder(weights, out / "merged", max_shard_bytes=1 << 30, add_files=add_files)
    else:
        for _ in weights:
            pass
    export_peft_adapter(model, out / "peft", LORA[family], base_model_name_or_path=str(work / family),
                        bucket_bytes=16 << 10)  # several buckets


def reference(family: str, work: Path) -> None:
    model = build_lora(family, work)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in lora_state(model).items():
            if name.endswith(".B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    batch = tokens(b=2, s=16)
    pos = torch.arange(batch.shape[1]).unsqueeze(0).expand(batch.shape[0], -1)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(batch, pos, None).float(), dim=-1)
    adapters = {n: t for n, t in full_state(model).items() if n in lora_state(model)}
    torch.save({"tokens": batch, "logprobs": logprobs, "adapters": adapters}, work / f"{family}_ref.pt")
    write_exports(model, family, work, work / f"{family}_1rank")
    if family == "qwen3":
        save_checkpoint(work / "qwen3_ckpt", model, hf_dir=work / family, lora_base=LoRABase.of(work / family))
        shutil.copytree(work / family, work / "qwen3_to_move")
        save_checkpoint(work / "qwen3_ckpt_moved", model, hf_dir=work / family,
                        lora_base=LoRABase.of(work / "qwen3_to_move"))
        os.replace(work / "qwen3_to_move", work / "qwen3_moved")
        make_tiny_model(family, work / "qwen3_other", seed=SEEDS[family] + 10)
        base = build(family, reinit())
        load_hf_weights(base, work / family)
        save_checkpoint(work / "qwen3_base_ckpt", base, hf_dir=work / family)


def parallel(family: str, work: Path) -> None:
    adapters = torch.load(work / f"{family}_ref.pt")["adapters"]
    for layout, kw in LAYOUTS[family].items():
        model = build_lora(family, work, **kw)
        load_full_state(model, adapters)
        write_exports(model, family, work, work / f"{family}_{layout}")


def commands(work: Path) -> None:
    """``megatron-alp convert`` of the LoRA checkpoint (each command tears the process group down)."""
    ckpt = str(work / "qwen3_ckpt")
    out = {"peft": run_command(["convert", "mcore-to-peft", "--mcore", ckpt, "--out", str(work / "cli_peft"),
                                "--base-model", str(work / "qwen3")], work, "peft"),
           "hf": run_command(["convert", "mcore-to-hf", "--mcore", ckpt, "--out", str(work / "cli_hf")], work, "hf")}
    out["verify"] = run_command(["convert", "verify", "--hf", str(work / "cli_hf"), "--mcore", ckpt], work, "verify")
    moved, hf = str(work / "qwen3_ckpt_moved"), ["convert", "mcore-to-hf", "--mcore"]
    base_moved, base_other = ["--base", str(work / "qwen3_moved")], ["--base", str(work / "qwen3_other")]
    out["hf_gone"] = run_command([*hf, moved, "--out", str(work / "cli_hf_gone")], work, "hf_gone")
    out["hf_moved"] = run_command([*hf, moved, "--out", str(work / "cli_hf_moved"), *base_moved], work, "hf_moved")
    out["hf_other"] = run_command([*hf, ckpt, "--out", str(work / "cli_hf_other"), *base_other], work, "hf_other")
    out["reshard"] = run_command(["convert", "reshard", "--mcore", moved, "--out", str(work / "resharded"),
                                  *base_moved], work, "reshard")
    out["hf_resharded"] = run_command([*hf, str(work / "resharded"), "--out", str(work / "cli_hf_resharded")], work,
                                      "hf_resharded")
    (work / "commands.json").write_text(json.dumps(out, indent=1))


def main() -> None:
    work = Path(sys.argv[1])
    two_ranks = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not two_ranks:
        for family, seed in SEEDS.items():
            if not (work / family).exists():
                make_tiny_model(family, work / family, seed=seed)
    for family in LORA:
        (parallel if two_ranks else reference)(family, work)
    if not two_ranks:
        commands(work)


if __name__ == "__main__":
    main()
