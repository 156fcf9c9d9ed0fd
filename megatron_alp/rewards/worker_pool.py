"""Per-sample time limits for scoring functions: a small pool of worker processes.

Checkers like math-verify can spend unbounded time in C code (SymPy big-number arithmetic,
regular expressions) that no in-process timeout interrupts, and a crash there would take the
trainer down. So scoring runs in separate worker processes, one sample at a time each; a sample
that exceeds the limit scores ``default`` and its worker is killed and replaced (replacements
start in the background; the clock of a sample starts when a ready worker receives it). A worker
that crashes costs its sample the same way. Workers are plain ``python -c`` processes speaking
JSON lines over pipes, so nothing of the trainer (threads, CUDA, distributed state) is forked.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Optional

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_WORKER_MAIN = "import sys; from megatron_alp.rewards.worker_pool import serve; serve(*sys.argv[1:])"


class _Worker:
    def __init__(self, scorer: str):
        self.log = tempfile.TemporaryFile()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
        die_with_parent = "1" if threading.current_thread() is threading.main_thread() else "0"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_MAIN, scorer, die_with_parent],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env, close_fds=True,
        )
        self.started = time.monotonic()
        self.ready = False
        self.task: Optional[int] = None
        self.deadline = 0.0
        self.buffer = b""

    def send(self, task: int, args: list, timeout_s: float) -> None:
        self.task = task
        self.proc.stdin.write((json.dumps({"id": task, "args": args}) + "\n").encode())
        self.proc.stdin.flush()
        self.deadline = time.monotonic() + timeout_s

    def messages(self) -> Optional[list[dict]]:
        """Complete messages available now; None when the worker has exited."""
        data = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not data:
            return None
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2000:].decode("utf-8", "replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.log):
            try:
                f.close()
            except OSError:
                pass


def _shutdown(workers: list) -> None:
    for w in workers:
        w.kill()
    workers.clear()


class ScoringPool:
    """Run ``scorer`` (``"package.module:function"``, returning a float) on many argument tuples in
    ``workers`` processes, each call limited to ``timeout_s`` seconds of wall-clock time."""

    def __init__(self, scorer: str, workers: int, timeout_s: float, default: float = 0.0,
                 start_timeout_s: float = 120.0):
        if ":" not in scorer:
            raise ValueError(f"scorer {scorer!r}: expected 'package.module:function'")
        self.scorer, self.num_workers, self.timeout_s = scorer, workers, timeout_s
        self.default, self.start_timeout_s = default, start_timeout_s
        self.timeouts = 0  # samples that hit the limit (cumulative)
        self.crashes = 0  # workers that died while scoring (cumulative)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        self._fill()  # workers import their scorer in the background until the first batch

    def _fill(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self.scorer))

    def map(self, items: list[tuple]) -> list[float]:
        """Scores of ``items`` (JSON-serialisable argument tuples), in order."""
        with self._lock:
            if not self._finalizer.alive:
                raise RuntimeError(f"ScoringPool for {self.scorer} is closed")
            return self._map(items)

    def close(self) -> None:
        self._finalizer()

    def _map(self, items: list[tuple]) -> list[float]:
        self._fill()
        queue = deque(range(len(items)))
        results: list[Optional[float]] = [None] * len(items)
        remaining = len(items)
        while remaining:
            dead: list[_Worker] = []
            for w in self._workers:
                if w.ready and w.task is None and queue:
                    i = queue.popleft()
                    try:
                        w.send(i, list(items[i]), self.timeout_s)
                    except OSError:  # died between samples: retry the sample elsewhere
                        queue.appendleft(i)
                        w.task = None
                        dead.append(w)
            now = time.monotonic()
            waits = [w.deadline - now for w in self._workers if w.task is not None]
            fds = {w.proc.stdout.fileno(): w for w in self._workers if w not in dead}
            ready, _, _ = select.select(list(fds), [], [], max(0.0, min(waits, default=1.0)))
            for fd in ready:
                w = fds[fd]
                msgs = w.messages()
                if msgs is None:
                    dead.append(w)
                    continue
                for msg in msgs:
                    if msg.get("ready"):
                        w.ready = True
                    elif w.task is not None and msg.get("id") == w.task:
                        score = msg.get("score")
                        results[w.task] = self.default if score is None or score != score else float(score)
                        remaining -= 1
                        w.task = None
            now = time.monotonic()
            for w in self._workers:
                if w in dead:
                    continue
                if w.task is not None and now >= w.deadline:
                    self.timeouts += 1
                    dead.append(w)
                elif not w.ready and now - w.started > self.start_timeout_s:
                    raise RuntimeError(f"reward worker for {self.scorer} did not start in "
                                       f"{self.start_timeout_s:.0f} s:\n{w.log_tail()}")
            for w in dead:
                if not w.ready:
                    raise RuntimeError(f"reward worker for {self.scorer} failed to start:\n{w.log_tail()}")
                if w.task is not None:
                    if now < w.deadline:
                        self.crashes += 1
                    results[w.task] = self.default
                    remaining -= 1
                w.kill()
                self._workers[self._workers.index(w)] = _Worker(self.scorer)
        return [float(r) for r in results]


def serve(scorer: str, die_with_parent: str = "1") -> None:
    """Worker main loop: JSON lines in on stdin, out on a private copy of stdout. The scorer's own
    prints go to stderr so they cannot corrupt the protocol. When started from the trainer's main
    thread the kernel kills the worker if the trainer dies (a stuck sample would outlive it)."""
    if die_with_parent == "1" and sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    module, _, name = scorer.partition(":")
    fn = getattr(importlib.import_module(module), name)
    warmup = getattr(importlib.import_module(module), "warmup", None)
    if warmup is not None:
        warmup()
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            score = float(fn(*msg["args"]))
        except Exception:  # noqa: BLE001 - a scorer error scores the default like a timeout
            score = None
        out.write(json.dumps({"id": msg["id"], "score": score}) + "\n")
