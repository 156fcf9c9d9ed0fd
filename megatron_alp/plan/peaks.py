"""The peak of every phase of a run on its fullest GPU, and which of them do not fit.

The phases are those of the phase table (megatron_alp/plan/phases.py: what each phase keeps of
Megatron's state and of the engine's memory), and any of them can run out:

- **training**, the policy update (or the forward-only old/reference logprob passes, when a
  larger logprob token budget makes them the fuller), counted on the fullest pipeline stage;
- **rollout** (with the engine start and validation, which hold the same), the engines awake,
  counted on the fullest GPU that holds one (:mod:`~megatron_alp.plan.layout` places them). vLLM
  needs ``gpu_memory_utilization x total`` free when it starts and at every wake-up, so what
  ``rollout.offload_*`` leave of Megatron's state plus that budget must fit;
- **weight sync** and **engine restart + resync**: Megatron's weights, the gathered bucket (and a
  leader's copy of it for the engine), the engine's weights awake without its KV cache;
- **sync verification**: Megatron's weights and a probe's forward pass beside the awake engine;
- **layer probe** (``perturbation.calibration_mode: per_layer`` or ``per_layer_added``): Megatron's
  weights and a plain forward of one probe sequence (full logits) beside the awake engine;
- **checkpoint save**: the policy's weights and optimizer state (the reference stays offloaded), the
  engine asleep, and what the save allocates on the GPU: nothing with the distributed optimizer's
  state gathered over gloo on the host (``save_transient`` of megatron_alp/training/dist_checkpoint.py,
  which the save's format and this count share; its host memory is a note of the plan).

With ``rollout.placement: separate`` nothing is offloaded and no engine sleeps, so:

- **training** is counted on a trainer GPU, as above but with no engine beside it;
- **rollout** on an engine GPU: the engine's ``gpu_memory_utilization`` x the whole GPU (its
  weights, workspace and KV cache; a GPU of its own can give it 0.9) plus one weight-sync bucket
  of ``rollout.sync_bucket_mb``, which arrives after vLLM has sized its KV cache, outside that
  budget. The trainer GPUs are taken to be the same kind as the engine GPUs.

What each phase holds is counted by :mod:`~megatron_alp.plan.estimates`.
"""

from __future__ import annotations

import math
from typing import Optional

from megatron_alp.config import Config, ConfigError
from megatron_alp.plan.architecture import Architecture
from megatron_alp.plan.estimates import (
    DTYPE_BYTES, ENGINE_ASLEEP_BYTES, ENGINE_WORKSPACE_BYTES, PROBE_TOKENS, RUNTIME, EngineMemory, GiB, Item,
    MicroBatchShape, activations, checkpoint_save, fmt_gib, forward_activations, logprob_budget, megatron_state,
    output, stage_params, sync_bucket)
from megatron_alp.plan.layout import Layout
from megatron_alp.plan.notes import notes, offloaded_bytes
from megatron_alp.plan.phases import PHASES, PhaseSpec
from megatron_alp.plan.report import HEADROOM, MemoryPlan, Phase
from megatron_alp.plan.shape import RunShape
from megatron_alp.rollout.base import resolve_max_model_len
from megatron_alp.training.calibration import LAYER_PROBE_TOKENS
from megatron_alp.training.offload import parts_of

# the rows of the plan, in the order a run meets them (each phase of the table counts in its PhaseSpec.plan_row)
PLAN_ROWS = ("warm_start", "rollout", "engine_restart_resync", "training", "weight_sync", "sync_verification",
             "layer_probe", "checkpoint_save")
# an item of Megatron's state -> the rollout.offload_<kind> that moves it, and its part (training/offload.py parts_of)
OFFLOAD_KIND = {"weights": "weights", "reference": "weights", "grads": "grads", "optimizer": "optimizer"}
PART = {"weights": "policy", "reference": "reference", "grads": "grads", "optimizer": "optimizer"}


