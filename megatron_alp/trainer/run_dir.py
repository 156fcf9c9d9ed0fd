"""A run directory: one trainer at a time, one run at a time, the resolved config, checkpoints kept
and pruned.

``RUN/config.yaml`` is the config as resolved, ``RUN/checkpoints/iter_NNNNNNN`` the complete
checkpoints (written atomically by :mod:`megatron_alp.training.dist_checkpoint`), ``RUN/.lock``
the lock of the running trainer. A directory holds one run: a run started with ``trainer.resume:
false`` in a directory an earlier run left files in is refused (:func:`claim_fresh`), unless
``trainer.archive_previous`` moves those files to ``RUN/archive/<time>/`` first.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import time
from pathlib import Path

import yaml

from megatron_alp.config import Config, InputError
from megatron_alp.runtime.run_log import RunLogger
from megatron_alp.trainer.inputs import check_run_inputs


def claim_run_dir(cfg: Config, rank: int):
    """Check every input (nothing is created when one is wrong), then, on global rank 0, take the
    run directory: create it, lock it (:func:`lock_run_dir`, returned; None on other ranks) and, for
    a fresh run (``trainer.resume: false``), refuse or archive an earlier run's files."""
    check_run_inputs(cfg)
    if rank != 0:
        return None
    run_dir = Path(cfg.trainer.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_run_dir(run_dir)
    if not cfg.trainer.resume:
        claim_fresh(run_dir, archive=cfg.trainer.archive_previous)
    return lock


def lock_run_dir(run_dir: Path):
    """Hold an exclusive lock on ``run_dir`` for the life of this process (global rank 0).

    Two trainers on one run directory would interleave metrics and overwrite each other's
    checkpoints, e.g. a resume started while the killed job's workers still run (torchrun starts
    each worker in its own session, so killing the launcher's process group leaves them alive).
    The kernel drops the lock when the process dies, even by SIGKILL, so a crash never leaves a
    stale lock behind. It is a POSIX record lock, which a forked child does not inherit (an flock
    would stay held by a child that outlived the trainer, e.g. a checkpoint writer)."""
    f = open(run_dir / ".lock", "a+")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise InputError(
            f"trainer.output_dir {run_dir} is in use by another training process (pid {holder}); "
            "stop it or choose another output_dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


# what a run leaves in its directory (the lock and the logs folder are the directory's own)
RUN_FILES = ("checkpoints", "metrics.jsonl", "config.yaml", "base_model", "token_probs", "plots", "tensorboard",
             "wandb", "mlruns", "mlflow_run_id")


def previous_run(run_dir: Path) -> list[str]:
    """What an earlier run left in ``run_dir`` (empty: nothing)."""
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def claim_fresh(run_dir: Path, archive: bool) -> None:
    """Make ``run_dir`` ready for a run that does not resume (``trainer.resume: false``): refuse when
    an earlier run left files there, or with ``archive`` (``trainer.archive_previous``) move them to
    ``RUN/archive/<UTC time>/``, so the new run's metrics and checkpoints never mix with the old."""
    left = previous_run(run_dir)
    if not left:
        return
    if not archive:
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*")) if (run_dir / "checkpoints").is_dir() else []
        held = ", ".join(left) + (f" ({', '.join(ckpts)})" if ckpts else "")
        raise InputError(
            f"trainer.output_dir {run_dir} holds an earlier run ({held}) and trainer.resume is false: a fresh run "
            "would mix with it. Resume it (trainer.resume=true), choose another trainer.output_dir, or set "
            "trainer.archive_previous=true to move the earlier run to RUN/archive/ first")
    target = run_dir / "archive" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target.mkdir(parents=True, exist_ok=False)
    for name in left:
        os.replace(run_dir / name, target / name)


def write_config(run_dir: Path, cfg: Config) -> None:
    """``RUN/config.yaml``: the run's config as resolved (every default filled in)."""
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def checkpoint_dir(run_dir: Path, iteration: int) -> Path:
    return run_dir / "checkpoints" / f"iter_{iteration:07d}"


def prune_checkpoints(run_dir: Path, keep: int, upto: int) -> None:
    """Remove all but the ``keep`` newest complete checkpoints up to iteration ``upto`` (this run's
    own: a checkpoint of a later iteration is not this run's to remove)."""
    root = run_dir / "checkpoints"
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("iter_") and "." not in p.name
                  and p.name[5:].isdigit() and int(p.name[5:]) <= upto)
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def kill_during_save(ckpt_dir: Path) -> None:
    """Test hook: ``MEGATRON_ALP_KILL_DURING_SAVE=<iteration>`` SIGKILLs this process after the
    checkpoint's files are written and before it is committed, to prove resumption never trusts a
    half-written checkpoint."""
    target = os.environ.get("MEGATRON_ALP_KILL_DURING_SAVE")
    if target and Path(ckpt_dir).name.startswith(f"iter_{int(target):07d}"):
        os.kill(os.getpid(), signal.SIGKILL)


def open_run_logger(cfg: Config, start_iteration: int) -> RunLogger:
    """Rank 0's metrics log of the run (``metrics.jsonl`` cut after ``start_iteration``), with the
    trackers and progress bar ``trainer.*`` ask for."""
    t = cfg.trainer
    settings = {k: getattr(t, k) for k in ("wandb_project", "wandb_mode", "mlflow_tracking_uri", "mlflow_experiment")}
    return RunLogger(Path(t.output_dir), total_iterations=t.iterations, start_iteration=start_iteration,
                     trackers=t.loggers, tracker_settings=settings, progress_bar=t.progress_bar,
                     config=cfg.model_dump(mode="json"))
