"""The phases of a run, and what each one holds on the GPU: one table for the trainer and the plan.

In a colocated GPU run Megatron and the engine take turns on the same GPUs. :data:`PHASES` says,
for every phase, which Megatron state it needs resident (the rest leaves the GPU where
``rollout.offload_<kind>`` allows), which engine memory it needs awake, what else it allocates,
the row of ``megatron-alp plan`` that counts it, and whether a config runs it at all
(:attr:`PhaseSpec.runs`). The trainer's :class:`~megatron_alp.trainer.phases.PhaseRunner` moves
state to what the table says; the memory plan counts the peak of every phase a config runs from
the same table, so a phase the trainer runs is a phase the plan checked.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from megatron_alp.config import Config
from megatron_alp.training.offload import KINDS

ENGINE_STATES = ("none", "asleep", "weights", "awake")  # no engine yet; all memory freed; weights only; all


def always(cfg: Config) -> Optional[str]:
    return None


def validates(cfg: Config) -> Optional[str]:
    return None if cfg.trainer.eval_interval else "trainer.eval_interval: 0"


def verifies_sync(cfg: Config) -> Optional[str]:
    return None if cfg.rollout.verify_sync else "rollout.verify_sync: false"


def probes_layers(cfg: Config) -> Optional[str]:
    """The one rule for the layer probe: calibrated sigma sized per layer (resolve requires
    ``init_std: auto`` with ``calibration_mode: per_layer`` or ``per_layer_added``)."""
    pert = cfg.perturbation
    return None if pert.init_std == "auto" and pert.calibration_mode != "global" else (
        "perturbation.calibration_mode: per_layer not set")


def warm_starts(cfg: Config) -> Optional[str]:
    if cfg.model.tiny is None:
        return "not a tiny model: model.tiny unset"
    return None if cfg.trainer.sft_warmup_steps else "trainer.sft_warmup_steps: 0"


@dataclasses.dataclass(frozen=True)
class PhaseSpec:
    name: str
    title: str
    megatron: tuple[str, ...]  # the Megatron state (of KINDS) it needs on the GPU; the reference goes with "weights"
    engine: str  # the engine memory it needs awake (ENGINE_STATES)
    work: str  # what else it allocates, for the plan: update, forward, bucket, probe, layer_probe, save, or nothing
    plan_row: str  # the row of `megatron-alp plan` that counts it
    # a weight sync comes before the engine generates again: an engine put to sleep here may drop weights
    # that sync re-sends instead of keeping a host copy (vLLM's sleep level 2; not with lora.sync: adapter)
    resync: bool = False
    runs: Callable[[Config], Optional[str]] = always  # None when a config runs the phase, else why it does not

    @property
    def empties_cache(self) -> bool:
        """The allocator's cached blocks go back to the driver before an engine wakes anything."""
        return self.engine in ("weights", "awake")


PHASES: dict[str, PhaseSpec] = {p.name: p for p in (
    PhaseSpec("warm_start", "warm start (tiny models, before Megatron and the engine exist)", (), "none", "",
              "warm_start", runs=warm_starts),
    PhaseSpec("model_build", "Megatron model, optimizer and reference built, a checkpoint loaded",
              KINDS, "none", "", "training"),
    PhaseSpec("engine_start", "engine start (claims its whole budget)", (), "awake", "", "rollout"),
    PhaseSpec("rollout", "rollout (engine awake)", (), "awake", "", "rollout"),
    PhaseSpec("engine_restart_resync", "engine restart + resync (a crashed engine mid-rollout)", ("weights",),
              "weights", "bucket", "engine_restart_resync"),
    PhaseSpec("layer_probe", "layer probe (perturbation.calibration_mode: per_layer: layer inputs on both sides)",
              ("weights",), "awake", "layer_probe", "layer_probe", runs=probes_layers),
    PhaseSpec("logprob", "old/reference logprob passes (and sigma calibration)", ("weights",), "asleep",
              "forward", "training", resync=True),
    PhaseSpec("policy_update", "policy update", KINDS, "asleep", "update", "training", resync=True),
    PhaseSpec("weight_sync", "weight sync (engine weights awake, no KV cache)", ("weights",), "weights",
              "bucket", "weight_sync"),
    PhaseSpec("sync_verification", "sync verification (rollout.verify_sync: probe on both sides)", ("weights",),
              "awake", "probe", "sync_verification", runs=verifies_sync),
    PhaseSpec("validation", "validation (engine awake)", (), "awake", "", "rollout", runs=validates),
    PhaseSpec("checkpoint_save", "checkpoint save", ("policy", "optimizer"), "asleep", "save", "checkpoint_save"),
)}
