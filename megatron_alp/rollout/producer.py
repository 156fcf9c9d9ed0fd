"""A replica leader's engine driven from a background thread, so it generates while the trainer trains.

With ``trainer.max_staleness`` >= 1 every engine call of a replica leader goes through its
:class:`RolloutProducer`: jobs (a generate call, a batch of multi-turn episodes, a weight-sync
probe) run one at a time, in submission order, on the producer's thread, while the trainer's
thread goes on with the update. The engine's weights change only inside :meth:`updating`, which
waits until no job holds the engine, so a job runs under one weight version from start to end.

The deterministic schedule (``trainer.async_schedule: deterministic``): a job may name the weight
version it must run under. It then waits for that version, and an update away from it waits until
the job has run, so which weights generate which batch no longer depends on timing. With partial
rollouts such a job may also name a fixed cut (:meth:`cut_after`): the update away from its version
waits only until every response reached the cut, and the job waits there for the next version.

Partial rollouts (``rollout.partial_rollout``): the producer is also the engine's
:class:`~megatron_alp.rollout.base.Interruption`. A waiting update sets :meth:`requested`; the
engine sees it between decoding steps, stops its unfinished requests and calls :meth:`pause`, which
hands the engine to the update and returns the new version once it is done; the engine then
continues the stopped sequences. Nothing else touches the engine while a job is paused.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Optional

from megatron_alp.rollout.base import EngineRestarted, RolloutEngine, RolloutError


class RolloutProducer:
    def __init__(self, engine: RolloutEngine, version: int, partial_rollouts: bool = False,
                 cores: tuple[int, ...] | None = None):
        """``cores``: the CPU cores of the producer's thread (the engine client's work and whatever
        a job runs, e.g. multi-turn episodes; None: this process's)."""
        self.engine = engine
        self.cores = cores
        self.version = version  # the weight version the engine holds
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Callable[[RolloutEngine], Any], Future, Optional[int], Optional[int]]] = deque()
        self._running = False  # a job holds the engine (it may be paused)
        self._running_version: Optional[int] = None  # the version the running job must run under
        self._running_cut: Optional[int] = None  # its fixed cut (tokens per response), if any
        self._paused = False  # the running job waits in pause() for an update
        self._update = False  # an update waits for, or holds, the engine
        self._closed = False
        self._lost_weights: str | None = None  # the engine restarted without the synced weights
        if partial_rollouts:
            engine.interruption = self
        self._thread = threading.Thread(target=self._loop, name="megatron-alp-rollout-producer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------- jobs

    def submit(self, work: Callable[[RolloutEngine], Any], version: Optional[int] = None,
               cut: Optional[int] = None) -> Future:
        """Queue ``work(engine)``; its Future holds ``(version at its start, result)``. ``version``:
        the weight version it must run under (it waits for it; an update away from it waits for the
        job); None: whichever the engine holds when the job's turn comes. ``cut`` (with ``version``
        and partial rollouts): the tokens of each response generated under ``version``; the rest
        continues under the next one."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RolloutError("the rollout producer is closed")
            self._jobs.append((work, future, version, cut))
            self._cond.notify_all()
        return future

    def run(self, work: Callable[[RolloutEngine], Any]) -> tuple[int, Any]:
        """``work`` after everything queued before it; ``(version, result)``."""
        return self.submit(work).result()

    def _loop(self) -> None:
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)  # this thread only
        while True:
            with self._cond:
                while not self._closed and (not self._jobs or self._update or self._early()):
                    self._cond.wait()
                if self._closed:
                    return
                work, future, wanted, self._running_cut = self._jobs.popleft()
                self._running, self._running_version = True, wanted
                version = self.version
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        if wanted is not None and wanted != version:
                            raise RolloutError(f"a job scheduled for weight version {wanted} found the engine at "
                                               f"version {version}: the update away from it did not wait")
                        if self._lost_weights is not None:  # never generate from the restarted engine's own weights
                            raise EngineRestarted(self._lost_weights)
                        future.set_result((version, work(self.engine)))
                    except EngineRestarted as err:
                        self._lost_weights = str(err)
                        future.set_exception(err)
                    except BaseException as err:  # handed to whoever waits on the job
                        future.set_exception(err)
            finally:
                with self._cond:
                    self._running, self._running_version, self._running_cut = False, None, None
                    self._cond.notify_all()

    def _early(self) -> bool:
        """Whether the next job waits for a newer weight version (under the lock)."""
        wanted = self._jobs[0][2]
        return wanted is not None and wanted > self.version

    def _owed(self) -> bool:
        """Whether a job queued or running (not paused at its cut) must still run under the current
        version (under the lock)."""
        queued = [wanted for _, _, wanted, _ in self._jobs]
        return self.version in queued or (self._running_version == self.version and not self._paused)

    # ----------------------------------------------------------------------------- updates

    @contextlib.contextmanager
    def updating(self, version: int) -> Iterator[None]:
        """Exclusive use of the engine for a weight update (the caller's thread); afterwards the
        engine holds ``version``. Waits for the jobs that must run under the current version (the
        deterministic schedule), then for the running job to end, or to pause (partial rollouts)."""
        with self._cond:
            while version != self.version and self._owed() and not self._closed:
                self._cond.wait()
            self._update = True
            while self._running and not self._paused:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self.version = version
                self._lost_weights = None
                self._update = False
                self._cond.notify_all()

    def requested(self) -> bool:
        """Whether an update waits for the engine (read by the engine between decoding steps). Never
        for a job of the deterministic schedule: where it is cut does not depend on timing."""
        return self._update and self._running_version is None

    def cut_after(self) -> Optional[int]:
        """The running job's fixed cut (tokens per response), or None."""
        return self._running_cut

    def pause(self) -> int:
        """Called by the running job: let the waiting update run (at a fixed cut: wait for the next
        version); returns the version after it."""
        with self._cond:
            self._paused = True
            before = self.version
            self._cond.notify_all()
            while self._update or (self._running_cut is not None and self.version == before and not self._closed):
                self._cond.wait()
            self._paused = False
            if self._closed:
                raise RolloutError("the rollout producer closed while a generation waited for new weights")
            return self.version

    # --------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Stop taking jobs and cancel the queued ones; a running job is left to end (shutting the
        engine down ends it; then :meth:`join`)."""
        with self._cond:
            self._closed = True
            while self._jobs:
                self._jobs.popleft()[1].cancel()
            self._cond.notify_all()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
