"""The rollout API the trainer calls collectively: engine replicas, results on every rank.

Placement (:mod:`megatron_alp.rollout.placement`): ``rollout.replicas`` engines, replica k
started by global rank ``k * world / replicas`` on its own GPUs or CPU cores, colocated with the
trainer ranks of its block. Every rank takes part in every call; results, statistics and errors
travel over a gloo group, so a failure raises the same error everywhere instead of leaving ranks
waiting.

- Generation: the prompts of a call are split over the replicas in whole groups (the ``n``
  samples of a prompt stay together), balanced by expected tokens (prompt length plus the mean
  response length seen so far), and the completions are gathered in prompt order on every rank.
  With per-sample seeds (``SamplingParams.seed``, on by default on the CPU) a sample depends only
  on (seed, prompt index, sample index), so the rollouts are the same for any number of replicas.
- Failures: each engine retries and restarts itself (``rollout.max_retries``). A replica whose
  restart lost the synced weights asks for a resync: the trainer's weights are streamed again and
  only that replica's prompts are re-sent; the other replicas' results are kept. Whatever still
  fails is a RolloutError naming the replica, on every rank.
- Asynchronous generation (``background=True``, for ``trainer.max_staleness`` >= 1): each leader
  drives its engine from a :class:`~megatron_alp.rollout.producer.RolloutProducer` thread.
  :meth:`submit` splits a batch and queues each share on its replica without waiting;
  :meth:`collect` later gathers the results on every rank. Weight syncs wait until no job holds an
  engine (or pause it between decoding steps, with partial rollouts), so every result carries the
  one weight version it was generated with (:attr:`Batch.versions`).
- One-rank jobs run vLLM in process (it starts in seconds and weights arrive in memory);
  under torchrun each replica's vLLM runs in its engine-core subprocess (an in-process vLLM
  would adopt the trainer's default process group and wait for the other ranks). On GPUs a
  replica sleeps (weights offloaded, KV cache freed) while Megatron trains when
  ``free_memory_during_training`` is set.

Weight sync streams :func:`megatron_alp.models.hf_weights.iter_hf_weights` (TP/PP/EP gathered in
``sync_bucket_mb`` buckets, ALP sigmas skipped) to the replica leaders only, who hand the buckets
to their engines (``rollout.sync_method``); the other ranks take part in the gathers and receive
nothing else. With ``verify_sync`` every replica samples a short probe that the Megatron model
scores; each must agree. A resync after an engine restart and the verification each run in their
own phase of the trainer's phase table (``phase``).
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

import torch.distributed as dist

from megatron_alp.algorithms.balance import imbalance, partition
from megatron_alp.config import RolloutConfig
from megatron_alp.data.trajectory import Trajectory
from megatron_alp.models.families import load_hf_config
from megatron_alp.models.hf_weights import iter_hf_weights
from megatron_alp.rollout.base import (
    Completion,
    EngineRestarted,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    get_engine,
    resolve_max_model_len,
)
from megatron_alp.rollout.placement import Placement, ReplicaLayout, engine_placement, replica_layout
from megatron_alp.rollout.producer import RolloutProducer
from megatron_alp.rollout.weight_sync import WeightStream, default_verify_tolerance
from megatron_alp.runtime.comm import cpu_group
from megatron_alp.runtime.platform import has_gpu

# (model, probe trajectories) -> mismatch_stats of the engine's logprobs vs the model's, on every rank.
# The trainer supplies it (megatron_alp.training.policy_update.probe_mismatch): scoring is a training pass.
Scorer = Callable[[Any, list[Trajectory]], dict]


def build_engine(cfg: RolloutConfig, model_dir: str, seed: int, placement: Optional[Placement] = None
                 ) -> RolloutEngine:
    """The engine registered under ``cfg.engine`` (``vllm``, ``sglang``), started on ``model_dir``
    once it accepts ``cfg`` (:meth:`~megatron_alp.rollout.base.RolloutEngine.check_config`)."""
    engine = get_engine(cfg.engine)
    engine.check_config(cfg)
    return engine(cfg, model_dir, seed, placement)


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
                 phase: Callable[[str], ContextManager] = lambda name: contextlib.nullcontext()):
        self.cfg = cfg
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
        self._stats = self._fresh_stats()
        error = None
        if self.replica is not None:
            try:
                local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
                placement = engine_placement(cfg, self.layout, self.rank, local_rank, local_world, has_gpu())
                self.engine = build_engine(cfg, model_dir, seed, placement)
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

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank, over the rollout's CPU group (which tolerates the long
        waits of generation): e.g. the output of code that rank 0 ran for a multi-turn episode."""
        if not self.multi:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
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
        """``("ok", result)``, ``("resync", why)`` or ``("error", exception)``, and the exception."""
        try:
            return ("ok", call()), None
        except EngineRestarted as err:
            return ("resync", str(err)), None
        except Exception as err:
            return ("error", _picklable(err)), err

    def _on_replicas(self, work: Callable[[RolloutEngine], Any], which: set[int]
                     ) -> tuple[list[tuple[str, Any]], Optional[BaseException]]:
        """Run ``work(engine)`` on the replicas in ``which``. Returns every replica's ``(status,
        payload)`` on every rank ("ok" and ``(version, result)``, "resync" and why, "error" and the
        exception, "skip") and this rank's own exception, if it raised one."""
        outcome: tuple[str, Any] = ("skip", None)
        own = None
        if self.replica in which:
            outcome, own = self._outcome(lambda: self._run(work))
        return self._gather(outcome), own

    # ---------------------------------------------------------------------------- rollouts

    def split(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Prompt indices per replica: whole groups, balanced by expected tokens."""
        expected = self._response_len if self._response_len is not None else params.max_tokens
        return partition([params.n * (len(p) + expected) for p in prompts], self.replicas)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt, identical on every rank."""
        return self.collect(self.submit(prompts, params)).results

    def submit(self, prompts: list[list[int]], params: SamplingParams, work: Optional[Work] = None) -> Batch:
        """Split ``prompts`` over the replicas and, with background generation, queue each leader's
        share on its producer at once (collective: every rank calls it, in the same order). Without
        a producer the share runs in :meth:`collect`. ``work`` defaults to the plain generate call."""
        batch = Batch(prompts, params, work or generate_work(params), self.split(prompts, params))
        if self.producer is not None and self.replica is not None and batch.shares[self.replica]:
            batch.future = self.producer.submit(self._share_job(batch))
        return batch

    def _share_job(self, batch: Batch) -> Callable[[RolloutEngine], Any]:
        mine = batch.shares[self.replica]

        def job(engine):
            t0 = time.time()
            results = batch.work(engine, [batch.prompts[i] for i in mine], mine)
            return results, time.time() - t0

        return job

    def collect(self, batch: Batch) -> Batch:
        """Every replica's results of ``batch`` on every rank, in prompt order (``batch.results``,
        ``batch.versions``). A replica whose engine restarted without the synced weights is resynced
        and its share run again; whatever still fails raises on every rank."""
        results: dict[int, Any] = {}
        versions: dict[int, int] = {}
        todo = {k for k in range(self.replicas) if batch.shares[k]}
        resyncs = 0
        pending = batch.future
        while todo:
            outcome: tuple[str, Any] = ("skip", None)
            own = None
            if self.replica in todo:
                job = self._share_job(batch)
                outcome, own = self._outcome(pending.result if pending is not None else lambda: self._run(job))
            pending = None
            outcomes = self._gather(outcome)
            resync = []
            for k in sorted(todo):
                status, payload = outcomes[k]
                if status == "ok":
                    version, (share, seconds) = payload
                    results.update(zip(batch.shares[k], share))
                    versions.update((i, version) for i in batch.shares[k])
                    self._stats["tokens"][k] += sum(len(x.response_ids) for g in share for x in g)
                    self._stats["seconds"][k] += seconds
                    batch.seconds = max(batch.seconds, seconds)
                    todo.discard(k)
                elif status == "resync":
                    resync.append(k)
            self._check([payload if status == "error" else None for status, payload in outcomes], own, "generation")
            if resync and (self._models is None or resyncs >= self.cfg.max_retries):
                k = resync[0]
                raise RolloutError(f"rollout replica {k} (rank {self.layout.leader(k)}) lost its weights and "
                                   f"could not be resynced: {outcomes[k][1]}")
            if resync:
                resyncs += 1
                with self.phase("engine_restart_resync"):
                    self.sync_weights(self._models, self.version)
        batch.results = [results[i] for i in range(len(batch.prompts))]
        batch.versions = [versions[i] for i in range(len(batch.prompts))]
        lengths = [len(x.response_ids) for g in batch.results for x in g]
        if lengths:
            self._response_len = sum(lengths) / len(lengths)
        return batch

    def take_stats(self) -> dict:
        """``rollout/*`` statistics of the generate calls since the last call: replicas, tokens/s of
        the slowest, mean and fastest replica, and the straggler ratio (slowest / mean time)."""
        stats, self._stats = self._stats, self._fresh_stats()
        busy = [k for k in range(self.replicas) if stats["seconds"][k] > 0]
        out = {"rollout/replicas": float(self.replicas)}
        if busy:
            rates = [stats["tokens"][k] / stats["seconds"][k] for k in busy]
            out.update({
                "rollout/replica_tokens_per_s_min": min(rates),
                "rollout/replica_tokens_per_s_mean": sum(rates) / len(rates),
                "rollout/replica_tokens_per_s_max": max(rates),
                "rollout/straggler_ratio": imbalance([stats["seconds"][k] for k in range(self.replicas)]),
            })
        return out

    def _fresh_stats(self) -> dict:
        return {"tokens": [0] * self.replicas, "seconds": [0.0] * self.replicas}

    def sync_weights(self, models, version: Optional[int] = None) -> dict:
        """Stream the trainer's weights into every replica, which then hold ``version`` (default:
        the current one: a resync); returns ``sync/*`` statistics. A leader whose producer is busy
        waits for it first (``sync/wait_s``): a sequence is never generated by two weight versions,
        except that a partial-rollout job pauses between decoding steps instead of finishing."""
        version = self.version if version is None else version
        model = _single(models)
        t0 = time.time()
        error = None
        with self.producer.updating(version) if self.producer is not None else contextlib.nullcontext():
            # every rank waits here, on the CPU group that tolerates long waits, until each leader's
            # engine is free: the weight gather below runs on the trainer's groups, whose timeouts would not
            self._gather(None)
            waited = time.time() - t0
            # only the leaders feed an engine: the other ranks help gather and receive no full tensor
            leaders = [self.layout.leader(k) for k in range(self.replicas)]
            stream = WeightStream(iter_hf_weights(model, self.cfg.sync_bucket_mb << 20, receivers=leaders))
            if self.engine is not None:
                try:
                    self.engine.update_weights(stream)
                except Exception as err:
                    error = err
            stream.drain()  # every rank reaches the end of the collective, even after an engine error
        outcomes = self._gather((_picklable(error), stream.bytes, stream.tensors))
        self._check([failure for failure, _, _ in outcomes], error, "weight sync")
        self._models = models
        self.version = version
        seconds = time.time() - t0 - waited
        _, nbytes, tensors = outcomes[0]  # what each engine received, the same on every rank
        stats = {"sync/seconds": seconds, "sync/wait_s": waited, "sync/bytes": float(nbytes),
                 "sync/tensors": float(tensors), "sync/gbps": nbytes / max(seconds, 1e-9) / 1e9}
        if self.cfg.verify_sync:
            with self.phase("sync_verification"):
                stats.update(self.verify(model))
        return stats

    def verify(self, model) -> dict:
        """Every replica samples a short probe; the Megatron model scores each (``scorer``): every
        engine must report the trainer's logprobs (within ``rollout.verify_tolerance``)."""
        if self.scorer is None:
            raise RolloutError("rollout.verify_sync needs the trainer's scorer: DistributedRollout(..., scorer=...)")
        vocab = self._vocab_size()
        prompts = [[3 + (7 * i + 13 * k) % (vocab - 3) for k in range(8)] for i in range(4)]
        params = SamplingParams(n=2, temperature=1.0, max_tokens=16)
        outcomes, own = self._on_replicas(lambda engine: engine.generate(prompts, params), set(range(self.replicas)))
        self._check([payload if status != "ok" else None for status, payload in outcomes], own,
                    "the weight-sync probe")
        outcomes = [(status, payload[1]) for status, payload in outcomes]
        trainer_dtype = next(model.parameters()).dtype
        tol = self.cfg.verify_tolerance or default_verify_tolerance(
            self.cfg.dtype, self.cfg.quantization, self.cfg.kv_cache_dtype, trainer_dtype)
        worst = None
        for k, (_, groups) in enumerate(outcomes):
            stats = self.scorer(model, [Trajectory.from_completion(c) for g in groups for c in g])
            if not stats["mean"] <= tol:
                raise RolloutError(
                    f"weight sync verification failed on rollout replica {k}: engine and trainer logprobs "
                    f"differ by mean {stats['mean']:.3e} (max {stats['max']:.3e}) over {stats['tokens']} probe "
                    f"tokens, above rollout.verify_tolerance={tol:g}; the engine does not hold the trainer's weights"
                )
            if worst is None or stats["mean"] > worst["mean"]:
                worst = stats
        return {"sync/verify_mean_abs_diff": worst["mean"], "sync/verify_max_abs_diff": worst["max"]}

    def _vocab_size(self) -> int:
        return int(load_hf_config(self.model_dir)["vocab_size"])

    @property
    def max_model_len(self) -> int:
        """The engines' context length (prompt + response), known on every rank."""
        return resolve_max_model_len(self.cfg, load_hf_config(self.model_dir))

    # --------------------------------------------------------------------------- lifecycle

    def set_memory(self, state: str) -> None:
        """Put the colocated engines' memory in ``state``: ``asleep`` (weights and KV cache freed
        while the trainer trains), ``weights`` (the weights awake for a sync, no KV cache) or
        ``awake``. Separate engines, and engines told not to free memory, stay awake."""
        if self.cfg.placement != "colocated" or not self.cfg.free_memory_during_training:
            state = "awake"
        if state == self.memory:
            return
        if self.engine is not None:
            if state == "asleep" or (state == "weights" and self.memory == "awake"):
                self.engine.sleep()
            if state == "weights":
                self.engine.wake_up(tags=("weights",))
            elif state == "awake":
                self.engine.wake_up()
        self.memory = state

    def sleep(self) -> None:
        self.set_memory("asleep")

    def wake_up(self) -> None:
        self.set_memory("awake")

    def shutdown(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.producer is not None:
            self.producer.join(timeout=30)
            self.producer = None


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
