"""Experiment trackers beside ``metrics.jsonl`` (``trainer.loggers``): TensorBoard, Weights & Biases,
MLflow. Each is one registered class that declares the package it needs and the pip command that
installs it; config resolution refuses a tracker whose package is missing, naming the key.

Every tracker gets the run's config once, each iteration's numbers, the figures whenever they are
redrawn, and the run's summary at the end. Only global rank 0 tracks. Tracker libraries are
imported when a tracker starts: they are optional, and none is needed to train.
"""

from __future__ import annotations

import abc
import importlib.util
import os
from pathlib import Path
from typing import ClassVar, Optional


class Tracker(abc.ABC):
    package: ClassVar[str]  # the import name the tracker needs
    pip: ClassVar[str]  # what installs it

    @abc.abstractmethod
    def __init__(self, run_dir: Path, config: dict, settings: dict):
        """Start tracking the run in ``run_dir`` with its (resolved) ``config``; ``settings``: the
        ``trainer`` section's tracker keys."""

    @abc.abstractmethod
    def log(self, step: int, values: dict[str, float]) -> None:
        """One iteration's finite numbers at ``step`` (the optimizer step)."""

    def figures(self, paths: dict[str, Path]) -> None:
        """The run's figures, redrawn (PNG files)."""

    def summary(self, values: dict[str, float]) -> None:
        """The run's summary numbers, at its end."""

    def close(self) -> None:
        """Flush and end the tracker's run."""


TRACKERS: dict[str, type[Tracker]] = {}


def register_tracker(name: str):
    def deco(cls):
        TRACKERS[name] = cls
        return cls

    return deco


def missing_package(name: str) -> Optional[str]:
    """The pip command that installs tracker ``name``'s package, when it is not installed."""
    cls = TRACKERS[name]
    return None if importlib.util.find_spec(cls.package) is not None else cls.pip


@register_tracker("tensorboard")
class TensorBoard(Tracker):
    package, pip = "tensorboard", "pip install tensorboard"

    def __init__(self, run_dir: Path, config: dict, settings: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.figure_steps: dict[str, int] = {}

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def figures(self, paths: dict[str, Path]) -> None:
        import numpy as np
        from PIL import Image

        for name, path in paths.items():
            step = self.figure_steps[name] = self.figure_steps.get(name, -1) + 1
            self.writer.add_image(f"figures/{name}", np.asarray(Image.open(path).convert("RGB")), step, dataformats="HWC")
        self.writer.flush()

    def summary(self, values: dict[str, float]) -> None:
        self.writer.add_text("summary", "\n".join(f"{k}: {v:.6g}" for k, v in values.items()))

    def close(self) -> None:
        self.writer.close()


@register_tracker("wandb")
class WandB(Tracker):
    package, pip = "wandb", "pip install wandb"

    def __init__(self, run_dir: Path, config: dict, settings: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=settings["wandb_project"], dir=str(run_dir), config=config, resume="allow",
                              mode=settings["wandb_mode"], name=run_dir.resolve().name)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def figures(self, paths: dict[str, Path]) -> None:
        self.run.log({f"figures/{name}": self.wandb.Image(str(path)) for name, path in paths.items()})

    def summary(self, values: dict[str, float]) -> None:
        self.run.summary.update(values)

    def close(self) -> None:
        self.run.finish()


@register_tracker("mlflow")
class MLflow(Tracker):
    package, pip = "mlflow", "pip install mlflow-skinny"

    def __init__(self, run_dir: Path, config: dict, settings: dict):
        import mlflow

        self.mlflow = mlflow
        uri = settings["mlflow_tracking_uri"]
        if uri is None:
            # no server named: a file store in the run directory, which MLflow 3 serves only on request
            # (its database store needs the full mlflow package and SQLAlchemy)
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(settings["mlflow_experiment"])
        # a resumed run goes on in the same MLflow run: its id is kept in the run directory
        run_id_file = run_dir / "mlflow_run_id"
        if run_id_file.exists():
            self.run = mlflow.start_run(run_id=run_id_file.read_text().strip())
        else:
            self.run = mlflow.start_run(run_name=run_dir.resolve().name)
            run_id_file.write_text(self.run.info.run_id)
            mlflow.log_params({k: str(v)[:500] for k, v in _flat(config).items()})

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics({_mlflow_key(k): v for k, v in values.items()}, step=step)

    def figures(self, paths: dict[str, Path]) -> None:
        for path in paths.values():
            self.mlflow.log_artifact(str(path), artifact_path="figures")

    def summary(self, values: dict[str, float]) -> None:
        self.mlflow.log_metrics({_mlflow_key(k): v for k, v in values.items()})

    def close(self) -> None:
        self.mlflow.end_run()


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _mlflow_key(key: str) -> str:
    """MLflow metric names take letters, digits and ``_-./ `` only (``pass@4`` does not)."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)
