"""Batch sources: where each iteration's scored GRPO groups come from.

The trainer asks its source for :meth:`BatchSource.next_batch` and does not know how the batch was
made. :func:`build_batch_source` chooses the source once, from the config, as Megatron-Core picks a
pipeline schedule once and its caller only passes a forward step:

- :class:`OnPolicy` (``trainer.max_staleness: 0``): the iteration's prompts are drawn and generated
  now, with the weights of the latest sync, then scored.
- :class:`AheadByK` (``trainer.max_staleness: k``): the engines generate the batches of the next k
  iterations while the trainer trains; a batch is trained on only when the weights that generated
  it are at most k versions old (older groups are generated again), and a resumed run restarts the
  sampler before the oldest batch not yet trained on.
- :class:`DynamicSampling` (``trainer.dynamic_sampling``) wraps either: it keeps the groups with
  some but not all answers correct (or, with ``trainer.dynamic_sampling_filter: reward``, whose
  rewards differ) and fills the batch with extra on-policy rounds
  (:func:`~megatron_alp.algorithms.dynamic_sampling.fill_batch`).

Every source is collective: every rank draws the same prompts and gets the same trajectories and
scores. Each trajectory carries the weight version that generated it (``policy_version``). Sources
add their timings and counts to the ``stats`` dict they are given (``timing/rollout_s``,
``timing/reward_s``, ``rollout/response_tokens``, ...).
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any, Callable

from megatron_alp.algorithms.dynamic_sampling import Groups, fill_batch
from megatron_alp.batches.sampling import rollout_params, sample, sample_seed, share_work
from megatron_alp.batches.scoring import Scorer
from megatron_alp.config import Config
from megatron_alp.data.prompts import PromptSampler


class BatchSource(abc.ABC):
    """An iteration's scored groups, however they were made."""

    @abc.abstractmethod
    def next_batch(self, iteration: int, stats: dict) -> Groups:
        """The groups ``iteration`` trains on (collective)."""

    @abc.abstractmethod
    def resume_state(self) -> dict:
        """The prompt sampler's state where a run resumed from the next checkpoint restarts."""

    def state_dict(self) -> dict:
        return {"sampler": self.resume_state()}

    def load_state_dict(self, state: dict) -> None:
        """Before the first batch: draw on from where the checkpointed run's next batch was drawn."""
        self.sampler.load_state_dict(state["sampler"])


def _tally(stats: dict, key: str, value: float) -> None:
    stats[key] = stats.get(key, 0.0) + value


def _response_tokens(trajectories) -> float:
    return float(sum(len(t.response_ids) for t in trajectories))


class OnPolicy(BatchSource):
    """Prompts drawn, generated with the current weights and scored when they are asked for."""

    def __init__(self, cfg: Config, rollout, sampler: PromptSampler, scorer: Scorer, *, tokenizer, executor=None):
        self.cfg, self.rollout, self.sampler, self.scorer = cfg, rollout, sampler, scorer
        self.tokenizer, self.executor = tokenizer, executor

    def next_batch(self, iteration: int, stats: dict) -> Groups:
        return self.round(iteration, self.cfg.trainer.prompts_per_iteration, 0, stats)

    def round(self, iteration: int, prompts: int, round_: int, stats: dict) -> Groups:
        """``prompts`` new prompts generated now, sampled from the stream of (seed, iteration) or, for
        an extra dynamic-sampling round ``round_`` > 0, of (seed, iteration, round)."""
        chosen = self.sampler.next_batch(prompts)
        keys = (iteration, round_) if round_ else (iteration,)
        t0 = time.time()
        trajectories = sample(self.rollout, [p.prompt_ids for p in chosen],
                              rollout_params(self.cfg.rollout.sampling, sample_seed(self.cfg, *keys)),
                              self.cfg.tir, self.tokenizer, self.executor, broadcast=self.rollout.broadcast)
        for t in trajectories:
            t.policy_version = self.rollout.version
        t1 = time.time()
        rewards, correct = self.scorer(trajectories, chosen, self.rollout.broadcast)
        _tally(stats, "timing/rollout_s", t1 - t0)
        _tally(stats, "timing/reward_s", time.time() - t1)
        _tally(stats, "rollout/response_tokens", _response_tokens(trajectories))
        return Groups(chosen, trajectories, rewards, correct)

    def resume_state(self) -> dict:
        return self.sampler.state_dict()


@dataclass
class _Submitted:
    """A batch handed to the engines ahead of its iteration."""

    prompts: list
    sampler_state: dict  # the prompt sampler before these prompts were drawn: where a resume restarts
    batch: Any  # megatron_alp.rollout.distributed.Batch