def count_peaks(cfg: Config, gpus: int, gpu_mem_gib: float, hf: dict, source: str,
                nproc_per_node: Optional[int] = None) -> MemoryPlan:
    """The plan of ``cfg`` on ``gpus`` GPUs of ``gpu_mem_gib`` GiB for the model of HF config ``hf``
    (found at ``source``), without advice; a layout that cannot run is a ConfigError."""
    arch = Architecture.from_hf(hf)
    lay = Layout.of(cfg, gpus, nproc_per_node)
    lay.check(arch)
    _check_batch_split(cfg, lay)
    total = int(gpu_mem_gib * GiB)
    usable = int(total * (1 - HEADROOM))
    engine = EngineMemory.of(cfg, arch, lay, gpu_mem_gib, resolve_max_model_len(cfg.rollout, hf))
    training = _training(cfg, arch, lay, engine)
    rollout = _separate_rollout(cfg, engine) if lay.separate else _rollout(cfg, arch, lay, engine)
    rows = {"training": training, "rollout": rollout, **_table_rows(cfg, arch, lay, engine)}
    failures = _training_rollout_failures(cfg, lay, engine, training, rollout, usable, gpu_mem_gib) + [
        (phase.name, _over(phase, usable)) for key, phase in rows.items()
        if key not in ("training", "rollout") and phase.total > usable]
    offloaded = offloaded_bytes(cfg, arch, lay, rollout)
    engine_minimum = engine.weights + ENGINE_WORKSPACE_BYTES + engine.one_sequence
    return MemoryPlan(source, lay.describe(bool(arch.experts)), gpus, total, tuple(rows[name] for name in PLAN_ROWS),
                      offloaded, notes(cfg, arch, lay, engine, offloaded), tuple(p for _, p in failures),
                      tuple(name for name, _ in failures), engine_minimum, engine_gpus=lay.engine_gpu_count)


def _check_batch_split(cfg: Config, lay: Layout) -> None:
    t = cfg.trainer
    responses = t.prompts_per_iteration * cfg.rollout.sampling.n
    if responses % (lay.dp * t.updates_per_iteration):
        raise ConfigError(
            f"trainer.prompts_per_iteration x rollout.sampling.n = {responses} responses do not split evenly into "
            f"data-parallel size {lay.dp} x trainer.updates_per_iteration {t.updates_per_iteration}")


def _over(phase: Phase, usable: int) -> str:
    return f"{phase.title} needs {fmt_gib(phase.total)} GiB on {phase.where}, over the {fmt_gib(usable)} GiB usable"


def _training_rollout_failures(cfg: Config, lay: Layout, engine: EngineMemory, training: Phase, rollout: Phase,
                               usable: int, gpu_mem_gib: float) -> list[tuple[str, str]]:
    """The checks of training and rollout that fail, and the KV cache's: (check, problem)."""
    r = cfg.rollout
    failures = [("training", _over(training, usable))] if training.total > usable else []
    if rollout.total > usable and lay.separate:
        failures.append(("rollout", f"{rollout.title}: the engine's budget rollout.gpu_memory_utilization "
                         f"{r.gpu_memory_utilization} x {gpu_mem_gib:g} GiB plus the weight-sync bucket "
                         f"(rollout.sync_bucket_mb) make {fmt_gib(rollout.total)} GiB, over the {fmt_gib(usable)} "
                         "GiB usable"))
    elif rollout.total > usable:
        held = max(engine.budget, engine.weights + ENGINE_WORKSPACE_BYTES)
        failures.append(("rollout", f"{rollout.title}: what stays of Megatron on {rollout.where} "
                         f"({fmt_gib(rollout.total - held)} GiB with the runtime) plus the engine's {fmt_gib(held)} "
                         f"GiB make {fmt_gib(rollout.total)} GiB, over the {fmt_gib(usable)} GiB usable (vLLM needs "
                         "rollout.gpu_memory_utilization x the GPU free when it starts and at every wake-up)"))
    if engine.kv_cache < engine.one_sequence:
        failures.append(("kv_cache", f"the engine's KV cache ({fmt_gib(max(engine.kv_cache, 0))} GiB after weights "
                         f"and workspace) cannot hold one sequence of {engine.seq} tokens "
                         f"({fmt_gib(engine.one_sequence)} GiB): vLLM refuses to start"))
    return failures


