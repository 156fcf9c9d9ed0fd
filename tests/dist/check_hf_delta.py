"""DeltaExport against iter_hf_weights on two gloo ranks: what the receivers rebuild is the model.

Usage: torchrun --nproc_per_node 2 check_hf_delta.py RESULT.json

Per scenario and rank, RESULT.json records what the tests compare: after an anchor and delta
streams, each receiver's picture (the anchor's tensors with every later stream's yields laid over
them) against a fresh iter_hf_weights of the same model (the names of the tensors whose bits differ),
the names each stream yielded and those whose Megatron tensor changed (from two iter_hf_weights
gathers), the changed elements counted from those gathers, the dense bytes, and the stream's
statistics. Scenarios: bf16 tiny models at TP=2, PP=2 (tied embeddings), EP=2 (Qwen3-MoE) and
TP=1 DP=2 with receivers [0] and [0, 1] under sparse bit flips (and a dense change of one tensor),
then a corrupted mirror, then a reset on rank 1; a float32 model where every element changes; one
real optimizer step of a tied bf16 model under DDP; a LoRA model whose adapters change.
"""

import json
import sys
import zlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.utils import unwrap_model

from common import build, global_name, rank, reinit, tokens
from megatron_alp.config import LoRAConfig, OptimizerConfig, PerturbationConfig
from megatron_alp.models.hf_delta import DeltaExport, DeltaMismatch, delta_memory
from megatron_alp.models.hf_weights import iter_hf_weights
from megatron_alp.models.sharding import gather_tp, partition_dim_of, shard
from megatron_alp.models.weight_mapping import WeightMapping
from megatron_alp.training.optim import build_optimizer, wrap_for_training

BUCKET = 16 << 10  # many buckets per stage, the larger tensors alone in theirs
RATE = 0.01  # elements flipped per sparse step
DENSE = "decoder.layers.1.self_attention.linear_proj.weight"  # changed everywhere at step 2
LAYOUTS = {"tp2": ("qwen3", dict(tp=2), [0]), "pp2": ("qwen3", dict(pp=2), [0]),
           "ep2": ("qwen3_moe", dict(ep=2), [1]), "dp2": ("qwen3", {}, [0]), "dp2_both": ("qwen3", {}, [0, 1])}
INT = {2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(INT[t.element_size()])


def gather(model, receivers) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in iter_hf_weights(model, BUCKET, receivers)}


def flip(model, rate: float, step: int, dense: str | None = None) -> None:
    """Flip the lowest bit of a random ``rate`` of every parameter's elements, drawn over the full
    tensor by its global name (so the same on every rank holding it), and with ``dense`` add noise to
    all of that tensor."""
    group, tp_rank, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(), \
        ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            dim = partition_dim_of(p)
            full = gather_tp(p.detach(), name, dim, group, gated=True).clone()
            g = torch.Generator().manual_seed(zlib.crc32(f"{global_name(name, model)}/{step}".encode()))
            b = bits(full)
            b[torch.rand(b.numel(), generator=g) < rate] ^= 1
            if global_name(name, model) == dense:
                full.add_(0.05 * torch.randn(full.shape, generator=g).to(full.dtype))
            p.copy_(shard(full, name, dim, tp_rank, tp, gated=True))


def compare(picture: dict, ref: dict) -> list[str]:
    """Names whose tensors differ in names, shape, dtype or any bit."""
    if list(picture) != list(ref):
        return sorted(set(picture) ^ set(ref)) or ["(order)"]
    return [n for n, t in ref.items() if picture[n].dtype != t.dtype or picture[n].shape != t.shape
            or not torch.equal(bits(picture[n]), bits(t))]


def changed_hf(model, before: dict, after: dict) -> tuple[list[str], int]:
    """HF names of every Megatron tensor with a changed element, and the changed elements."""
    names, count = [], 0
    for m in WeightMapping.from_model(unwrap_model(model)).matches():
        diffs = [int((bits(before[n]) != bits(after[n])).sum()) for n in m.hf_names]
        count += sum(diffs)
        names += m.hf_names if any(diffs) else []
    return names, count


def stream(export: DeltaExport, model, receivers, **kw) -> tuple[dict, dict]:
    out = {n: t.clone() for n, t in export.stream(model, BUCKET, receivers, **kw)}
    return out, dict(export.stats)


