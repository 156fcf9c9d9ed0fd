"""`megatron-alp convert` end to end, every command run by the CLI's own entry (megatron_alp.cli.main)
in this one-rank process, one after the other (a command on two ranks launches them itself, as it
does from a terminal); tests/test_convert.py judges what they wrote and said.

Usage: python check_convert_cli.py WORK CONVERT_DIR CHECKPOINT_DIR
  CONVERT_DIR: tests/dist/check_convert.py's folder (tiny HF models of each family; qwen2_ckpt, a TP=2
  checkpoint with ALP sigmas on layers 1 and 3); CHECKPOINT_DIR: check_convert_checkpoint.py's
  (checkpoints saved as the trainer saves them; crash_run's holds no HF model directory).

Writes WORK/commands.json: {step: {"rc", "out", "err"}} with, per step, the files it wrote in WORK:
- trainer_export: mcore-to-hf of a trainer checkpoint (no --hf-ref) -> trainer_hf
- moe_to_mcore (--ep 2, launches 2 ranks) -> moe_mcore; moe_to_hf (one rank, 200KB shards) -> moe_hf;
  moe_verify
- bf16_to_mcore (a bf16 Qwen3, seed 3: qwen3_bf16) -> bf16_mcore; bf16_to_hf -> bf16_hf; bf16_verify
- reshard (qwen2_ckpt to one rank) -> resharded, whose sigmas (read back with Megatron's plain-tensor
  loader) go to sigmas.json; resharded_to_hf (--hf-ref the qwen2 model) -> resharded_hf
- shape_mismatch: hf-to-mcore --tp 2 of a qwen2 model with one tensor of the wrong shape (bad_shape)
  -> nothing (out: bad_shape_mcore)
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from common import run_command
from megatron_alp.models.tiny import make_tiny_model

work, models, checkpoints = (Path(a) for a in sys.argv[1:4])
commands = {}


def convert(step: str, *args: str) -> None:
    commands[step] = run_command(["convert", *args], work, step)


convert("trainer_export", "mcore-to-hf", "--mcore",
        str(checkpoints / "ckpt_distopt0_float32" / "checkpoints" / "iter_0000002"), "--out", str(work / "trainer_hf"))

convert("moe_to_mcore", "hf-to-mcore", "--hf", str(models / "qwen3_moe"), "--out", str(work / "moe_mcore"), "--ep", "2")
convert("moe_to_hf", "mcore-to-hf", "--mcore", str(work / "moe_mcore"), "--out", str(work / "moe_hf"),
        "--max-shard-size", "200KB")
convert("moe_verify", "verify", "--hf", str(models / "qwen3_moe"), "--mcore", str(work / "moe_mcore"))

make_tiny_model("qwen3", work / "qwen3_bf16", seed=3, dtype="bfloat16")
convert("bf16_to_mcore", "hf-to-mcore", "--hf", str(work / "qwen3_bf16"), "--out", str(work / "bf16_mcore"))
convert("bf16_to_hf", "mcore-to-hf", "--mcore", str(work / "bf16_mcore"), "--out", str(work / "bf16_hf"))
convert("bf16_verify", "verify", "--hf", str(work / "qwen3_bf16"), "--mcore", str(work / "bf16_mcore"))

convert("reshard", "reshard", "--mcore", str(models / "qwen2_ckpt"), "--out", str(work / "resharded"))
if commands["reshard"]["rc"] == 0:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_alp.config import ParallelConfig
    from megatron_alp.runtime.parallel import destroy_distributed, init_distributed

    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        if not dist.is_initialized():
            os.environ.pop(key, None)
    init_distributed(ParallelConfig())
    tensors = dist_checkpointing.load_plain_tensors(str(work / "resharded"))
    sigmas = {k: v.tolist() for k, v in tensors.items() if "alp_perturbation" in k}
    (work / "sigmas.json").write_text(json.dumps(sigmas))
    destroy_distributed()
convert("resharded_to_hf", "mcore-to-hf", "--mcore", str(work / "resharded"), "--out", str(work / "resharded_hf"),
        "--hf-ref", str(models / "qwen2"))

bad = work / "bad_shape"
shutil.copytree(models / "qwen2", bad)
tensors = load_file(bad / "model.safetensors")
hidden, ffn = tensors["model.layers.2.mlp.down_proj.weight"].shape
tensors["model.layers.2.mlp.down_proj.weight"] = torch.zeros(hidden, ffn - 32)
save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
convert("shape_mismatch", "hf-to-mcore", "--hf", str(bad), "--out", str(work / "bad_shape_mcore"), "--tp", "2")

(work / "commands.json").write_text(json.dumps(commands, indent=1))
print("OK", {step: c["rc"] for step, c in commands.items()})