def _training(cfg: Config, arch: Architecture, lay: Layout, engine: EngineMemory) -> Phase:
    """The policy update, or the forward-only logprob passes where they are the fuller, on the
    fullest pipeline stage."""
    t, r, seq = cfg.trainer, cfg.rollout, engine.seq
    update = MicroBatchShape.of(cfg, seq, t.max_tokens_per_micro_batch)
    logprob = MicroBatchShape.of(cfg, seq, logprob_budget(cfg))
    per_rank = t.prompts_per_iteration * r.sampling.n / (t.updates_per_iteration * lay.dp)
    if t.max_tokens_per_micro_batch:  # worst case: every sequence full length
        micro_batches = max(1, math.ceil(per_rank * seq / t.max_tokens_per_micro_batch))
    else:
        micro_batches = max(1, math.ceil(per_rank / t.micro_batch_size))
    stages = stage_params(arch, lay)
    phases = []
    for index, (dense, expert) in enumerate(stages):
        first, last = index == 0, index == len(stages) - 1
        state = megatron_state(cfg, arch, lay, dense, expert)
        fixed = [RUNTIME]
        if lay.engine_on_stage(first):
            asleep = r.free_memory_during_training
            fixed.append(Item("engine", "rollout engine " + ("asleep" if asleep else "awake"),
                              ENGINE_ASLEEP_BYTES if asleep else engine.budget,
                              "fixed allowance" if asleep else "rollout.free_memory_during_training: false"))
        passes = [
            ("training (policy update)",
             [activations(cfg, arch, lay, update, min(lay.pp, micro_batches) if first else 1)]
             + (output(cfg, arch, lay, update.tokens, backward=True) if last else [])),
            ("training (old/reference logprob pass)",
             [forward_activations(cfg, arch, lay, logprob)]
             + (output(cfg, arch, lay, logprob.tokens, backward=False) if last else [])),
        ]
        phases += [Phase("training", title, lay.stage_name(first), tuple(state + held + fixed))
                   for title, held in passes]
    return max(phases, key=lambda p: p.total)  # the first of equals: the update


def _rollout(cfg: Config, arch: Architecture, lay: Layout, engine: EngineMemory) -> Phase:
    """The engine awake beside what ``rollout.offload_*`` leave of Megatron's state, on the fullest
    pipeline stage that has an engine GPU."""
    r = cfg.rollout
    stages = stage_params(arch, lay)  # the first stage's parameters, and the last's (PP > 1)
    held = [stages[0 if s == 0 else -1] for s in lay.stages_with_engine()]
    items = []
    for item in megatron_state(cfg, arch, lay, *max(held, key=sum)):
        key = OFFLOAD_KIND[item.key]
        off = getattr(r, f"offload_{key}")
        how = "released" if key == "grads" else "offloaded"  # gradients are zeroed before every update anyway
        items.append(Item(item.key, item.label, 0, f"{how} (rollout.offload_{key})") if off else item)
    return Phase("rollout", "rollout, engine start, validation (engine awake)", f"engine {lay.engine_gpus}",
                 tuple(items + [RUNTIME] + engine.awake()))


def _separate_rollout(cfg: Config, engine: EngineMemory) -> Phase:
    """An engine GPU of ``placement: separate``: the engine's budget, and a weight-sync bucket that
    arrives after vLLM has sized its KV cache (outside the budget). No trainer process is on it."""
    bucket = Item("sync_bucket", "weight-sync bucket", cfg.rollout.sync_bucket_mb << 20,
                  "rollout.sync_bucket_mb, outside the engine's budget")
    return Phase("rollout", "rollout (engine on a GPU of its own)", "an engine GPU", (*engine.awake(), bucket))


