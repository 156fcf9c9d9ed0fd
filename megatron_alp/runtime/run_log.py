"""Per-iteration metrics of a run: JSONL (the source of truth), the experiment trackers of
``trainer.loggers`` (:mod:`megatron_alp.runtime.trackers`), and the console: a progress bar with ETA
on a terminal, one plain line per iteration elsewhere (SLURM, nohup, a pipe). Only global rank 0
writes.

A record's ``iteration`` is the iteration it describes; ``-1`` is the run's start (the base
model's validation, before any update).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np

from megatron_alp.runtime.console import progress_stream, say
from megatron_alp.runtime.trackers import TRACKERS

METRICS_FILE = "metrics.jsonl"
HEADLINE = ("reward/mean", "val/reward_mean", "ratio/p98", "mismatch/kl_k3", "sigma/mean", "staleness/mean")


class RunLogger:
    def __init__(self, run_dir: Path, *, total_iterations: int, start_iteration: int, trackers: list[str],
                 tracker_settings: dict, progress_bar: bool, config: dict):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        _truncate_after(self.path, start_iteration)
        self.total, self.start, self.started = total_iterations, start_iteration, time.time()
        self.trackers = [TRACKERS[name](self.run_dir, config, tracker_settings) for name in trackers]
        self.bar = None
        if progress_bar and progress_stream().isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_iterations, initial=start_iteration, unit="it", dynamic_ncols=True,
                            file=progress_stream())

    def log(self, iteration: int, metrics: dict) -> None:
        record = {"iteration": iteration, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        for tracker in self.trackers:
            tracker.log(int(record.get("step", max(iteration, 0))), numbers)
        shown = {k: record[k] for k in HEADLINE if isinstance(record.get(k), (int, float))}
        if iteration < 0:
            say("base model: " + " ".join(f"{k}={v:.4g}" for k, v in shown.items()))
        elif self.bar is not None:
            self.bar.set_postfix({k.split("/")[0] if k != "ratio/p98" else "p98": f"{v:.3g}" for k, v in shown.items()})
            self.bar.update(1)
        else:
            done = iteration + 1 - self.start
            eta = (time.time() - self.started) / max(done, 1) * (self.total - iteration - 1)
            say(f"iteration {iteration} of {self.total} (ETA {_duration(eta)}): "
                + " ".join(f"{k}={v:.4g}" for k, v in shown.items()))

    def figures(self, paths: dict[str, Path]) -> None:
        for tracker in self.trackers:
            tracker.figures(paths)

    def summary(self, values: dict[str, float]) -> None:
        for tracker in self.trackers:
            tracker.summary(values)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for tracker in self.trackers:
            tracker.close()


def _duration(seconds: float) -> str:
    """``1h02m``, ``4m12s``, ``9s``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def read_metrics(path: str | Path) -> tuple[list[dict], int]:
    """The records of a ``metrics.jsonl`` (or of a run directory's) and the count of unreadable
    lines (e.g. one cut short by a kill); no records when there is no file."""
    path = Path(path)
    path = path / METRICS_FILE if path.is_dir() else path
    if not path.is_file():
        return [], 0
    records, bad = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad += 1
    return records, bad


def save_token_probs(run_dir: Path, iteration: int, train_prob: np.ndarray, rollout_prob: np.ndarray) -> None:
    """Token-level train vs rollout probabilities of one iteration, for the scatter plot."""
    out = Path(run_dir) / "token_probs"
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".iter_{iteration:06d}.npz.tmp"
    with open(tmp, "wb") as f:
        np.savez_compressed(f, train_prob=train_prob.astype(np.float32), rollout_prob=rollout_prob.astype(np.float32))
    os.replace(tmp, out / f"iter_{iteration:06d}.npz")


def _truncate_after(path: Path, start_iteration: int) -> None:
    """A resumed run re-does iterations after its checkpoint: drop their old lines first (a start
    from iteration 0 drops every line, the base model's validation too: it is done again)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if start_iteration > 0 and json.loads(line).get("iteration", -1) < start_iteration:
                keep.append(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def _plain(v):
    if hasattr(v, "item"):
        return v.item()
    return v
