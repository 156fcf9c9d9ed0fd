"""Hangs end: a phase that runs past ``trainer.hang_deadline_s`` stops the rank, saying where.

A rank stuck in a collective (a dead peer, a wedged engine, a straggler past every timeout) would
otherwise wait forever, and with it the whole job. Every rank beats a heartbeat file at each phase
entry (``RUN/heartbeat/rank_<r>.json``: phase, iteration, time); a watchdog thread checks the age of
its own phase. Past the deadline it writes ``RUN/hang/rank_<r>.json`` (its phase and iteration, and
for every other rank where its heartbeat stands, so the rank that did not arrive is named), the
stacks of all its threads next to it, prints one line, and exits with
:data:`~megatron_alp.runtime.preemption.EXIT_HANG`, which the launch scripts requeue. The exit
waits two polls and a second after the report: a peer waiting on this rank in a collective would
otherwise see the connection break before its own deadline and end without its report. Checkpoints
are written atomically, so a hang during a save leaves nothing that looks complete.

A checkpoint save or load (and the Hugging Face weights and checksums read at the start) can
outlast any fixed deadline on slow shared storage. Inside :meth:`HangWatch.progress` every poll that
finds the bytes moved grown beats again, so the deadline bounds the time without progress, not the
phase (:func:`watching`: the bytes this process has read, and in a save the bytes every rank has
written so far, so a rank that writes nothing while others do is not a hang).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Optional

from megatron_alp.runtime.preemption import EXIT_HANG, record_exit
from megatron_alp.training.dist_checkpoint import save_progress


class HangWatch:
    def __init__(self, deadline_s: float, run_dir: Path, rank: int, order: list[str]):
        self.deadline_s, self.rank, self.order = deadline_s, rank, order
        self.beats, self.reports = Path(run_dir) / "heartbeat", Path(run_dir) / "hang"
        self.beats.mkdir(parents=True, exist_ok=True)
        self.phase, self.iteration, self.since = "setup", 0, time.monotonic()
        self.stopped = False
        self._moved: Optional[Callable[[], int]] = None  # inside progress(): the bytes moved so far
        self._last_moved = 0
        self.poll = min(5.0, deadline_s / 10)
        threading.Thread(target=self._watch, name="megatron-alp-hang-watch", daemon=True).start()

    def beat(self, phase: str, iteration: int) -> None:
        self._stamp(phase, iteration)
        hang_for_test(phase, iteration, self.rank)

    @contextlib.contextmanager
    def progress(self, moved: Callable[[], int]) -> Iterator[None]:
        """Within the block, each poll that finds ``moved()`` (bytes moved so far) grown beats again."""
        self._last_moved = moved()
        self._moved = moved
        try:
            yield
        finally:
            self._moved = None

    def _stamp(self, phase: str, iteration: int) -> None:
        self.phase, self.iteration, self.since = phase, iteration, time.monotonic()
        path = self.beats / f"rank_{self.rank}.json"
        tmp = path.with_name(f"{path.name}.tmp")
        tmp.write_text(json.dumps({"phase": phase, "iteration": iteration, "time": time.time()}))
        os.replace(tmp, path)

    def _check_progress(self) -> None:
        moved = self._moved
        if moved is None:
            return
        try:
            now = moved()
        except OSError:  # storage that cannot be read now counts as no progress
            return
        if now > self._last_moved:
            self._last_moved = now
            self._stamp(self.phase, self.iteration)

    def stop(self) -> None:
        """The run is over (finished, interrupted or failed): nothing is watched any more."""
        self.stopped = True

    def _watch(self) -> None:
        while time.monotonic() - self.since <= self.deadline_s or self.stopped:
            if self.stopped:
                return
            time.sleep(self.poll)
            self._check_progress()
        self._report()
        record_exit(EXIT_HANG)
        # the peers waiting on this rank have reached their deadline within a poll or two of it: give
        # them that long to write their reports before this exit breaks their collectives
        time.sleep(2 * self.poll + 1.0)
        os._exit(EXIT_HANG)

    def _report(self) -> None:
        others = {}
        for path in sorted(self.beats.glob("rank_*.json")):
            try:
                others[int(path.stem.split("_")[1])] = json.loads(path.read_text())
            except (ValueError, json.JSONDecodeError, OSError):
                continue
        here = (self.iteration, self._index(self.phase))
        behind = sorted(r for r, b in others.items() if (b["iteration"], self._index(b["phase"])) < here)
        waited = time.monotonic() - self.since
        self.reports.mkdir(parents=True, exist_ok=True)
        report = {"rank": self.rank, "phase": self.phase, "iteration": self.iteration, "seconds": waited,
                  "deadline_s": self.deadline_s, "ranks_behind": behind,
                  "heartbeats": {str(r): {**b, "age_s": time.time() - b["time"]} for r, b in others.items()}}
        (self.reports / f"rank_{self.rank}.json").write_text(json.dumps(report, indent=1))
        with open(self.reports / f"rank_{self.rank}.stacks.txt", "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        where = (f"; ranks {behind} did not arrive (" + ", ".join(
            f"rank {r} in {others[r]['phase']} of iteration {others[r]['iteration']}" for r in behind) + ")"
                 if behind else "")
        print(f"rank {self.rank}: phase {self.phase} of iteration {self.iteration} ran {waited:.0f} s, past "
              f"trainer.hang_deadline_s={self.deadline_s:g}{where}; stopping (exit {EXIT_HANG}); report in "
              f"{self.reports}", file=sys.stderr, flush=True)

    def _index(self, phase: str) -> int:
        return self.order.index(phase) if phase in self.order else -1


def watching(watch: Optional[HangWatch], saving: Optional[Path] = None) -> ContextManager[None]:
    """``watch.progress`` on the bytes this process reads (a load, checksums) and, ``saving`` a checkpoint
    there, the bytes every rank has written into it so far; nothing without a watch (``hang_deadline_s: null``)."""
    if watch is None:
        return contextlib.nullcontext()
    reads = read_counter()
    return watch.progress(lambda: reads() + (save_progress(saving) if saving is not None else 0))


def read_counter() -> Callable[[], int]:
    """A count of the bytes this process reads through system calls (``rchar`` of /proc/self/io; 0 where it
    is absent), less the counter's own reads of that file, which the kernel counts as well."""
    own = 0

    def count() -> int:
        nonlocal own
        try:
            with open("/proc/self/io", "rb") as f:
                data = f.read()
        except OSError:
            return 0
        before, own = own, own + len(data)  # the value read does not count this read yet
        return int(data.split(b"rchar:")[1].split()[0]) - before

    return count


def hang_for_test(phase: str, iteration: int, rank: int) -> None:
    """Test hook: ``MEGATRON_ALP_HANG_AT=<phase>:<iteration>:<rank>`` makes that rank stop answering
    as it enters that phase, to prove every rank's hang ends within the deadline."""
    target = os.environ.get("MEGATRON_ALP_HANG_AT")
    if target and target.split(":") == [phase, str(iteration), str(rank)]:
        while True:
            time.sleep(3600)
