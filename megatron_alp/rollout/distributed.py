"""The rollout API the trainer calls collectively: engine replicas, results on every rank.

Placement (:mod:`megatron_alp.rollout.placement`): ``rollout.replicas`` engines, replica k
started by global rank ``k * world / replicas`` on its own GPUs or CPU cores, colocated with the
trainer ranks of its block. Every rank takes part in every call; results, statistics and errors
travel over a gloo group, so a failure raises the same error everywhere instead of leaving ranks
waiting.

- Generation: the prompts of a call are split over the replicas in whole groups (the ``n``
  samples of a prompt stay together), balanced by expected tokens (prompt length plus the mean
  response length seen so far), and the completions are gathered in prompt order on every rank,
  except their engine routing (MoE, R3): that stays with the leader that generated it until
  :meth:`fetch_routing` brings each rank the rows it trains (:mod:`~megatron_alp.rollout.held_routing`).
  With per-sample seeds (``SamplingParams.seed``, on by default on the CPU) a sample depends only
  on (seed, prompt index, sample index), so the rollouts are the same for any number of replicas.
- Failures: each engine retries and restarts itself (``rollout.max_retries``). A replica whose
  restart lost the synced weights asks for a resync: the trainer's weights are streamed again and
  only that replica's prompts are re-sent; the other replicas' results are kept. A replica whose
  engine fails (a RolloutError, a lost-weights restart) twice in a row, within a call or across
  calls, is retired: one warning line, its engine shut down, its unfinished groups re-split over
  the live replicas; later splits and weight syncs leave it out (its leader still takes part in
  the collectives). Every rank takes these decisions from the same gathered outcomes, so all agree
  on the live set. With per-sample seeds the rollouts do not change. Only when no replica is left
  is it a RolloutError naming the last one, on every rank; any other exception (a bug in the work
  of a share, not a fault of the engine) is raised as before, on every rank.
- Asynchronous generation (``background=True``, for ``trainer.max_staleness`` >= 1): each leader
  drives its engine from a :class:`~megatron_alp.rollout.producer.RolloutProducer` thread.
  :meth:`submit` splits a batch and queues each share on its replica without waiting;
  :meth:`collect` later gathers the results on every rank. Weight syncs wait until no job holds an
  engine (or pause it between decoding steps, with partial rollouts), so every result carries the
  one weight version it was generated with (:attr:`Batch.versions`).
- One-rank jobs run vLLM in process (it starts in seconds and weights arrive in memory);
  under torchrun each replica's vLLM runs in its engine-core subprocess (an in-process vLLM
  would adopt the trainer's default process group and wait for the other ranks). On GPUs a
  replica sleeps while Megatron trains when ``free_memory_during_training`` is set: KV cache freed,
  weights offloaded, or dropped when the next weight sync re-sends them all
  (:mod:`~megatron_alp.rollout.engine_memory`).

Weight sync streams :func:`megatron_alp.models.hf_weights.iter_hf_weights` (TP/PP/EP gathered in
``sync_bucket_mb`` buckets, ALP sigmas skipped) to the replica leaders only, who hand the buckets
to their engines (``rollout.sync_method``); the other ranks take part in the gathers and receive
nothing else. With ``verify_sync`` every replica samples a short probe that the Megatron model
scores; each must agree. A resync after an engine restart and the verification each run in their
own phase of the trainer's phase table (``phase``). A LoRA policy's weights go out merged
(``W + s B A``: the exporter merges them); with ``lora.sync: adapter`` the engines start with LoRA on
and :meth:`DistributedRollout.sync_weights` sends only the adapter's tensors, PEFT-named, the same way.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from megatron_alp.algorithms.balance import imbalance, partition
from megatron_alp.config import LoRAConfig, RolloutConfig
from megatron_alp.data.trajectory import Trajectory
from megatron_alp.models.families import load_hf_config
from megatron_alp.models.hf_weights import iter_hf_weights
from megatron_alp.models.lora_export import peft_adapter_config, peft_adapter_tensors
from megatron_alp.rollout.base import (
    LAYER_KINDS,
    Adapter,
    Completion,
    EngineRestarted,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    get_engine,
    resolve_max_model_len,
    tensor_pairs,
)
from megatron_alp.rollout.held_routing import fetch, hold
from megatron_alp.rollout.placement import Placement, ReplicaLayout, engine_placement, replica_layout
from megatron_alp.rollout.producer import RolloutProducer
from megatron_alp.rollout.weight_sync import WeightStream, default_verify_tolerance
from megatron_alp.runtime.comm import cpu_group
from megatron_alp.runtime.console import say
from megatron_alp.runtime.platform import has_gpu

# (model, probe trajectories) -> mismatch_stats of the engine's logprobs vs the model's, on every rank.
# The trainer supplies it (megatron_alp.training.policy_update.probe_mismatch): scoring is a training pass.
Scorer = Callable[[Any, list[Trajectory]], dict]


def build_engine(cfg: RolloutConfig, model_dir: str, seed: int, placement: Optional[Placement] = None,
                 lora_rank: Optional[int] = None) -> RolloutEngine:
    """The engine registered under ``cfg.engine`` (``vllm``, ``sglang``), started on ``model_dir``
    once it accepts ``cfg`` (:meth:`~megatron_alp.rollout.base.RolloutEngine.check_config`);
    ``lora_rank``: with LoRA on, for :meth:`~megatron_alp.rollout.base.RolloutEngine.update_adapter`."""
    engine = get_engine(cfg.engine)
    engine.check_config(cfg)
    if lora_rank is None:
        return engine(cfg, model_dir, seed, placement)
    if not engine.takes_adapters:
        raise ValueError(f"lora.sync: adapter with rollout.engine={cfg.engine}, which cannot apply LoRA adapters "
                         "itself; use lora.sync: merged")
    return engine(cfg, model_dir, seed, placement, lora_rank=lora_rank)


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


def _single(models):
    if isinstance(models, (list, tuple)):
        if len(models) != 1:
            raise ValueError(f"weight sync takes one model chunk per rank (got {len(models)}; virtual "
                             "pipeline stages are not supported)")
        return models[0]
    return models


class DistributedRollout:
    """Every trainer rank calls every method (collective); see the module docstring."""

    def __init__(self, cfg: RolloutConfig, model_dir: str, seed: int, scorer: Optional[Scorer] = None,
                 version: int = 0, background: bool = False,
                 phase: Callable[[str], ContextManager] = lambda name: contextlib.nullcontext(),
                 lora: Optional[LoRAConfig] = None):
        """``lora``: the run's adapters; with ``lora.sync: adapter`` the engines start with LoRA on and
        :meth:`sync_weights` sends the adapters only."""
        self.cfg = cfg
        self.adapter_sync = lora if lora is not None and lora.enabled and lora.sync == "adapter" else None
        lora_rank = self.adapter_sync.rank if self.adapter_sync is not None else None
        # the trainer's phase runner (megatron_alp/trainer/phases.py): a resync after an engine restart
        # and a sync verification each run in their own phase, with the memory the phase table gives them
        self.phase = phase
        self.memory = "awake"  # what of the colocated engines' memory is awake: asleep, weights or awake
        self.version = version  # the weight version the engines hold (trainer iterations)
        self.model_dir = str(model_dir)
        self.scorer = scorer
        self.multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.multi else 0
        world = dist.get_world_size() if self.multi else 1
        # CPU-side exchanges of Python objects, also on NCCL jobs. Ranks wait in them while the
        # replicas generate, retry and restart; the engines bound all of that themselves (attempt
        # timeouts that scale with the batch, retries), so the wait only ends a rank stuck elsewhere.
        self.group = cpu_group(timeout=timedelta(seconds=24 * 3600)) if self.multi else None
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        self.layout: ReplicaLayout = replica_layout(cfg, world, _data_parallel_size(world), has_gpu(), local_world)
        self.replica = self.layout.replica_of(self.rank)
        self.engine: Optional[RolloutEngine] = None
        self.producer: Optional[RolloutProducer] = None
        # separate placement on the CPU: this leader's engine cores, where its rollout-side work runs too
        self.engine_cores: Optional[tuple[int, ...]] = None
        self._models = None
        self._response_len: Optional[float] = None  # mean response length seen (balancing)
        self.live = list(range(self.layout.replicas))  # replicas not retired, the same on every rank
        self._failures = [0] * self.layout.replicas  # consecutive failures of each replica's engine
        self._stats = self._fresh_stats()
        error = None
        if self.replica is not None:
            try:
                local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
                placement = engine_placement(cfg, self.layout, self.rank, local_rank, local_world, has_gpu())
                self.engine = build_engine(cfg, model_dir, seed, placement, lora_rank=lora_rank)
                if cfg.placement == "separate" and placement is not None:
                    self.engine_cores = placement.cores
                if background:
                    self.producer = RolloutProducer(self.engine, version, partial_rollouts=cfg.partial_rollout,
                                                    cores=self.engine_cores)
            except Exception as err:
                error = err
        self._check(self._gather(_picklable(error)), error, "starting the rollout engine")

    @property
    def replicas(self) -> int:
        return self.layout.replicas

    # ---------------------------------------------------------------------------- plumbing

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank, over the rollout's CPU group (which tolerates the long
        waits of generation): e.g. the output of code that rank 0 ran for a multi-turn episode."""
        if not self.multi:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def _gather(self, obj: Any) -> list[Any]:
        """Each replica leader's ``obj``, indexed by replica, on every rank."""
        if not self.multi:
            return [obj]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, obj, group=self.group)
        return [everyone[self.layout.leader(k)] for k in range(self.replicas)]

    def _check(self, failures: list, own: Optional[BaseException], what: str) -> None:
        """Raise the first replica failure (an exception or a message, None for success) everywhere:
        the replica's own exception on its leader, a RolloutError naming the replica elsewhere."""
        failed = [(k, f) for k, f in enumerate(failures) if f is not None]
        if not failed:
            return
        if own is not None:
            raise own
        k, err = failed[0]
        detail = f"{type(err).__name__}: {err}" if isinstance(err, BaseException) else str(err)
        raise RolloutError(f"{what} failed on rollout replica {k} (rank {self.layout.leader(k)}): {detail}")

    def _run(self, work: Callable[[RolloutEngine], Any]) -> tuple[int, Any]:
        """``work(engine)`` on this leader's engine, through its producer when there is one:
        ``(weight version, result)``."""
        if self.producer is not None:
            return self.producer.run(work)
        return self.version, work(self.engine)

    @staticmethod
    def _outcome(call: Callable[[], Any]) -> tuple[tuple[str, Any], Optional[BaseException]]:
        """``("ok", result)``, ``("resync", why)``, ``("failed", RolloutError)`` (the engine failed)
        or ``("error", exception)`` (anything else), and the exception."""
        try:
            return ("ok", call()), None
        except EngineRestarted as err:
            return ("resync", str(err)), err
        except RolloutError as err:
            return ("failed", _picklable(err)), err
        except Exception as err:
            return ("error", _picklable(err)), err

    def _failed(self, k: int, why: Any, own: Optional[BaseException]) -> bool:
        """Count a failure of replica ``k`` (the same on every rank); at the second in a row retire it,
        and with no replica left raise a RolloutError naming it. Whether it was retired."""
        self._failures[k] += 1
        if self._failures[k] < 2:
            return False
        detail = f"{type(why).__name__}: {why}" if isinstance(why, BaseException) else str(why)
        self.live.remove(k)
        if self.replica == k:
            self._release()
        leader = self.layout.leader(k)
        if not self.live:
            raise RolloutError(f"rollout replica {k} (rank {leader}) failed twice in a row and no other replica "
                               f"is left: {detail}") from (own if self.replica == k else None)
        if self.rank == 0:
            say(f"rollout replica {k} (rank {leader}) failed twice in a row and is retired, "
                f"{len(self.live)} of {self.replicas} left: {detail}")
        return True

    def _on_replicas(self, work: Callable[[RolloutEngine], Any], which: set[int]
                     ) -> tuple[list[tuple[str, Any]], Optional[BaseException]]:
        """Run ``work(engine)`` on the replicas in ``which``. Returns every replica's ``(status,
        payload)`` on every rank ("ok" and ``(version, result)``, "resync" and why, "failed" or "error"
        and the exception, "skip") and this rank's own exception, if it raised one."""
        outcome: tuple[str, Any] = ("skip", None)
        own = None
        if self.replica in which:
            outcome, own = self._outcome(lambda: self._run(work))
        return self._gather(outcome), own

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

    def submit(self, prompts: list[list[int]], params: SamplingParams, work: Optional[Work] = None) -> Batch:
        """Split ``prompts`` over the replicas and, with background generation, queue each leader's
        share on its producer at once (collective: every rank calls it, in the same order). Without
        a producer the share runs in :meth:`collect`. ``work`` defaults to the plain generate call."""
        batch = Batch(prompts, params, work or generate_work(params), self.split(prompts, params))
        if self.producer is not None and self.replica is not None and batch.shares[self.replica]:
            batch.future = self.producer.submit(self._share_job(batch, batch.shares[self.replica]))
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
                outcome, own = self._outcome(pending.result if pending is not None else lambda: self._run(job))
                if self.multi and outcome[0] == "ok":
                    hold(outcome[1][1][1], self.rank)  # the engine routing stays here until fetch_routing
            pending = None
            outcomes = self._gather(outcome)
            self._check([payload if status == "error" else None for status, payload in outcomes],
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
                self._failures[k] = 0
                served = set(served)
                todo[k] = [i for i in todo[k] if i not in served]
                if not todo[k]:
                    del todo[k]
            resync = set()
            for k, status, payload in failed:
                if self._failed(k, payload, own):
                    reassign(todo.pop(k))
                elif status == "resync":
                    resync.add(k)
            if resync and self._models is None:
                k = min(resync)
                raise RolloutError(f"rollout replica {k} (rank {self.layout.leader(k)}) lost its weights before "
                                   f"any weight sync: {outcomes[k][1]}")
            if resync:
                with self.phase("engine_restart_resync"):
                    self.sync_weights(self._models, self.version)
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

    def sync_weights(self, models, version: Optional[int] = None) -> dict:
        """Stream the trainer's weights into every live replica, which then hold ``version`` (default:
        the current one: a resync); returns ``sync/*`` statistics. A leader whose producer is busy
        waits for it first (``sync/wait_s``): a sequence is never generated by two weight versions,
        except that a partial-rollout job pauses between decoding steps instead of finishing. A
        replica whose engine fails the update or the verification probe is synced again, or retired
        at its second failure in a row (a stream taken is no success: only a generation resets the count).
        With ``lora.sync: adapter`` only the adapters travel (:meth:`sync_adapter`)."""
        model = _single(models)
        lora = self.adapter_sync
        if lora is not None:
            stats = self.sync_adapter(
                models, lambda leaders: peft_adapter_tensors(model, self.cfg.sync_bucket_mb << 20, receivers=leaders),
                lambda names: peft_adapter_config(lora, names), version)
            self._models = models
            return stats
        stats = self._sync(model, version, "weight sync",
                           lambda leaders: iter_hf_weights(model, self.cfg.sync_bucket_mb << 20, receivers=leaders),
                           lambda engine, stream: engine.update_weights(stream))
        self._models = models
        return stats

    def sync_adapter(self, models, adapter: Callable[[list[int]], Adapter],
                     config: dict | Callable[[list[str]], dict], version: Optional[int] = None) -> dict:
        """``lora.sync: adapter``: the trainer's LoRA adapter into every live replica, as
        :meth:`sync_weights` does with full weights (waits, verification, retries, ``sync/*``
        statistics), each engine then generating with it
        (:meth:`~megatron_alp.rollout.base.RolloutEngine.update_adapter`). Every rank calls
        ``adapter(leaders)``: the PEFT-named tensors on the replica leaders listed (a collective export
        gathers them there, e.g. ``models.lora_export.peft_adapter_tensors(model, receivers=leaders)``),
        nothing needed elsewhere; ``config`` is PEFT's ``adapter_config.json`` or a function of the
        tensor names returning it (``lambda names: peft_adapter_config(cfg.lora, names)``).
        An engine restart keeps its adapter, so no resync ever streams it again."""
        return self._sync(_single(models), version, "adapter sync", adapter,
                          lambda engine, stream: engine.update_adapter(stream, config))

    def _sync(self, model, version: Optional[int], what: str, source: Callable[[list[int]], Adapter],
              feed: Callable[[RolloutEngine, WeightStream], None]) -> dict:
        """The loop of :meth:`sync_weights` around ``feed(engine, stream)`` of ``source(leaders)``."""
        version = self.version if version is None else version
        t0 = time.time()
        which = list(self.live)
        received = None  # what each engine of the first stream received, the same on every rank
        verified: dict = {}
        while which:
            waited, outcomes, own = self._stream(version, which, source, feed)
            failures = [failure for failure, _, _ in outcomes]
            self._check([f if not isinstance(f, RolloutError) else None for f in failures],
                        None if isinstance(own, RolloutError) else own, what)
            received = received or max((nbytes, tensors) for _, nbytes, tensors in outcomes)
            synced = [k for k in which if failures[k] is None]
            retry = [k for k in which if failures[k] is not None and not self._failed(k, failures[k], own)]
            if self.cfg.verify_sync and synced:
                with self.phase("sync_verification"):
                    probed = self.verify(model, synced)
                if probed and (not verified or probed["sync/verify_mean_abs_diff"] >
                               verified["sync/verify_mean_abs_diff"]):
                    verified = probed
                retry += [k for k in synced if k in self.live and self._failures[k]]  # its probe failed
            which = sorted(retry)
        self.version = version
        seconds = time.time() - t0 - waited
        nbytes, tensors = received
        return {"sync/seconds": seconds, "sync/wait_s": waited, "sync/bytes": float(nbytes),
                "sync/tensors": float(tensors), "sync/gbps": nbytes / max(seconds, 1e-9) / 1e9, **verified}

    def _stream(self, version: int, which: list[int], source: Callable[[list[int]], Adapter],
                feed: Callable[[RolloutEngine, WeightStream], None]) -> tuple[float, list, Optional[BaseException]]:
        """One stream of ``source(leaders)`` fed into the engines of the replicas in ``which`` (every
        rank takes part): the seconds waited for the producers, each replica's ``(error, bytes,
        tensors)``, and this rank's own error."""
        t0 = time.time()
        error = None
        feeds = self.replica in which and self.engine is not None
        with self.producer.updating(version) if feeds and self.producer is not None else contextlib.nullcontext():
            # every rank waits here, on the CPU group that tolerates long waits, until each leader's
            # engine is free: the weight gather below runs on the trainer's groups, whose timeouts would not
            self._gather(None)
            waited = time.time() - t0
            # only the leaders feed an engine: the other ranks help gather and receive no full tensor
            leaders = [self.layout.leader(k) for k in which]
            stream = WeightStream(tensor_pairs(source(leaders)))
            if feeds:
                try:
                    feed(self.engine, stream)
                except Exception as err:
                    error = err
            stream.drain()  # every rank reaches the end of the collective, even after an engine error
        return waited, self._gather((_picklable(error), stream.bytes, stream.tensors)), error

    def verify(self, model, which: Optional[list[int]] = None) -> dict:
        """Every live replica (or those in ``which``) samples a short probe; the Megatron model scores
        each (``scorer``): every engine must report the trainer's logprobs (within
        ``rollout.verify_tolerance``). A probe the engine fails counts as a failure of its replica
        (retired at the second in a row) and is left out of the statistics (empty when none ran)."""
        if self.scorer is None:
            raise RolloutError("rollout.verify_sync needs the trainer's scorer: DistributedRollout(..., scorer=...)")
        vocab = self._vocab_size()
        prompts = [[3 + (7 * i + 13 * k) % (vocab - 3) for k in range(8)] for i in range(4)]
        params = SamplingParams(n=2, temperature=1.0, max_tokens=16)
        which = list(self.live) if which is None else which
        outcomes, own = self._on_replicas(lambda engine: engine.generate(prompts, params), set(which))
        self._check([payload if status == "error" else None for status, payload in outcomes],
                    None if isinstance(own, RolloutError) else own, "the weight-sync probe")
        probed = []
        for k in which:
            if outcomes[k][0] == "ok":
                self._failures[k] = 0
                probed.append(k)
            else:
                self._failed(k, outcomes[k][1], own)
        trainer_dtype = next(model.parameters()).dtype
        tol = self.cfg.verify_tolerance or default_verify_tolerance(
            self.cfg.dtype, self.cfg.quantization, self.cfg.kv_cache_dtype, trainer_dtype)
        worst = None
        for k in probed:
            groups = outcomes[k][1][1]
            stats = self.scorer(model, [Trajectory.from_completion(c) for g in groups for c in g])
            if not stats["mean"] <= tol:
                raise RolloutError(
                    f"weight sync verification failed on rollout replica {k}: engine and trainer logprobs "
                    f"differ by mean {stats['mean']:.3e} (max {stats['max']:.3e}) over {stats['tokens']} probe "
                    f"tokens, above rollout.verify_tolerance={tol:g}; the engine does not hold the trainer's weights"
                )
            if worst is None or stats["mean"] > worst["mean"]:
                worst = stats
        if worst is None:
            return {}
        return {"sync/verify_mean_abs_diff": worst["mean"], "sync/verify_max_abs_diff": worst["max"]}

    @property
    def prober(self) -> int:
        """The rank whose engine shows its layers (:meth:`layer_states`): :func:`probe_leader`."""
        return probe_leader(self.layout, self.live)

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
                states = self._run(lambda engine: engine.layer_states(sequences, kinds))[1]
            except Exception as err:
                error = err
        failures: list = [None] * self.replicas
        failures[self.layout.replica_of(source)] = self.broadcast(_picklable(error), src=source)
        self._check(failures, error, "capturing the engine's layer states")
        return states

    def _vocab_size(self) -> int:
        return int(load_hf_config(self.model_dir)["vocab_size"])

    @property
    def max_model_len(self) -> int:
        """The engines' context length (prompt + response), known on every rank."""
        return resolve_max_model_len(self.cfg, load_hf_config(self.model_dir))

    # --------------------------------------------------------------------------- lifecycle

    @property
    def sleeps(self) -> bool:
        """Whether the engines give their memory back while Megatron trains: colocated engines with
        ``free_memory_during_training`` (the others stay awake)."""
        return self.cfg.placement == "colocated" and self.cfg.free_memory_during_training

    def set_memory(self, state: str, resync: bool = False) -> None:
        """Put the engines' memory in ``state`` where they sleep (:attr:`sleeps`): ``asleep`` (weights
        and KV cache freed while the trainer trains), ``weights`` (the weights awake for a sync, no KV
        cache) or ``awake``. ``resync``: a weight sync comes before the engines generate again
        (:meth:`~megatron_alp.rollout.engine_memory.EngineMemory.move`)."""
        state = state if self.sleeps else "awake"
        if self.engine is not None:
            self.engine.memory.move(state, resync=resync)
        self.memory = state

    @property
    def held_memory(self) -> Optional[str]:
        """What of this rank's engine memory is awake, read from the engine (None without an engine)."""
        return self.engine.memory.state if self.engine is not None else None

    def shutdown(self) -> None:
        self._release()

    def _release(self) -> None:
        """Shut this leader's engine and producer down (at the end, or when its replica is retired)."""
        if self.producer is not None:
            self.producer.close()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.producer is not None:
            self.producer.join(timeout=30)
            self.producer = None


def probe_leader(layout: ReplicaLayout, live: list[int]) -> int:
    """The rank that captures an engine's layer states: the leader of the first live replica (replica 0
    may have been retired)."""
    return layout.leader(min(live))


def _data_parallel_size(world: int) -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else world


def _picklable(error: Optional[BaseException]) -> Optional[BaseException]:
    """``error`` if it survives the gather's pickling, else a RolloutError with its type and message."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RolloutError(f"{type(error).__name__}: {error}")
