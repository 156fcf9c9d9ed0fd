"""Settings that would make a plan fit: single config changes aimed at the checks that failed, each
planned anew, else the fewest GPUs and least model parallelism on which some layout fits. A refusal
names only changes that were planned and fit."""

from __future__ import annotations

import itertools
import math
from typing import Optional

from megatron_alp.config import Config, ConfigError, apply_overrides
from megatron_alp.plan.estimates import GiB, fmt_gib
from megatron_alp.plan.peaks import count_peaks
from megatron_alp.plan.phases import PHASES, PhaseSpec
from megatron_alp.plan.report import MemoryPlan
from megatron_alp.resolve import config_from_dict

MAX_SEARCH_GPUS = 256  # the advice looks for layouts up to this many GPUs
Change = tuple[list[str], int]  # overrides, and the GPUs to plan them on


def advice(cfg: Config, gpus: int, gpu_mem_gib: float, hf: dict, source: str, plan: MemoryPlan,
           nproc_per_node: Optional[int] = None) -> tuple[str, ...]:
    """The lines of a refusal that say what to change: each single change that fits, with its peaks,
    else the smallest layout that does, else that none was found."""
    lines = []
    for overrides, n in _changes(cfg, gpus, plan):
        alt = _try(cfg, overrides, n, gpu_mem_gib, hf, source, nproc_per_node)
        if alt is not None and alt.fits:
            what = " ".join(overrides + ([f"--gpus {n}"] if n != gpus else []))
            lines.append(f"{what}  (fits: training {fmt_gib(alt.phase('training').total)} GiB, "
                         f"rollout {fmt_gib(alt.phase('rollout').total)} GiB)")
    if lines:
        return tuple(lines)
    found = _smallest_layout(cfg, gpus, gpu_mem_gib, hf, source, nproc_per_node)
    if found is None:
        return (f"no single change fits, and no layout of up to {MAX_SEARCH_GPUS} GPUs does (varying "
                "parallel.tensor_model_parallel_size, pipeline_model_parallel_size, rollout.tensor_parallel_size)",)
    return (f"no single change fits; the smallest layout that does: {found}",)


def _changes(cfg: Config, gpus: int, plan: MemoryPlan) -> list[Change]:
    """Single changes worth trying for the checks that failed, in order, each once."""
    util_min = math.ceil(100 * plan.engine_minimum / plan.gpu_mem_bytes) / 100
    out: list[Change] = []
    if "training" in plan.failing:
        out += _training_changes(cfg, gpus, plan)
    if "rollout" in plan.failing:
        out += _rollout_changes(cfg, gpus, plan, util_min)
    if "kv_cache" in plan.failing:
        out += _kv_cache_changes(cfg, gpus, util_min)
    table = [PHASES[name] for name in plan.failing if name in PHASES]
    if table:
        out += _table_changes(cfg, gpus, table, util_min)
    unique = []
    for change in out:
        if change not in unique:
            unique.append(change)
    return unique


def _offloads(cfg: Config, gpus: int) -> list[Change]:
    """Offloading each kind of Megatron state a colocated run keeps on the GPU."""
    r = cfg.rollout
    if r.placement != "colocated":
        return []
    return [([f"rollout.offload_{k}=true"], gpus) for k in ("weights", "grads", "optimizer")
            if not getattr(r, f"offload_{k}")]


def _wider(cfg: Config, gpus: int) -> list[Change]:
    """Twice the tensor parallelism (with sequence parallelism), or twice the pipeline stages."""
    p = cfg.parallel
    return [([f"parallel.tensor_model_parallel_size={2 * p.tensor_model_parallel_size}",
              "parallel.sequence_parallel=true"], gpus),
            ([f"parallel.pipeline_model_parallel_size={2 * p.pipeline_model_parallel_size}"], gpus)]


