"""`megatron-alp train CONFIG.yaml [key=value ...]`: RL training (:class:`~megatron_alp.trainer.RLTrainer`)."""

from __future__ import annotations

import os
from pathlib import Path

from megatron_alp.commands.context import library_log
from megatron_alp.resolve import load_config
from megatron_alp.runtime.console import held_warnings, log_name
from megatron_alp.runtime.process import forks_die_with_their_parent
from megatron_alp.trainer.trainer import RLTrainer


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML config file (see docs/configuration.md)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides, e.g. loss.name=alp_seq")


def run(args) -> int:
    # Validation imports the registered engines (and with them Megatron-Core), whose import-time
    # warnings belong in the run's log, which only the validated config locates: hold them until then.
    with held_warnings():
        cfg = load_config(args.config, args.overrides)
    log = Path(cfg.trainer.output_dir) / "logs" / log_name()
    with library_log(log, None, announce=int(os.environ.get("RANK", "0")) == 0):
        forks_die_with_their_parent()
        trainer = RLTrainer(cfg)
        try:
            trainer.setup()
            trainer.train()
        finally:
            trainer.close()
    return 0
