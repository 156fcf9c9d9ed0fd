"""A run's checkpoints: when (the run shape's schedule), where (``RUN/checkpoints/iter_N``, the
newest ``trainer.keep_checkpoints`` kept), and what: the learner's model, optimizer and scheduler,
and the resume state of the run's stateful components (the trainer's progress, the learner's step
count, the batch source's prompt position), each a few keys of the checkpoint's ``extra``. A LoRA
run's checkpoints leave out the frozen base and record the run's base model folder and its
fingerprint instead (:mod:`megatron_alp.training.lora_base`), taken when the run starts, before the
base is loaded. A resume restores the same components from the newest intact checkpoint (one damaged
by a kill is skipped with a line saying why), a LoRA run's base from the run's base model folder,
refused if its weights are not the ones the checkpoint recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Protocol

import torch.distributed as dist

from megatron_alp.plan.shape import RunShape
from megatron_alp.runtime.console import say
from megatron_alp.trainer.hang_watch import watching
from megatron_alp.trainer.phases import PhaseRunner
from megatron_alp.trainer.run_dir import checkpoint_dir, kill_during_save, prune_checkpoints
from megatron_alp.training.dist_checkpoint import (
    EXTRA_FILE,
    current_layout,
    intact_checkpoint,
    load_checkpoint,
    read_metadata,
    relayout_line,
    save_checkpoint,
)
from megatron_alp.training.learner import Learner
from megatron_alp.training.lora_base import LoRABase


class Stateful(Protocol):
    """What a component saves in a checkpoint and takes back on resume: a few top-level keys."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Checkpointer:
    def __init__(self, run_dir: Path, shape: RunShape, *, keep: int, hf_dir: Path, lora: bool, phases: PhaseRunner,
                 rank: int):
        self.run_dir, self.shape, self.keep, self.hf_dir = run_dir, shape, keep, hf_dir
        self.phases, self.rank = phases, rank
        self.lora_base = LoRABase.of(hf_dir) if lora else None  # the frozen base, as the policy reads it
        # rank 0: the checkpoint with the most groups generated ahead (asynchronous runs; the run's summary)
        self.held_ahead: Optional[dict] = None

    def due(self, done: int) -> bool:
        """A checkpoint after ``done`` iterations (every ``trainer.save_interval`` and after the last)."""
        return self.shape.saves(done)

    def latest(self) -> Optional[Path]:
        """Collective: the run's newest intact checkpoint, or None."""
        return intact_checkpoint(self.run_dir, log=say if self.rank == 0 else lambda line: None)

    def load(self, ckpt: Path, learner: Learner, perturbed: bool) -> dict:
        """The learner's weights (a LoRA run's frozen base from the run's base model folder), optimizer
        and scheduler from ``ckpt``; returns the components' state (:meth:`restore` gives it to them
        once they exist)."""
        extra = load_checkpoint(ckpt, learner.module, optimizer=learner.optimizer,
                                opt_param_scheduler=learner.scheduler, base_dir=self.hf_dir)
        line = relayout_line(ckpt, read_metadata(ckpt).get("layout", {}), current_layout(learner.optimizer),
                             perturbed=perturbed)
        if line and self.rank == 0:
            say(line)
        return extra

    @staticmethod
    def restore(state: dict, components: Iterable[Stateful]) -> None:
        for component in components:
            component.load_state_dict(state)

    def save(self, iteration: int, learner: Learner, components: Iterable[Stateful]) -> None:
        """Collective: checkpoint ``iteration`` (atomic: a kill leaves the previous one intact)."""
        self.phases.enter("checkpoint_save")
        extra: dict = {}
        for component in components:
            state = component.state_dict()
            if set(state) & set(extra):
                raise RuntimeError(f"two components save the checkpoint keys {sorted(set(state) & set(extra))}")
            extra.update(state)
        where = checkpoint_dir(self.run_dir, iteration)
        with watching(self.phases.watch, saving=where):
            save_checkpoint(where, learner.module, optimizer=learner.optimizer, opt_param_scheduler=learner.scheduler,
                            extra=extra, hf_dir=self.hf_dir, lora_base=self.lora_base, before_commit=kill_during_save)
        if self.rank == 0:
            if extra.get("ahead_groups", 0) > (self.held_ahead or {}).get("groups", 0):
                self.held_ahead = {"groups": extra["ahead_groups"], "versions": extra["ahead_versions"],
                                   "bytes": (where / EXTRA_FILE).stat().st_size, "checkpoint": where.name}
            prune_checkpoints(self.run_dir, self.keep, upto=iteration)
        dist.barrier()
