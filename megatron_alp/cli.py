"""`megatron-alp` command line: one subcommand per job, each a module of :mod:`megatron_alp.commands`
(``convert``: :mod:`checkpoint_tools.cli`).

Bad input (:class:`~megatron_alp.config.InputError`: a config key, a data file, an argument, or a
path that does not exist) is reported as one message on stderr with exit status 2; a traceback
means a bug, and ``--debug`` (or ``MEGATRON_ALP_DEBUG=1``) shows it for bad input too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from megatron_alp.config import InputError
from megatron_alp.runtime.console import held_warnings

# subcommand -> (module, help). Each module defines add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "train": ("megatron_alp.commands.train", "Run RL training (GRPO/ALP) from a YAML config."),
    "eval": ("megatron_alp.commands.eval", "average@k / pass@k on math benchmarks."),
    "mismatch": ("megatron_alp.commands.mismatch", "Training-inference mismatch of the config's engine settings (no training)."),
    "intervene": ("megatron_alp.commands.intervene", "One update from one checkpoint twice, with and without ALP noise: the "
                  "log-ratio envelope after each (paper Figure 3)."),
    "plot": ("megatron_alp.commands.plot", "Draw the diagnostic figures of a run directory."),
    "convert": ("checkpoint_tools.cli", "Convert and verify HF <-> Megatron checkpoints."),
    "smoke": ("megatron_alp.commands.smoke", "Tiny model, one perturbed forward/backward (install check)."),
    "make-tiny": ("megatron_alp.commands.make_tiny", "Write a tiny random HF model + tokenizer directory."),
    "plan": ("megatron_alp.commands.plan", "Per-GPU memory of each phase of a config, and whether it fits."),
    "config-docs": ("megatron_alp.commands.config_docs", "Print the configuration reference (Markdown)."),
}

EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = os.environ.get("MEGATRON_ALP_DEBUG", "") not in ("", "0")
    if argv and argv[0] == "--debug":
        debug, argv = True, argv[1:]
    parser = argparse.ArgumentParser(prog="megatron-alp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for bad input too")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
    with held_warnings():  # import-time warnings of the libraries belong in the command's log
        module = importlib.import_module(COMMANDS[argv[0]][0])
    cmd_parser = argparse.ArgumentParser(prog=f"megatron-alp {argv[0]}", description=COMMANDS[argv[0]][1])
    module.add_arguments(cmd_parser)
    try:
        args = cmd_parser.parse_intermixed_args(argv[1:])  # KEY=VALUE overrides may follow options too
    except TypeError:  # argparse cannot intermix a command with sub-commands (`convert`)
        args = cmd_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except (InputError, FileNotFoundError) as err:
        if debug:
            raise
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank fails alike: say it once
            print(f"megatron-alp {argv[0]}: error: {err}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
