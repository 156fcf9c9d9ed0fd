"""How responses are sampled: the engine's sampling parameters from the config, the per-sample
seeds, and the one function that turns prompts into trajectories, single- or multi-turn.

Every sampling path goes through here: training batches (synchronous and ahead-of-time), extra
dynamic-sampling rounds, validation, ``megatron-alp eval``, ``mismatch`` and ``intervene``.
:func:`sample` runs on an engine or on the trainer's collective
:class:`~megatron_alp.rollout.DistributedRollout` (every rank calls it; multi-turn code then runs
on rank 0 and its output is broadcast); :func:`share_work` is what one replica leader runs for its
share of a batch generated ahead (multi-turn episodes run whole on the leader, in its own sandbox).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

from megatron_alp.config import Config, EvalConfig, RolloutConfig, SamplingConfig, TIRConfig
from megatron_alp.data.trajectory import Trajectory
from megatron_alp.rollout.base import SamplingParams
from megatron_alp.runtime.platform import has_gpu
from megatron_alp.runtime.seeding import derive_seed
from megatron_alp.tir.multi_turn import run_episodes

# seed key of validation sampling, apart from every iteration's (seed, iteration) stream
VALIDATION_STREAM = -1


def seeds_samples(sampling: SamplingConfig) -> bool:
    """``rollout.sampling.per_sample_seeds``: by default on without a GPU (see the key's docs)."""
    return sampling.per_sample_seeds if sampling.per_sample_seeds is not None else not has_gpu()


def sample_seed(cfg: Config, *keys: int) -> Optional[int]:
    """The per-sample seed base of the stream ``keys`` of ``trainer.seed`` (None when unseeded)."""
    return derive_seed(cfg.trainer.seed, *keys) if seeds_samples(cfg.rollout.sampling) else None


def rollout_params(sampling: SamplingConfig, seed: Optional[int], **changes) -> SamplingParams:
    """``rollout.sampling`` as the engine applies it, with per-sample seed base ``seed``."""
    params = SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                            top_k=sampling.top_k, max_tokens=sampling.max_response_length, seed=seed)
    return replace(params, **changes)


def partial_cut(rollout: RolloutConfig) -> int:
    """The fixed cut of partial rollouts under the deterministic schedule: ``rollout.partial_cut_tokens``,
    by default half the response budget."""
    return rollout.partial_cut_tokens or max(1, rollout.sampling.max_response_length // 2)


def eval_params(ev: EvalConfig, max_tokens: int, seed: Optional[int] = None) -> SamplingParams:
    """``eval.k`` samples at ``eval.temperature`` and ``eval.top_p`` (validation and ``eval``)."""
    return SamplingParams(n=ev.k, temperature=ev.temperature, top_p=ev.top_p, max_tokens=max_tokens, seed=seed)


def sample(rollout, prompt_ids: list[list[int]], params: SamplingParams, tir: TIRConfig, tokenizer=None,
           executor=None, broadcast: Optional[Callable[[Any], Any]] = None) -> list[Trajectory]:
    """``params.n`` trajectories per prompt, grouped by prompt: single-turn completions, or with
    ``tir.enabled`` multi-turn episodes (:func:`~megatron_alp.tir.multi_turn.run_episodes`, which
    takes ``tokenizer``, ``executor`` and ``broadcast``). ``rollout`` is an engine or the trainer's
    collective :class:`~megatron_alp.rollout.DistributedRollout`."""
    if tir.enabled:
        return run_episodes(rollout, prompt_ids, tokenizer, params, tir, executor, broadcast=broadcast)
    groups = rollout.generate(prompt_ids, params)
    if len(groups) != len(prompt_ids) or any(len(g) != params.n for g in groups):
        raise RuntimeError(f"engine returned {[len(g) for g in groups]} completions for "
                           f"{len(prompt_ids)} prompts x n={params.n}")
    return [Trajectory.from_completion(c) for g in groups for c in g]


def share_work(params: SamplingParams, tir: TIRConfig, tokenizer, executor):
    """What a replica leader's producer runs for its share of a batch generated ahead
    (:class:`~megatron_alp.rollout.distributed.Work`): trajectories per prompt. Multi-turn episodes
    run whole on the leader, its code in the leader's own ``executor``, drawing from a stream of
    the share (seeded by its first prompt's index in the batch)."""
    n = params.n

    def work(engine, prompts, keys):
        if not tir.enabled:
            return [[Trajectory.from_completion(c) for c in g] for g in engine.generate(prompts, params, keys=keys)]
        seeded = params if params.seed is None else replace(params, seed=derive_seed(params.seed, keys[0]))
        episodes = run_episodes(engine, prompts, tokenizer, seeded, tir, executor)
        return [episodes[i * n:(i + 1) * n] for i in range(len(prompts))]

    return work
