"""The `megatron-alp` commands, one module each, the session they work in (:mod:`.session`) and the
context they share (:mod:`.context`).

:data:`COMMANDS` is the one list of them: the CLI dispatches from it and ``megatron-alp config-docs``
writes the commands reference from the same parsers (:func:`command_parser`)."""

from __future__ import annotations

import argparse
import importlib

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
    "config-docs": ("megatron_alp.commands.config_docs", "Write the generated reference pages of the documentation "
                    "(Markdown): configuration keys, losses, metrics, phases, commands."),
}


def command_parser(name: str):
    """The argument parser of command ``name`` and its module (imported here, by name: a command
    module never imports another)."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"megatron-alp {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    return parser, module