class AheadByK(BatchSource):
    """Batches generated up to ``trainer.max_staleness`` iterations ahead by the engines' producers."""

    def __init__(self, cfg: Config, rollout, sampler: PromptSampler, scorer: Scorer, *, tokenizer, executor=None):
        self.cfg, self.rollout, self.sampler, self.scorer = cfg, rollout, sampler, scorer
        self.tokenizer, self.executor = tokenizer, executor
        self.max_staleness = cfg.trainer.max_staleness
        self._submitted: dict[int, _Submitted] = {}  # iteration -> its batch, generating ahead

    def _work(self, params):
        return share_work(params, self.cfg.tir, self.tokenizer, self.executor)

    def _params(self, iteration: int):
        return rollout_params(self.cfg.rollout.sampling, sample_seed(self.cfg, iteration))

    def _submit(self, iteration: int) -> None:
        """Draw the prompts of ``iteration`` and queue them on the engines (collective)."""
        state = self.sampler.state_dict()
        prompts = self.sampler.next_batch(self.cfg.trainer.prompts_per_iteration)
        params = self._params(iteration)
        batch = self.rollout.submit([p.prompt_ids for p in prompts], params, self._work(params))
        self._submitted[iteration] = _Submitted(prompts, state, batch)

    def next_batch(self, iteration: int, stats: dict) -> Groups:
        """This iteration's groups (generated ahead), after queueing the batches of the next
        ``max_staleness`` iterations. Groups generated by weights more than ``max_staleness``
        versions old are generated again now (a guard: the submission schedule keeps them fresh)."""
        last = min(iteration + self.max_staleness, self.cfg.trainer.iterations - 1)
        for j in range(iteration, last + 1):
            if j not in self._submitted:
                self._submit(j)
        submitted = self._submitted.pop(iteration)
        t0 = time.time()
        batch = self.rollout.collect(submitted.batch)
        stats["timing/rollout_wait_s"] = time.time() - t0
        _tally(stats, "timing/rollout_s", batch.seconds)
        stale = [i for i, v in enumerate(batch.versions) if iteration - v > self.max_staleness]
        if stale:
            params = self._params(iteration)
            again = self.rollout.collect(self.rollout.submit([batch.prompts[i] for i in stale], params,
                                                             self._work(params)))
            _tally(stats, "timing/rollout_s", again.seconds)
            for i, group, version in zip(stale, again.results, again.versions):
                batch.results[i], batch.versions[i] = group, version
        stats["staleness/regenerated_groups"] = float(len(stale))
        trajectories = []
        for group, version in zip(batch.results, batch.versions):
            for t in group:
                t.policy_version = version
                trajectories.append(t)
        t1 = time.time()
        rewards, correct = self.scorer(trajectories, submitted.prompts, self.rollout.broadcast)
        _tally(stats, "timing/reward_s", time.time() - t1)
        _tally(stats, "rollout/response_tokens", _response_tokens(trajectories))
        return Groups(submitted.prompts, trajectories, rewards, correct)

    def resume_state(self) -> dict:
        """Before the oldest batch not yet trained on: batches generating ahead are lost with a
        kill, and a resumed run draws and generates them again."""
        if self._submitted:
            return self._submitted[min(self._submitted)].sampler_state
        return self.sampler.state_dict()


class DynamicSampling(BatchSource):
    """DAPO dynamic sampling around another source: its batch, then extra on-policy rounds until
    ``trainer.prompts_per_iteration`` groups pass ``trainer.dynamic_sampling_filter``."""

    def __init__(self, cfg: Config, inner: BatchSource, rounds: OnPolicy):
        self.cfg, self.inner, self.rounds = cfg, inner, rounds

    def next_batch(self, iteration: int, stats: dict) -> Groups:
        t = self.cfg.trainer
        more: Callable[[int, int], Groups] = lambda k, r: self.rounds.round(iteration, k, r, stats)  # noqa: E731
        groups, counts = fill_batch(self.inner.next_batch(iteration, stats), more, wanted=t.prompts_per_iteration,
                                    n=self.cfg.rollout.sampling.n, max_rounds=t.dynamic_sampling_max_rounds,
                                    by=t.dynamic_sampling_filter)
        stats.update(counts)
        return groups

    def resume_state(self) -> dict:
        return self.inner.resume_state()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def build_batch_source(cfg: Config, rollout, sampler: PromptSampler, scorer: Scorer, *, tokenizer,
                       executor=None) -> BatchSource:
    """The source the config asks for: on-policy or ahead by ``trainer.max_staleness``, with
    ``trainer.dynamic_sampling`` around it."""
    on_policy = OnPolicy(cfg, rollout, sampler, scorer, tokenizer=tokenizer, executor=executor)
    source = on_policy
    if cfg.trainer.max_staleness:
        source = AheadByK(cfg, rollout, sampler, scorer, tokenizer=tokenizer, executor=executor)
    if cfg.trainer.dynamic_sampling:
        source = DynamicSampling(cfg, source, on_policy)
    return source
