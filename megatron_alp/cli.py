"""`megatron-alp` command line: one subcommand per job, each implemented in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module defines add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "train": ("megatron_alp.trainer", "Run RL training (GRPO/ALP) from a YAML config."),
    "eval": ("megatron_alp.evaluate", "average@k / pass@k on math benchmarks."),
    "plot": ("megatron_alp.plot", "Draw the diagnostic figures of a run directory."),
    "convert": ("checkpoint_tools.cli", "Convert and verify HF <-> Megatron checkpoints."),
    "smoke": ("megatron_alp.smoke", "Tiny model, one perturbed forward/backward (install check)."),
    "make-tiny": ("megatron_alp.models.tiny", "Write a tiny random HF model + tokenizer directory."),
    "config-docs": ("megatron_alp.config", "Print the configuration reference (Markdown)."),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="megatron-alp", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
    module = importlib.import_module(COMMANDS[argv[0]][0])
    cmd_parser = argparse.ArgumentParser(prog=f"megatron-alp {argv[0]}", description=COMMANDS[argv[0]][1])
    module.add_arguments(cmd_parser)
    return int(module.run(cmd_parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())