def _table_rows(cfg: Config, arch: Architecture, lay: Layout, engine: EngineMemory) -> dict[str, Phase]:
    """The rows besides training and rollout, each counted as the first phase of the table that
    falls in it; a phase the config never runs holds nothing."""
    rows: dict[str, Phase] = {}
    shape = RunShape.of(cfg)
    for spec in PHASES.values():
        if spec.plan_row in ("training", "rollout") or spec.plan_row in rows:
            continue
        why = shape.skipped.get(spec.name)
        rows[spec.plan_row] = (Phase(spec.name, spec.title, "", (), not_run=why) if why else
                               _table_phase(cfg, arch, lay, spec, engine))
    return rows


def _table_phase(cfg: Config, arch: Architecture, lay: Layout, spec: PhaseSpec, engine: EngineMemory) -> Phase:
    """A phase of the table (megatron_alp/plan/phases.py) on its fullest GPU: the Megatron state it
    needs (the rest offloaded where ``rollout.offload_*`` allow), what it allocates, and the engine
    memory it keeps awake on a GPU that holds an engine."""
    r = cfg.rollout
    moves = r.placement == "colocated" and r.free_memory_during_training
    needed = parts_of(spec.megatron)
    candidates = []
    stages = stage_params(arch, lay)
    for index, (dense, expert) in enumerate(stages):
        first, last = index == 0, index == len(stages) - 1
        items = []
        if spec.name != "warm_start":
            for item in megatron_state(cfg, arch, lay, dense, expert):
                kind = OFFLOAD_KIND.get(item.key)  # None: stays where it is (the delta-sync snapshot)
                if kind is not None and PART[item.key] not in needed and moves and getattr(r, f"offload_{kind}"):
                    how = "released" if kind == "grads" else "offloaded"
                    item = Item(item.key, item.label, 0, f"{how} (rollout.offload_{kind}; not needed here)")
                items.append(item)
        items += _work(cfg, arch, lay, spec, dense, expert, first, last)
        items.append(RUNTIME)
        if lay.engine_on_stage(first) and spec.engine != "none":
            items += engine.in_state(cfg, spec.engine)
        candidates.append(Phase(spec.name, spec.title, lay.stage_name(first), tuple(items)))
    return max(candidates, key=lambda p: p.total)


def _work(cfg: Config, arch: Architecture, lay: Layout, spec: PhaseSpec, dense: int, expert: int, first: bool,
          last: bool) -> list[Item]:
    """What phase ``spec`` allocates on a rank of the first or the last stage besides the state it holds."""
    if spec.work == "save":
        saving = checkpoint_save(cfg, arch, lay, dense, expert)
        return [Item("save_transient", "optimizer state gathered for the save", saving.gpu, saving.basis)]
    if spec.work == "bucket":
        return [sync_bucket(cfg, arch, leader=lay.engine_on_stage(first) and cfg.rollout.sync_method != "broadcast")]
    if spec.work == "probe":
        probe = MicroBatchShape(PROBE_TOKENS, PROBE_TOKENS * 24, "probe")
        return [forward_activations(cfg, arch, lay, probe)] + (
            output(cfg, arch, lay, PROBE_TOKENS, backward=False) if last else [])
    if spec.work == "layer_probe":  # one sequence at a time, a plain forward: full logits
        n, b = LAYER_PROBE_TOKENS, DTYPE_BYTES[cfg.model.dtype]
        shape = MicroBatchShape(n, n * n, f"{n} tokens (layer probe)")
        return [forward_activations(cfg, arch, lay, shape)] + (
            [Item("logits", f"logits ({cfg.model.dtype})", n * (arch.vocab // lay.tp) * b,
                  f"{n} tok x {arch.vocab // lay.tp} vocab/TP x {b} B")] if last else [])
    return []
