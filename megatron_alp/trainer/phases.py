"""The trainer's phase changes: :class:`PhaseRunner` is the only way the trainer changes phase. It
moves Megatron's state and the engine's memory to what the phase table
(:data:`~megatron_alp.plan.phases.PHASES`) says, releasing before it allocates.

``trainer.phase_ledger`` writes what each rank really held at every phase entry (measured from the
storages, and on GPUs the memory in use and the trainer's peak) to ``RUN/phase_ledger/rank_<r>.jsonl``;
the offload windows then run on the CPU too, so a CPU run proves the trainer follows the table.
``timing/<phase>_s`` is a phase's wall time and ``memory/<phase>_peak_gib`` the trainer
allocator's peak during it (GPUs only).

At every phase entry the runner also reads what the engine really holds (its
:class:`~megatron_alp.rollout.engine_memory.EngineMemory`, whose books are kept on the CPU too) and
compares it with the table: a mismatch is an error under ``MEGATRON_ALP_STRICT_PHASES=1`` (the tests
set it) and one warning line otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Iterator, Optional

import torch

from megatron_alp.plan.phases import ENGINE_STATES, PHASES, PhaseSpec
from megatron_alp.runtime.console import say
from megatron_alp.runtime.platform import has_gpu
from megatron_alp.trainer.hang_watch import HangWatch
from megatron_alp.training.offload import KINDS, TrainingStateOffloader, offloader_for
from megatron_alp.training.policy_update import model_chunks

STRICT_ENV = "MEGATRON_ALP_STRICT_PHASES"  # "1": an engine holding other memory than its phase's is an error


@contextlib.contextmanager
def timed(metrics: dict, phase: str) -> Iterator[None]:
    """``metrics["timing/<phase>_s"]``: the wall time of the block."""
    t0 = time.time()
    yield
    metrics[f"timing/{phase}_s"] = time.time() - t0


@contextlib.contextmanager
def peak_memory(metrics: dict, phase: str) -> Iterator[None]:
    """``metrics["memory/<phase>_peak_gib"]``: the trainer allocator's peak during the block (GPUs)."""
    if has_gpu():
        torch.cuda.reset_peak_memory_stats()
    yield
    if has_gpu():
        metrics[f"memory/{phase}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30


def memory_in_use(phase: str) -> dict:
    """``memory/<phase>_used_gib``: the memory in use on the whole GPU now ({} on the CPU)."""
    if not has_gpu():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {f"memory/{phase}_used_gib": (total - free) / 2**30}


class PhaseRunner:
    """Moves Megatron's state and the engine's memory into each phase the trainer enters.

    ``offloader``: the kinds ``rollout.offload_*`` let leave the GPU (None: nothing moves);
    ``rollout``: the DistributedRollout, once it exists. Offload and reload statistics of the moves
    add up in :meth:`take_stats`.
    """

    def __init__(self, ledger: Optional[Path] = None, watch: Optional[HangWatch] = None):
        self.watch = watch  # trainer.hang_deadline_s: each entry is a heartbeat
        self.current: Optional[str] = None
        self.offloader: Optional[TrainingStateOffloader] = None
        self.measure: Optional[TrainingStateOffloader] = None  # reads residency when nothing is offloaded
        self.rollout = None
        self.iteration = 0
        self._stats: dict[str, float] = {}
        self._warned: set[str] = set()
        self._ledger = ledger
        if ledger is not None:
            ledger.parent.mkdir(parents=True, exist_ok=True)

    def attach(self, *, offloader: Optional[TrainingStateOffloader] = None,
               measure: Optional[TrainingStateOffloader] = None, rollout=None) -> None:
        if offloader is not None or measure is not None:
            self.offloader, self.measure = offloader, measure or offloader
        if rollout is not None:
            self.rollout = rollout

    def attach_learner(self, learner, rollout_cfg, on_cpu: bool) -> None:
        """Offload (where ``rollout.offload_*`` allow; ``on_cpu``: on the CPU too) and measure the
        learner's policy, optimizer and reference (when it is a model of its own)."""
        chunks = model_chunks(learner.policy)
        reference = [m for m in [learner.reference] if m not in (None, learner.policy)]
        self.attach(offloader=offloader_for(rollout_cfg, chunks, learner.optimizer, reference, on_cpu=on_cpu),
                    measure=TrainingStateOffloader(chunks, learner.optimizer, (), reference))

    def enter(self, name: str) -> None:
        """Become phase ``name``: release what it does not need (Megatron state first, then engine
        memory), empty the cache when an engine wakes, then bring back and wake what it needs."""
        spec = PHASES[name]
        if self._ledger is not None and self.current is not None:
            self._record_exit()
        engine = self.rollout if spec.engine != "none" else None  # the phases before the engine leave it be
        going_down = engine is not None and _engine_rank(spec.engine) < _engine_rank(engine.memory)
        if self.offloader is not None:
            self._add(self.offloader.offload([k for k in KINDS if k not in spec.megatron]))
        if going_down:
            engine.set_memory(spec.engine, resync=spec.resync)
        if spec.empties_cache and has_gpu():
            torch.cuda.empty_cache()
        if self.offloader is not None:
            self._add(self.offloader.reload(spec.megatron))
        if engine is not None:
            if not going_down:
                engine.set_memory(spec.engine, resync=spec.resync)
            self._check_engine(spec)
        self.current = name
        if self._ledger is not None:
            self._record_entry(spec)
        if self.watch is not None:
            self.watch.beat(name, self.iteration)

    @contextlib.contextmanager
    def within(self, name: str) -> Iterator[None]:
        """Phase ``name`` for the block, then back to the phase before it."""
        before = self.current
        self.enter(name)
        try:
            yield
        finally:
            if before is not None:
                self.enter(before)

    def _check_engine(self, spec: PhaseSpec) -> None:
        """The engine holds the memory of the phase (all of it where engines never sleep): a mismatch
        raises under ``MEGATRON_ALP_STRICT_PHASES=1``, else it is one warning line (once per mismatch)."""
        held = self.rollout.held_memory
        wanted = spec.engine if self.rollout.sleeps else "awake"
        if held is None or held == wanted:
            return
        problem = f"phase {spec.name}: the rollout engine's memory is {held!r}, the phase table wants {wanted!r}"
        if os.environ.get(STRICT_ENV) == "1":
            raise RuntimeError(problem)
        if problem not in self._warned:
            self._warned.add(problem)
            say(f"warning: {problem}")

    def take_stats(self) -> dict[str, float]:
        """``offload/*`` and ``reload/*`` of the moves since the last call, summed."""
        stats, self._stats = self._stats, {}
        return stats

    def _add(self, stats: dict[str, float]) -> None:
        for key, value in stats.items():
            self._stats[key] = self._stats.get(key, 0.0) + value

    # ------------------------------------------------------------------------------ the ledger

    def _record_entry(self, spec: PhaseSpec) -> None:
        row = self._holding({"phase": spec.name, "iteration": self.iteration, "at": "entry"})
        if has_gpu():
            torch.cuda.reset_peak_memory_stats()
        self._write(row)

    def _record_exit(self) -> None:
        row = self._holding({"phase": self.current, "iteration": self.iteration, "at": "exit"})
        if has_gpu():
            row["trainer_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self._write(row)

    def _holding(self, row: dict) -> dict:
        """What this rank holds now: Megatron's bytes per kind, the engine memory awake, the GPU in use."""
        row["megatron"] = self.measure.resident_bytes() if self.measure is not None else None
        row["engine"] = self.rollout.memory if self.rollout is not None else "none"
        row["engine_held"] = self.rollout.held_memory if self.rollout is not None else None
        if has_gpu():
            free, total = torch.cuda.mem_get_info()
            row["gpu_used_gib"] = (total - free) / 2**30
        return row

    def _write(self, row: dict) -> None:
        with open(self._ledger, "a") as f:
            f.write(json.dumps(row) + "\n")


def _engine_rank(state: str) -> int:
    return ENGINE_STATES.index(state)


def kill_engine_at_rollout(rollout, iteration: int) -> None:
    """Test hook: ``MEGATRON_ALP_KILL_ENGINE_AT_ROLLOUT=<iteration>`` SIGKILLs this rank's engine-core
    processes as that iteration's rollout starts, to prove a crashed engine is restarted and resynced
    in its own phase (``engine_restart_resync``) and the rollout goes on."""
    target = os.environ.get("MEGATRON_ALP_KILL_ENGINE_AT_ROLLOUT")
    if target and int(target) == iteration and rollout.engine is not None:
        for pid in rollout.engine.engine_pids():
            os.kill(pid, signal.SIGKILL)
