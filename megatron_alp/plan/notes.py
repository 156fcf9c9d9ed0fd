"""The lines a memory plan prints under its table: the sequence and micro-batch it counted, how many
sequences the engine holds at once, and what the run keeps in host memory (the offloaded state,
sleeping engines' weights, routing replay's expert ids, a checkpoint save's staging)."""

from __future__ import annotations

import math

from megatron_alp.config import Config
from megatron_alp.plan.architecture import Architecture
from megatron_alp.plan.estimates import (
    EngineMemory, MicroBatchShape, checkpoint_save, fmt_gib, logprob_budget, megatron_state, stage_params)
from megatron_alp.plan.layout import Layout
from megatron_alp.plan.report import Phase


def offloaded_bytes(cfg: Config, arch: Architecture, lay: Layout, rollout: Phase) -> int:
    """Host memory per GPU for the Megatron state the rollout does not keep (gradients are dropped);
    nothing with ``placement: separate``."""
    if lay.separate:
        return 0
    kept = set(rollout.resident)
    return sum(i.nbytes for i in megatron_state(cfg, arch, lay, *stage_params(arch, lay)[0])
               if i.key not in kept and i.key != "grads")


def notes(cfg: Config, arch: Architecture, lay: Layout, engine: EngineMemory, offloaded: int) -> tuple[str, ...]:
    """The notes of the plan, after the table and its verdict."""
    t, seq = cfg.trainer, engine.seq
    responses = t.prompts_per_iteration * cfg.rollout.sampling.n
    micro_batch = MicroBatchShape.of(cfg, seq, t.max_tokens_per_micro_batch).describe
    if logprob_budget(cfg):
        micro_batch += f"; old/reference logprob passes {logprob_budget(cfg)} tokens (forward only)"
    kv = f"rollout: {engine.kv_per_token / 1024:.1f} KiB of KV cache per token: "
    return (
        f"sequence {seq} tokens (the engine context); micro-batch {micro_batch}",
        kv + f"{engine.kv_cache // engine.one_sequence} full-length sequences at once (an iteration samples "
        f"{responses}; the engine queues the rest)" if engine.kv_cache >= engine.one_sequence else
        kv + "no room for one full-length sequence beside the engine's weights and workspace (raise "
        "rollout.gpu_memory_utilization)",
        "nothing offloaded: Megatron's state stays on the trainer GPUs, each engine keeps its own GPU "
        "(rollout.placement: separate)" if lay.separate else
        f"host memory for the offloaded state: {fmt_gib(offloaded)} GiB per GPU",
    ) + _engine_host_note(cfg, lay, engine.weights) + _routing_note(cfg, arch, lay, responses, seq) + _save_note(
        cfg, arch, lay)


def _save_note(cfg: Config, arch: Architecture, lay: Layout) -> tuple[str, ...]:
    """The checkpoint save's host memory on the fullest stage (:func:`~megatron_alp.plan.estimates.checkpoint_save`)."""
    host = max(checkpoint_save(cfg, arch, lay, *stage).host for stage in stage_params(arch, lay))
    return (f"checkpoint save: {fmt_gib(host)} GiB of host memory on a data-parallel group's first rank (the "
            "optimizer state gathered, the weights staged for writing)",)


def _engine_host_note(cfg: Config, lay: Layout, engine_weights: int) -> tuple[str, ...]:
    """The host copy of a sleeping engine's weights (megatron_alp/rollout/engine_memory.py): vLLM's
    level-1 sleep offloads them to pinned host memory, needed only where a sync re-sends the adapters
    alone (``lora.sync: adapter``; else level 2 discards them); SGLang keeps a host copy
    (``--enable-weights-cpu-backup``) whenever it frees its memory."""
    r = cfg.rollout
    if lay.separate or not r.free_memory_during_training:
        return ()
    if r.engine == "sglang" or (cfg.lora.enabled and cfg.lora.sync == "adapter"):
        why = ("SGLang's --enable-weights-cpu-backup" if r.engine == "sglang" else
               "vLLM sleep level 1: lora.sync: adapter never re-sends the base")
        return (f"sleeping engines: {fmt_gib(engine_weights)} GiB of host memory per engine GPU for their weights "
                f"({why})",)
    return ("sleeping engines keep no weights in host memory (vLLM sleep level 2: every weight sync "
            "re-sends them)",)


def _routing_note(cfg: Config, arch: Architecture, lay: Layout, responses: int, seq: int) -> tuple[str, ...]:
    """Routing replay's host buffers on the fullest rank, ``[sequences, s, layers, k]`` in 1 byte per
    expert id up to 256 experts, else 2: the old-policy pass's experts of the rank's share (R2, and
    R3's update pass); under R3 also the engine's of the share, fetched and then laid out dense (two
    copies), and on a replica leader the engine's of its replica's responses, held there until the
    ranks that train them fetched them (:mod:`~megatron_alp.rollout.held_routing`)."""
    replay = cfg.moe.routing_replay
    if not arch.experts or replay == "none":
        return ()
    per_sequence = seq * arch.layers * arch.topk * (1 if arch.experts <= 256 else 2)
    share = responses // lay.dp
    host = share * per_sequence
    if replay == "r3":
        host += (2 * share + math.ceil(responses / lay.replicas)) * per_sequence
    return (f"routing replay ({replay}): {fmt_gib(host)} GiB of host memory per rank for the expert ids "
            "(the micro-batch's slice goes to the GPU)",)