def _training_changes(cfg: Config, gpus: int, plan: MemoryPlan) -> list[Change]:
    p, m, t, r = cfg.parallel, cfg.model, cfg.trainer, cfg.rollout
    out: list[Change] = []
    training = plan.phase("training")
    logits = sum(i.nbytes for i in training.items if i.key == "logits")
    if not t.fused_linear_logprobs and logits >= GiB:
        out.append((["trainer.fused_linear_logprobs=true"], gpus))
    if m.recompute != "full":
        out.append((["model.recompute=full"], gpus))
    # a budget must hold the longest sequence the engine can produce (the config's validation)
    longest = r.max_model_len or r.sampling.max_prompt_length + r.sampling.max_response_length
    budget, lp = t.max_tokens_per_micro_batch, t.logprob_max_tokens_per_micro_batch
    if budget is not None:
        if max(longest, budget // 2) < budget:
            out.append(([f"trainer.max_tokens_per_micro_batch={max(longest, budget // 2)}"], gpus))
    elif t.micro_batch_size > 1:
        out.append(([f"trainer.micro_batch_size={t.micro_batch_size // 2}"], gpus))
    if "logprob pass" in training.title and lp is not None and max(longest, lp // 2) < lp:
        out.append(([f"trainer.logprob_max_tokens_per_micro_batch={max(longest, lp // 2)}"], gpus))
    if p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
        out.append((["parallel.sequence_parallel=true"], gpus))
    if not p.use_distributed_optimizer:
        out.append((["parallel.use_distributed_optimizer=true"], gpus))
    out += _wider(cfg, gpus)
    if p.expert_model_parallel_size > 1:
        out.append(([f"parallel.expert_model_parallel_size={2 * p.expert_model_parallel_size}"], gpus))
    if not r.free_memory_during_training and r.placement == "colocated":
        out.append((["rollout.free_memory_during_training=true"], gpus))
    return out + [([], 2 * gpus)]


def _rollout_changes(cfg: Config, gpus: int, plan: MemoryPlan, util_min: float) -> list[Change]:
    r = cfg.rollout
    out = _offloads(cfg, gpus)
    budget = int(r.gpu_memory_utilization * plan.gpu_mem_bytes)
    util_max = math.floor(100 * (plan.usable - plan.phase("rollout").total + budget) / plan.gpu_mem_bytes) / 100
    if util_min <= util_max < r.gpu_memory_utilization:
        out.append(([f"rollout.gpu_memory_utilization={util_max}"], gpus))
    if r.placement == "separate" and r.sync_bucket_mb > 1:
        out.append(([f"rollout.sync_bucket_mb={r.sync_bucket_mb // 2}"], gpus))
    return out


def _kv_cache_changes(cfg: Config, gpus: int, util_min: float) -> list[Change]:
    r = cfg.rollout
    out: list[Change] = []
    if util_min <= 1:
        out.append(([f"rollout.gpu_memory_utilization={util_min}"], gpus))
    out.append(([f"rollout.tensor_parallel_size={2 * r.tensor_parallel_size}"], gpus))
    if r.kv_cache_dtype != "fp8":
        out.append((["rollout.kv_cache_dtype=fp8"], gpus))
    if r.quantization == "none":
        out.append((["rollout.quantization=fp8"], gpus))
    return out


def _table_changes(cfg: Config, gpus: int, table: list[PhaseSpec], util_min: float) -> list[Change]:
    """For the failing phases of the table: less held beside them (offloads, a smaller bucket or
    engine budget, no verification probe), or the model spread wider."""
    r = cfg.rollout
    out = _offloads(cfg, gpus)
    if any(spec.work == "bucket" for spec in table) and r.sync_bucket_mb > 64:
        out.append(([f"rollout.sync_bucket_mb={r.sync_bucket_mb // 2}"], gpus))
    if any(spec.engine == "awake" for spec in table) and r.gpu_memory_utilization > util_min:
        out.append(([f"rollout.gpu_memory_utilization={max(util_min, round(r.gpu_memory_utilization - 0.1, 2))}"],
                    gpus))
    if any(spec.name == "sync_verification" for spec in table):
        out.append((["rollout.verify_sync=false"], gpus))
    return out + _wider(cfg, gpus) + [([], 2 * gpus)]


def _try(cfg: Config, overrides: list[str], gpus: int, gpu_mem_gib: float, hf: dict,
         source: str, nproc_per_node: Optional[int] = None) -> Optional[MemoryPlan]:
    """The plan of ``cfg`` changed by ``overrides`` on ``gpus`` GPUs; None for a layout that cannot run."""
    try:
        changed = config_from_dict(apply_overrides(cfg.model_dump(mode="json"), overrides), gpu=True)
        return count_peaks(changed, gpus, gpu_mem_gib, hf, source, nproc_per_node)
    except ConfigError:
        return None


def _smallest_layout(cfg: Config, gpus: int, gpu_mem_gib: float, hf: dict, source: str,
                     nproc_per_node: Optional[int] = None) -> Optional[str]:
    """The fewest GPUs (doubling from ``gpus``) on which some TP x PP (and rollout TP) fits, with the
    least model parallelism there, as the arguments that select it."""
    p, rtp = cfg.parallel, cfg.rollout.tensor_parallel_size
    n = gpus
    while n <= max(MAX_SEARCH_GPUS, gpus):
        best = None
        for tp, pp, engine_tp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16), (rtp, 2 * rtp, 4 * rtp, 8 * rtp)):
            if engine_tp > 8:
                continue
            overrides = [f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
                         f"parallel.sequence_parallel={str(tp > 1).lower()}",
                         f"rollout.tensor_parallel_size={engine_tp}"]
            alt = _try(cfg, overrides, n, gpu_mem_gib, hf, source, nproc_per_node)
            if alt is not None and alt.fits:
                rank = (tp * pp, engine_tp, alt.peak)
                if best is None or rank < best[0]:
                    best = (rank, overrides)
        if best is not None:
            same = {f"parallel.tensor_model_parallel_size={p.tensor_model_parallel_size}",
                    f"parallel.pipeline_model_parallel_size={p.pipeline_model_parallel_size}",
                    f"parallel.sequence_parallel={str(p.sequence_parallel).lower()}",
                    f"rollout.tensor_parallel_size={rtp}"}
            return " ".join([f"--gpus {n}"] + [o for o in best[1] if o not in same])
        n *= 2
    return None
