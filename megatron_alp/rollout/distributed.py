"""Generation on the rollout replicas, called collectively by every trainer rank, results on every rank.

The replicas (layout, engines, live set, failures, collectives, memory) are a
:class:`~megatron_alp.rollout.replicas.ReplicaSet`; this adds what runs on them:

- Generation: the prompts of a call are split over the live replicas in whole groups (the ``n``
  samples of a prompt stay together), balanced by expected tokens (prompt length plus the mean
  response length seen so far), and the completions are gathered in prompt order on every rank,
  except their engine routing (MoE, R3): that stays with the leader that generated it until
  :meth:`fetch_routing` brings each rank the rows it trains (:mod:`~megatron_alp.rollout.held_routing`).
  With per-sample seeds (``SamplingParams.seed``, on by default on the CPU) a sample depends only
  on (seed, prompt index, sample index), so the rollouts are the same for any number of replicas.
- Failures: a replica whose restart lost the synced weights asks for a resync: the weight sync
  (:mod:`megatron_alp.sync`) hands in :attr:`DistributedRollout.resync`, and only that replica's
  prompts are re-sent; the other replicas' results are kept. A replica retired meanwhile has its
  unfinished groups re-split over the live replicas; with per-sample seeds the rollouts do not change.
  Any other exception (a bug in the work of a share, not a fault of the engine) is raised as before,
  on every rank.
- Asynchronous generation (``background=True``, for ``trainer.max_staleness`` >= 1): each leader
  drives its engine from a :class:`~megatron_alp.rollout.producer.RolloutProducer` thread.
  :meth:`submit` splits a batch and queues each share on its replica without waiting;
  :meth:`collect` later gathers the results on every rank. Weight syncs wait until no job holds an
  engine (or pause it between decoding steps, with partial rollouts), so every result carries the
  one weight version it was generated with (:attr:`Batch.versions`).
- One-rank jobs run vLLM in process (it starts in seconds and weights arrive in memory);
  under torchrun each replica's vLLM runs in its engine-core subprocess (an in-process vLLM
  would adopt the trainer's default process group and wait for the other ranks).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from megatron_alp.algorithms.balance import imbalance, partition
from megatron_alp.config import LoRAConfig, RolloutConfig
from megatron_alp.models.families import load_hf_config
from megatron_alp.rollout.base import LAYER_KINDS, Completion, RolloutEngine, RolloutError, SamplingParams, resolve_max_model_len
from megatron_alp.rollout.held_routing import fetch, hold
from megatron_alp.rollout.replicas import ReplicaSet, picklable


# (engine, prompts of one replica's share, their indices in the whole batch) -> one result per prompt
# (a group of Completions or Trajectories: anything with ``response_ids``).
Work = Callable[[RolloutEngine, list[list[int]], list[int]], list]


def generate_work(params: SamplingParams) -> Work:
    """The plain generate call: ``params.n`` completions per prompt, seeded by batch index."""
    return lambda engine, prompts, keys: engine.generate(prompts, params, keys=keys)


@dataclass
class Batch:
    """A submitted batch: its split over the replicas and, on leaders, the pending share."""

    prompts: list[list[int]]
    params: SamplingParams
    work: Work
    shares: list[list[int]]
    future: Optional[Future] = None  # this leader's share, queued on its producer
    results: list = field(default_factory=list)  # per prompt, once collected
    versions: list[int] = field(default_factory=list)  # weight version of each prompt's results
    seconds: float = 0.0  # generation time of the slowest replica's share


class DistributedRollout(ReplicaSet):
    """Generation over a :class:`~megatron_alp.rollout.replicas.ReplicaSet`; every trainer rank calls
    every method (collective). See the module docstring."""

    def __init__(self, cfg: RolloutConfig, model_dir: str, seed: int, version: int = 0, background: bool = False,
                 lora: Optional[LoRAConfig] = None):
        """``lora``: the run's adapters; with ``lora.sync: adapter`` the engines start with LoRA on."""
        adapter = lora is not None and lora.enabled and lora.sync == "adapter"
        super().__init__(cfg, model_dir, seed, version, background, lora_rank=lora.rank if adapter else None)
        # Set by the weight sync (megatron_alp.sync.WeightSync): brings the trainer's weights back into
        # the live replicas at the current version, after an engine restart lost them.
        self.resync: Optional[Callable[[], None]] = None
        self._response_len: Optional[float] = None  # mean response length seen (balancing)
        self._stats = self._fresh_stats()

    # ---------------------------------------------------------------------------- rollouts

    def split(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Prompt indices per replica (none for a retired one): whole groups, balanced by expected tokens."""
        return self._spread(prompts, params, list(range(len(prompts))))

    def _spread(self, prompts: list[list[int]], params: SamplingParams, indices: list[int]) -> list[list[int]]:
        """``indices`` of ``prompts`` split over the live replicas, indexed by replica."""
        expected = self._response_len if self._response_len is not None else params.max_tokens
        bins = partition([params.n * (len(prompts[i]) + expected) for i in indices], len(self.live))
        shares: list[list[int]] = [[] for _ in range(self.replicas)]
        for k, part in zip(self.live, bins):
            shares[k] = [indices[j] for j in part]
        return shares

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt, identical on every rank."""
        return self.collect(self.submit(prompts, params)).results

    def submit(self, prompts: list[list[int]], params: SamplingParams, work: Optional[Work] = None,
               version: Optional[int] = None, cut: Optional[int] = None) -> Batch:
        """Split ``prompts`` over the replicas and, with background generation, queue each leader's
        share on its producer at once (collective: every rank calls it, in the same order). Without
        a producer the share runs in :meth:`collect`. ``work`` defaults to the plain generate call;
        ``version`` and ``cut``: the weight version that must generate it and its fixed cut (the
        deterministic schedule; see :meth:`RolloutProducer.submit`)."""
        batch = Batch(prompts, params, work or generate_work(params), self.split(prompts, params))
        if self.producer is not None and self.replica is not None and batch.shares[self.replica]:
            batch.future = self.producer.submit(self._share_job(batch, batch.shares[self.replica]), version, cut)
        return batch

    def _share_job(self, batch: Batch, mine: list[int]) -> Callable[[RolloutEngine], Any]:
        def job(engine):
            t0 = time.time()
            results = batch.work(engine, [batch.prompts[i] for i in mine], mine)
            return mine, results, time.time() - t0

        return job

    def collect(self, batch: Batch) -> Batch:
        """Every replica's results of ``batch`` on every rank, in prompt order (``batch.results``,
        ``batch.versions``). A replica whose engine restarted without the synced weights is resynced
        and its prompts run again; a replica failing twice in a row is retired and its prompts go to
        the live ones (also the shares of replicas retired since :meth:`submit`)."""
        results: dict[int, Any] = {}
        versions: dict[int, int] = {}
        todo: dict[int, list[int]] = {}  # replica -> prompt indices still wanted from it

        def reassign(indices: list[int]) -> None:
            for k, share in enumerate(self._spread(batch.prompts, batch.params, indices)):
                if share:
                    todo[k] = sorted(todo.get(k, []) + share)

        for k, share in enumerate(batch.shares):
            if share and k in self.live:
                todo[k] = list(share)
        reassign([i for k, share in enumerate(batch.shares) if k not in self.live for i in share])
        pending = batch.future if self.replica in todo else None  # the submitted share, generating already
        while todo:
            outcome: tuple[str, Any] = ("skip", None)
            own = None
            if self.replica in todo:
                job = self._share_job(batch, todo[self.replica])
                outcome, own = self.outcome(pending.result if pending is not None else lambda: self.run(job))
                if self.multi and outcome[0] == "ok":
                    hold(outcome[1][1][1], self.rank)  # the engine routing stays here until fetch_routing
            pending = None
            outcomes = self.gather(outcome)
            self.check([payload if status == "error" else None for status, payload in outcomes],
                        own if outcome[0] == "error" else None, "generation")
            failed = []
            for k in sorted(todo):
                status, payload = outcomes[k]
                if status != "ok":
                    failed.append((k, status, payload))
                    continue
                version, (served, share, seconds) = payload
                results.update(zip(served, share))
                versions.update((i, version) for i in served)
                self._stats["tokens"][k] += sum(len(x.response_ids) for g in share for x in g)
                self._stats["seconds"][k] += seconds
                batch.seconds = max(batch.seconds, seconds)
                self.failures[k] = 0
                served = set(served)
                todo[k] = [i for i in todo[k] if i not in served]
                if not todo[k]:
                    del todo[k]
            resync = set()
            for k, status, payload in failed:
                if self.failed(k, payload, own):
                    reassign(todo.pop(k))
                elif status == "resync":
                    resync.add(k)
            if resync and self.resync is None:
                k = min(resync)
                raise RolloutError(f"rollout replica {k} (rank {self.layout.leader(k)}) lost its weights before "
                                   f"any weight sync: {outcomes[k][1]}")
            if resync:
                self.resync()
                for k in [k for k in todo if k not in self.live]:  # retired by the resync
                    reassign(todo.pop(k))
        batch.results = [results[i] for i in range(len(batch.prompts))]
        batch.versions = [versions[i] for i in range(len(batch.prompts))]
        lengths = [len(x.response_ids) for g in batch.results for x in g]
        if lengths:
            self._response_len = sum(lengths) / len(lengths)
        return batch

    def fetch_routing(self, items: list) -> None:
        """Collective: the engine routing of ``items`` (trajectories this rank trains), which the replica
        leaders kept back from the gathers of :meth:`collect` (:mod:`~megatron_alp.rollout.held_routing`),
        onto this rank, in place."""
        if self.multi:
            fetch(items, self.group)

    def take_stats(self) -> dict:
        """``rollout/*`` statistics of the generate calls since the last call: replicas, tokens/s of
        the slowest, mean and fastest replica, the straggler ratio (slowest / mean time over the
        live replicas) and the live (not retired) replicas."""
        stats, self._stats = self._stats, self._fresh_stats()
        busy = [k for k in range(self.replicas) if stats["seconds"][k] > 0]
        out = {"rollout/replicas": float(self.replicas), "rollout/replicas_live": float(len(self.live))}
        if busy:
            rates = [stats["tokens"][k] / stats["seconds"][k] for k in busy]
            out.update({
                "rollout/replica_tokens_per_s_min": min(rates),
                "rollout/replica_tokens_per_s_mean": sum(rates) / len(rates),
                "rollout/replica_tokens_per_s_max": max(rates),
                "rollout/straggler_ratio": imbalance([stats["seconds"][k] for k in self.live or busy]),
            })
        return out

    def _fresh_stats(self) -> dict:
        return {"tokens": [0] * self.replicas, "seconds": [0.0] * self.replicas}

    def layer_states(self, sequences: list[list[int]], kinds: tuple[str, ...] = LAYER_KINDS
                     ) -> Optional[list[dict[str, torch.Tensor]]]:
        """The first live replica's :meth:`RolloutEngine.layer_states` of ``sequences`` (only
        ``kinds``), on its leader (:attr:`prober`; None elsewhere: the states are ``[layers, tokens,
        hidden]`` per kind and sequence, too large to send around). Every rank calls it; a failure
        raises on every rank."""
        source = self.prober
        states, error = None, None
        if self.rank == source:
            try:
                states = self.run(lambda engine: engine.layer_states(sequences, kinds))[1]
            except Exception as err:
                error = err
        failures: list = [None] * self.replicas
        failures[self.layout.replica_of(source)] = self.broadcast(picklable(error), src=source)
        self.check(failures, error, "capturing the engine's layer states")
        return states

    def _vocab_size(self) -> int:
        return int(load_hf_config(self.model_dir)["vocab_size"])

    @property
    def max_model_len(self) -> int:
        """The engines' context length (prompt + response), known on every rank."""
        return resolve_max_model_len(self.cfg, load_hf_config(self.model_dir))
