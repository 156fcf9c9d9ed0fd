"""Validation during training: the current policy on ``data.val_files``, scored by the run's own
engine when the run shape says (every ``trainer.eval_interval`` iterations, after the last, and of
the base model with ``trainer.validate_base``), with the same sample seeds at every evaluation
(:class:`~megatron_alp.batches.evaluation.Validation`). Its engine moves and rollouts stay out of
the next iteration's ``offload/*`` and ``rollout/*`` metrics."""

from __future__ import annotations

import time

from megatron_alp.batches.evaluation import Validation
from megatron_alp.batches.sampling import VALIDATION_STREAM, sample_seed
from megatron_alp.config import Config
from megatron_alp.plan.shape import RunShape
from megatron_alp.runtime.console import say
from megatron_alp.trainer.phases import PhaseRunner


class Validator:
    def __init__(self, cfg: Config, shape: RunShape, phases: PhaseRunner, *, rollout, tokenizer, reward_fn,
                 executor, rank: int):
        self.cfg, self.shape, self.phases, self.rollout = cfg, shape, phases, rollout
        self.tokenizer, self.reward_fn, self.executor, self.rank = tokenizer, reward_fn, executor, rank
        self._validation = None  # the validation set, read at the first evaluation

    def due(self, done: int) -> bool:
        return self.shape.validates(done)

    def run(self) -> dict:
        """Collective: ``val/*`` metrics on rank 0 ({} elsewhere) and ``timing/val_s``."""
        if self._validation is None:
            self._validation = Validation(self.cfg, self.tokenizer, self.rollout.max_model_len,
                                          log=say if self.rank == 0 else lambda msg: None)
        t0 = time.time()
        self.phases.enter("validation")
        out = self._validation.run(self.rollout, seed=sample_seed(self.cfg, VALIDATION_STREAM),
                                   reward_fn=self.reward_fn, tokenizer=self.tokenizer, executor=self.executor)
        self.phases.take_stats()
        self.rollout.take_stats()
        out["timing/val_s"] = time.time() - t0
        return out
