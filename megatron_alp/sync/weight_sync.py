"""The weight sync: the trainer's weights into every live rollout replica, collectively.

Every rank calls :meth:`WeightSync.sync`: it waits until no producer job holds a leader's engine
(``sync/wait_s``; a partial-rollout job pauses between decoding steps instead), streams the run's
:class:`~megatron_alp.sync.sources.WeightSource` (every rank takes part in the export's gathers;
only the replica leaders receive tensors and feed their engine), and records the version the
engines then hold. With ``rollout.verify_sync`` every replica samples a short probe that the
Megatron model scores (``scorer``); each must agree within ``rollout.verify_tolerance``. A replica
whose engine fails the update or the probe is synced again (a full sync), or retired at its second
failure in a row (a stream taken is no success: only a generation resets the count). A leader whose
source reports a :meth:`~megatron_alp.sync.sources.WeightSource.problem` (a delta checksum that
disagrees) makes the next stream a full one, to every replica, within the same call.

It hands the rollout :meth:`resync`, which an engine that restarted without the synced weights
calls for (the rollout never holds the trainer's model). A resync and the verification each run in
their own phase of the trainer's phase table (``phase``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Optional

from megatron_alp.data.trajectory import Trajectory
from megatron_alp.models.families import load_hf_config
from megatron_alp.rollout.base import RolloutError, SamplingParams, tensor_pairs
from megatron_alp.rollout.distributed import DistributedRollout
from megatron_alp.rollout.replicas import picklable
from megatron_alp.rollout.weight_sync import WeightStream, default_verify_tolerance
from megatron_alp.sync.sources import WeightSource

# (model, probe trajectories) -> mismatch_stats of the engine's logprobs vs the model's, on every rank.
# The trainer supplies it (megatron_alp.training.policy_update.probe_mismatch): scoring is a training pass.
Scorer = Callable[[Any, list[Trajectory]], dict]


def single_chunk(models):
    """The one model chunk of this rank (virtual pipeline stages are not supported)."""
    if isinstance(models, (list, tuple)):
        if len(models) != 1:
            raise ValueError(f"weight sync takes one model chunk per rank (got {len(models)}; virtual "
                             "pipeline stages are not supported)")
        return models[0]
    return models


class WeightSync:
    """Streams ``source`` into the engines of ``rollout``; every rank calls every method."""

    def __init__(self, rollout: DistributedRollout, source: WeightSource, scorer: Optional[Scorer] = None,
                 phase: Callable[[str], ContextManager] = lambda name: contextlib.nullcontext()):
        self.rollout, self.source, self.scorer, self.phase = rollout, source, scorer, phase
        self._model = None  # the model of the last sync, for a resync
        rollout.resync = self.resync

    @property
    def cfg(self):
        return self.rollout.cfg

    def sync(self, models, version: Optional[int] = None) -> dict:
        """The trainer's ``models`` into every live replica, which then hold ``version`` (default: the
        current one); returns ``sync/*`` statistics."""
        model = single_chunk(models)
        rollout = self.rollout
        version = rollout.version if version is None else version
        t0 = time.time()
        which = list(rollout.live)
        nbytes = tensors = 0  # what the engine that received most was sent, over every stream of this call
        verified: dict = {}
        waited = 0.0
        anchored = False  # a stream after a problem was full already
        while which:
            wait, outcomes, own = self._stream(model, version, which)
            waited += wait
            failures = [failure for failure, *_ in outcomes]
            rollout.check([f if not isinstance(f, RolloutError) else None for f in failures],
                          None if isinstance(own, RolloutError) else own, self.source.what)
            most = max((b, t) for _, b, t, _ in outcomes)
            nbytes, tensors = nbytes + most[0], tensors + most[1]
            stats = self.source.stats()
            problems = [(k, p) for k, (*_, p) in enumerate(outcomes) if p]
            if problems:
                if anchored:
                    k, problem = problems[0]
                    raise RolloutError(f"{self.source.what}: rollout replica {k} still disagrees after a full "
                                       f"sync: {problem}")
                self.source.reset()  # some engine may not hold the trainer's weights: all get a full sync
                anchored = True
                which = [k for k in which if k in rollout.live]
                continue
            synced = [k for k in which if failures[k] is None]
            retry = [k for k in which if failures[k] is not None and not rollout.failed(k, failures[k], own)]
            if self.cfg.verify_sync and synced:
                with self.phase("sync_verification"):
                    probed = self.verify(model, synced)
                if probed and (not verified or probed["sync/verify_mean_abs_diff"] >
                               verified["sync/verify_mean_abs_diff"]):
                    verified = probed
                retry += [k for k in synced if k in rollout.live and rollout.failures[k]]  # its probe failed
            which = sorted(retry)
            if which:
                self.source.reset()
        rollout.version = version
        self._model = model
        seconds = time.time() - t0 - waited
        return {"sync/seconds": seconds, "sync/wait_s": waited, "sync/bytes": float(nbytes),
                "sync/tensors": float(tensors), "sync/gbps": nbytes / max(seconds, 1e-9) / 1e9, **stats, **verified}

    def resync(self) -> None:
        """Bring the last synced model back into the live replicas at their current version (an engine
        restarted without it): a full sync, in its own phase."""
        with self.phase("engine_restart_resync"):
            self.source.reset()
            self.sync(self._model)

    def _stream(self, model, version: int, which: list[int]) -> tuple[float, list, Optional[BaseException]]:
        """One stream fed into the engines of the replicas in ``which`` (every rank takes part): the
        seconds waited for the producers, each replica's ``(error, bytes, tensors, problem)``, and
        this rank's own error."""
        rollout = self.rollout
        t0 = time.time()
        error = None
        feeds = rollout.replica in which and rollout.engine is not None
        producer = rollout.producer
        with producer.updating(version) if feeds and producer is not None else contextlib.nullcontext():
            # every rank waits here, on the CPU group that tolerates long waits, until each leader's
            # engine is free: the weight gather below runs on the trainer's groups, whose timeouts would not
            if any(rollout.gather(feeds and self.source.stale(rollout.engine))):
                self.source.reset()  # an engine lost the weights a stream of changes builds on
            waited = time.time() - t0
            # only the leaders feed an engine: the other ranks help gather and receive no full tensor
            leaders = [rollout.layout.leader(k) for k in which]
            stream = WeightStream(tensor_pairs(self.source.tensors(model, leaders)))
            if feeds:
                try:
                    self.source.feed(rollout.engine, stream)
                except Exception as err:
                    error = err
            stream.drain()  # every rank reaches the end of the collective, even after an engine error
        problem = self.source.problem() if feeds else None
        return waited, rollout.gather((picklable(error), stream.bytes, stream.tensors, problem)), error

    def verify(self, model, which: Optional[list[int]] = None) -> dict:
        """Every live replica (or those in ``which``) samples a short probe; the Megatron model scores
        each (``scorer``): every engine must report the trainer's logprobs (within
        ``rollout.verify_tolerance``). A probe the engine fails counts as a failure of its replica
        (retired at the second in a row) and is left out of the statistics (empty when none ran)."""
        if self.scorer is None:
            raise RolloutError("rollout.verify_sync needs the trainer's scorer: WeightSync(..., scorer=...)")
        rollout = self.rollout
        vocab = int(load_hf_config(rollout.model_dir)["vocab_size"])
        prompts = [[3 + (7 * i + 13 * k) % (vocab - 3) for k in range(8)] for i in range(4)]
        params = SamplingParams(n=2, temperature=1.0, max_tokens=16)
        which = list(rollout.live) if which is None else which
        outcomes, own = rollout.on_replicas(lambda engine: engine.generate(prompts, params), set(which))
        rollout.check([payload if status == "error" else None for status, payload in outcomes],
                      None if isinstance(own, RolloutError) else own, "the weight-sync probe")
        probed = []
        for k in which:
            if outcomes[k][0] == "ok":
                rollout.failures[k] = 0
                probed.append(k)
            else:
                rollout.failed(k, outcomes[k][1], own)
        return self._compare(model, [(k, outcomes[k][1][1]) for k in probed])

    def _compare(self, model, probed: list[tuple[int, list]]) -> dict:
        """The scorer's verdict on each probed replica's groups: a RolloutError above the tolerance."""
        trainer_dtype = next(model.parameters()).dtype
        cfg = self.cfg
        tol = cfg.verify_tolerance or default_verify_tolerance(cfg.dtype, cfg.quantization, cfg.kv_cache_dtype,
                                                               trainer_dtype)
        worst = None
        for k, groups in probed:
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
