"""`megatron-alp train CONFIG.yaml [key=value ...]`: RL training (:class:`~megatron_alp.trainer.trainer.RLTrainer`).

Every input is checked and the run directory locked before anything else happens, so a refused
start changes nothing, not even the log of a run already using the directory. Ctrl-C stops the
run with one line saying where it resumes; SIGTERM or SIGUSR1 (a cluster's preemption notice) stops
it after the current iteration with a checkpoint and exits with the requeue code
(:mod:`megatron_alp.runtime.preemption`).
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_alp.commands.context import library_log
from megatron_alp.resolve import load_config
from megatron_alp.runtime.console import held_warnings, log_name, say
from megatron_alp.runtime.preemption import EXIT_REQUEUE, Preempted, record_exit
from megatron_alp.runtime.process import forks_die_with_their_parent
from megatron_alp.trainer.trainer import RLTrainer
from megatron_alp.training.dist_checkpoint import latest_checkpoint

EXIT_INTERRUPTED = 130  # the shell's code for a run stopped by SIGINT


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML config file (see docs/configuration.md)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides, e.g. loss.name=alp_seq")


def run(args) -> int:
    # Validation imports the registered engines (and with them Megatron-Core), whose import-time
    # warnings belong in the run's log, which only the validated config locates: hold them until then.
    with held_warnings():
        cfg = load_config(args.config, args.overrides)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    trainer = RLTrainer(cfg)
    trainer.claim_run_dir()
    trainer.stop.install()
    code = 0
    with library_log(Path(cfg.trainer.output_dir) / "logs" / log_name(), None, announce=rank0):
        forks_die_with_their_parent()
        try:
            trainer.setup()
            trainer.train()
        except KeyboardInterrupt:
            if rank0:
                say(interrupted(trainer))
            code = EXIT_INTERRUPTED
        except Preempted as stop:
            if rank0:
                say(f"preempted ({stop})")
            code = EXIT_REQUEUE
        finally:
            trainer.close()
    record_exit(code)
    return code


def interrupted(trainer: RLTrainer) -> str:
    """Where an interrupted run stands, and where the same command takes it up."""
    ckpt = latest_checkpoint(trainer.run_dir)
    where = f"resume from {ckpt.name}" if ckpt is not None else "start from the beginning (no checkpoint yet)"
    return f"interrupted at iteration {trainer.iteration}; rerun the same command to {where}"
