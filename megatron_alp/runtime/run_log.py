"""Per-iteration metrics of a run: JSONL (the source of truth), TensorBoard, optional W&B, and a
console progress bar with ETA. Only global rank 0 writes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional

import numpy as np

from megatron_alp.runtime.console import progress_stream, say

METRICS_FILE = "metrics.jsonl"
HEADLINE = ("reward/mean", "val/reward_mean", "ratio/p98", "mismatch/kl_k3", "sigma/mean")


class RunLogger:
    def __init__(
        self,
        run_dir: Path,
        *,
        total_iterations: int,
        start_iteration: int,
        tensorboard: bool,
        wandb_project: Optional[str],
        progress_bar: bool,
        config: dict,
    ):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        _truncate_after(self.path, start_iteration)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self.wandb = None
        if wandb_project:
            import wandb

            self.wandb = wandb.init(project=wandb_project, dir=str(self.run_dir), config=config, resume="allow")
        self.bar = None
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_iterations, initial=start_iteration, unit="it", dynamic_ncols=True,
                            file=progress_stream())

    def log(self, iteration: int, metrics: dict) -> None:
        record = {"iteration": iteration, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        step = int(record.get("step", iteration))
        for key, value in record.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                if self.tb is not None:
                    self.tb.add_scalar(key, value, step)
        if self.tb is not None:
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)
        if self.bar is not None:
            self.bar.set_postfix({k.split("/")[0] if k != "ratio/p98" else "p98": f"{record[k]:.3g}"
                                  for k in HEADLINE if isinstance(record.get(k), (int, float))})
            self.bar.update(1)
        else:
            shown = " ".join(f"{k}={record[k]:.4g}" for k in HEADLINE if isinstance(record.get(k), (int, float)))
            say(f"iteration {iteration}: {shown}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def save_token_probs(run_dir: Path, iteration: int, train_prob: np.ndarray, rollout_prob: np.ndarray) -> None:
    """Token-level train vs rollout probabilities of one iteration, for the scatter plot."""
    out = Path(run_dir) / "token_probs"
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".iter_{iteration:06d}.npz.tmp"
    with open(tmp, "wb") as f:
        np.savez_compressed(f, train_prob=train_prob.astype(np.float32), rollout_prob=rollout_prob.astype(np.float32))
    os.replace(tmp, out / f"iter_{iteration:06d}.npz")


def _truncate_after(path: Path, start_iteration: int) -> None:
    """A resumed run re-does iterations after its checkpoint: drop their old lines first."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("iteration", -1) < start_iteration:
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