def step_record(model, export, receivers, picture: dict, before: dict, **kw) -> tuple[dict, dict]:
    """One stream after a change: the receiver's updated picture against a fresh gather."""
    ref = gather(model, receivers)
    out, stats = stream(export, model, receivers, **kw)
    picture.update(out)
    rec = {"stats": stats, "yielded": list(out), "differs": compare(picture, ref) if ref else [],
           "dense_bytes": sum(t.numel() * t.element_size() for t in ref.values())}
    if ref:
        rec["expected_yield"], rec["expected_changed"] = changed_hf(model, before, ref)
        rec["expected_elements"] = sum(t.numel() for t in ref.values())
    return rec, ref


def layout_run(family: str, layout: dict, receivers: list[int]) -> dict:
    model = build(family, reinit(**layout), dtype="bfloat16")
    export = DeltaExport()
    ref = gather(model, receivers)
    picture, stats = stream(export, model, receivers)
    rec = {"receiver": rank() in receivers, "anchor": {"stats": stats, "differs": compare(picture, ref) if ref else [],
                                                       "yielded": len(picture)},
           "memory": delta_memory(model), "steps": []}
    for step in (1, 2, 3):
        flip(model, RATE, step, DENSE if step == 2 else None)
        r, ref = step_record(model, export, receivers, picture, ref)
        rec["steps"].append(r)
    rec["mismatch"] = corrupted_step(model, export, receivers, picture, ref)
    flip(model, RATE, 5)
    if rank() == 1:
        export.reset()
    rec["reset"], _ = step_record(model, export, receivers, picture, ref)
    return rec


def corrupted_step(model, export: DeltaExport, receivers, picture: dict, ref: dict) -> dict:
    """Flip one bit of the first receiver's mirror of its largest tensor, change the model, stream:
    that receiver alone raises; the stream after is an anchor everywhere and exact again."""
    if rank() == receivers[0]:
        name = max(export.mirror, key=lambda n: export.mirror[n].numel())
        bits(export.mirror[name])[7] ^= 1
    flip(model, RATE, 4)
    raised = ""
    try:
        stream(export, model, receivers)
    except DeltaMismatch as err:
        raised = str(err)
    dist.barrier()
    after, _ = step_record(model, export, receivers, picture, ref)
    return {"raised": raised, "after": after}


def float32_run() -> dict:
    """Every element of a float32 model changes: each tensor falls back to its dense shard."""
    model = build("qwen3", reinit(tp=2))
    export = DeltaExport()
    ref = gather(model, [0])
    picture, _ = stream(export, model, [0])
    flip(model, 1.0, 1)
    r, _ = step_record(model, export, [0], picture, ref)
    return r


def optimizer_run() -> dict:
    """One Adam step of a tied bf16 model on two data-parallel ranks (Megatron DDP, fp32 main params)."""
    par = reinit(1, 1)
    model = wrap_for_training(build("qwen2", par, dtype="bfloat16"), par)
    opt = OptimizerConfig(lr=1e-5, weight_decay=0.0)
    optimizer, _ = build_optimizer(model, opt, PerturbationConfig(), par, total_steps=4)
    export = DeltaExport(snapshot_device="cpu")
    ref = gather(model, [0])
    picture, _ = stream(export, model, [0])
    batch, pos = tokens(b=2, s=10, seed=rank()), torch.arange(10).unsqueeze(0).expand(2, -1)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = tensor_parallel.vocab_parallel_cross_entropy(model(batch, pos, None).float(), batch.roll(-1, 1)).mean()
    loss.backward()
    model.finish_grad_sync()
    assert optimizer.step()[0]
    r, _ = step_record(model, export, [0], picture, ref)
    return r


def lora_run() -> dict:
    """TP=2 with LoRA on every dense target: the merged W + s B A is what changes and travels."""
    model = build("qwen3", reinit(tp=2), lora=LoRAConfig(enabled=True, rank=4, alpha=8.0), dtype="bfloat16")
    export = DeltaExport()
    ref = gather(model, [1])
    picture, _ = stream(export, model, [1])
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_qkv_lora.B"):
                p.copy_(0.01 * torch.randn(p.shape, generator=g).to(p.dtype))
    r, _ = step_record(model, export, [1], picture, ref)
    return r


def main():
    results = {}
    for name, spec in LAYOUTS.items():
        results[f"{name}_rank{rank()}"] = layout_run(*spec)
    for name, run in {"float32": float32_run, "optimizer": optimizer_run, "lora": lora_run}.items():
        results[f"{name}_rank{rank()}"] = run()
    merged = [None] * dist.get_world_size()
    dist.all_gather_object(merged, results)
    if rank() == 0:
        json.dump({k: v for r in merged for k, v in r.items()}, open(sys.argv[1], "w"), indent=1)
    print("OK", flush=True)


main()
