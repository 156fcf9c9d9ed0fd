"""Distributed checkpoint with Megatron's optimizer: save after training steps, load into fresh
objects (same layout, and for the plain optimizer also another layout), then the next step is
identical to the uninterrupted run. Also: a save that fails before commit leaves nothing behind.
Checkpoints are saved as the trainer saves them (with its HF model directory); the fp32 one's
logits on a fixed batch go to WORK_DIR/export_reference.pt for the test of its HF export.

Usage: torchrun --nproc_per_node 2 check_convert_checkpoint.py WORK_DIR RESULT.json
"""

import errno
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.utils import unwrap_model

from common import build, pipeline_logits, rank, reinit, tokens
from megatron_alp.config import OptimizerConfig, PerturbationConfig
from megatron_alp.training.dist_checkpoint import (
    DiskFullError,
    latest_checkpoint,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
)
from megatron_alp.models.hf_weights import iter_hf_weights
from megatron_alp.models.tiny import make_tiny_model
from megatron_alp.training.optim import build_optimizer, wrap_for_training
from megatron_alp.training.perturbation import next_microbatch, perturbed_step

work, result_path = Path(sys.argv[1]), sys.argv[2]
PERT = PerturbationConfig(enabled=True, layers="0,2", init_std=1e-2, lr=5e-2)
OPT = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_decay_style="cosine", weight_decay=0.1)
results = {}
base = work / "base_model"  # the trainer's HF model directory: config and tokenizer of the model trained
reinit()
if rank() == 0:
    make_tiny_model("qwen2", base, seed=5)
dist.barrier()


def make(tp: int, pp: int, dist_opt: bool, dtype: str):
    par = reinit(tp, pp)
    par.use_distributed_optimizer = dist_opt
    model = wrap_for_training(build("qwen2", par, PERT, dtype=dtype), par)
    opt, sched = build_optimizer(model, OPT, PERT, par, total_steps=10)
    return model, opt, sched


def train_step(model, opt, sched, step: int, perturb: bool = True) -> None:
    batch = tokens(b=2, s=10, seed=100 + step)  # same data on both ranks: TP/PP agnostic
    pos = torch.arange(10).unsqueeze(0).expand(2, -1)
    model.zero_grad_buffer()
    opt.zero_grad()
    # ALP noise depends on the data-parallel rank, so a comparison across layouts runs without it
    with perturbed_step(model if perturb else [], step):
        next_microbatch(model)
        logits = model(batch, pos, None)
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch.roll(-1, 1)).mean()
        loss.backward()
    model.finish_grad_sync()
    ok, _, _ = opt.step()
    sched.step(1)
    assert ok


def params(model) -> dict:
    return {n: p.detach().clone() for n, p in unwrap_model(model).named_parameters()}


def same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


for dist_opt, dtype in [(False, "float32"), (True, "bfloat16")]:
    tag = f"distopt{int(dist_opt)}_{dtype}"
    ckpt = work / f"ckpt_{tag}" / "checkpoints" / "iter_0000002"
    model, opt, sched = make(1, 1, dist_opt, dtype)
    for step in range(2):
        train_step(model, opt, sched, step)
    save_checkpoint(ckpt, model, optimizer=opt, opt_param_scheduler=sched, extra={"iteration": 2, "step": 2},
                    hf_dir=base)
    if dtype == "float32":
        batch = tokens(b=2, s=12, seed=7)
        with torch.no_grad():
            logits = pipeline_logits(unwrap_model(model), batch)
        if rank() == 0:
            torch.save({"tokens": batch, "logits": logits}, work / "export_reference.pt")
    train_step(model, opt, sched, 2)
    expected = params(model)

    model, opt, sched = make(1, 1, dist_opt, dtype)
    extra = load_checkpoint(ckpt, model, optimizer=opt, opt_param_scheduler=sched)
    assert extra == {"iteration": 2, "step": 2}, extra
    assert sched.num_steps == 2, sched.num_steps
    train_step(model, opt, sched, 2)
    same(params(model), expected, f"{tag}: step after resume")
    results[tag] = "resumed step identical"
    assert latest_checkpoint(work / f"ckpt_{tag}") == ckpt.absolute()

# The plain optimizer's checkpoint loads at another layout (TP=2): same next step, up to
# the reduction-order differences of TP (compared by the merged model, via the HF export).

ckpt = work / "ckpt_distopt0_float32" / "checkpoints" / "iter_0000002"
model, opt, sched = make(1, 1, False, "float32")
load_checkpoint(ckpt, model, optimizer=opt, opt_param_scheduler=sched)
train_step(model, opt, sched, 2, perturb=False)
ref = {n: t.clone() for n, t in iter_hf_weights(model)}
model, opt, sched = make(2, 1, False, "float32")
load_checkpoint(ckpt, model, optimizer=opt, opt_param_scheduler=sched)
train_step(model, opt, sched, 2, perturb=False)
diff = max((t - ref[n]).abs().max().item() for n, t in iter_hf_weights(model))
results["tp1_to_tp2_resume_max_diff"] = diff
assert diff < 1e-6, diff

# A save that dies before its commit leaves no checkpoint and no temporary folder.
model, _, _ = make(1, 1, False, "float32")
run = work / "crash_run"
(run / "checkpoints").mkdir(parents=True, exist_ok=True)
save_checkpoint(run / "checkpoints" / "iter_0000001", model, extra={"iteration": 1})


def boom(tmp: Path) -> None:
    assert tmp.name.startswith("iter_0000002.tmp-"), tmp
    assert not (run / "checkpoints" / "iter_0000002").exists()
    raise RuntimeError("simulated crash")


try:
    save_checkpoint(run / "checkpoints" / "iter_0000002", model, extra={"iteration": 2}, before_commit=boom)
    raise AssertionError("save did not raise")
except RuntimeError as err:
    assert "simulated crash" in str(err)
dist.barrier()
left = sorted(p.name for p in (run / "checkpoints").iterdir())
assert left == ["iter_0000001"], left
assert latest_checkpoint(run).name == "iter_0000001"
assert read_metadata(run / "checkpoints" / "iter_0000001")["extra"] == {"iteration": 1}
results["crash_leaves"] = left
dist.barrier()  # every rank has looked before rank 0 starts the next save's temporary folder


# A disk that fills up during the save (the writer's ENOSPC, as Megatron wraps it): nothing partial is
# left, the previous checkpoint stays, and the error says how much space a checkpoint needs.
def disk_full(tmp: Path) -> None:
    try:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "__0_1.distcp"))
    except OSError as err:
        raise RuntimeError("CheckpointException: write failed") from err


try:
    save_checkpoint(run / "checkpoints" / "iter_0000003", model, extra={"iteration": 3}, before_commit=disk_full)
    raise AssertionError("save did not raise")
except DiskFullError as err:
    results["disk_full"] = str(err)
dist.barrier()
assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_0000001"]
results["disk_full_previous_bytes"] = sum(p.stat().st_size for p in (run / "checkpoints" / "iter_0000001").rglob("*")
                                          if p.is_file())

if rank() == 0:
    json.dump(results, open(result_path, "w"), indent=1)
print("OK", json.dumps(results))
