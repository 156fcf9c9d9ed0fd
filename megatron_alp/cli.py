"""`megatron-alp` command line: one subcommand per job, each a module of :mod:`megatron_alp.commands`
(``convert``: :mod:`checkpoint_tools.cli`).

Bad input (:class:`~megatron_alp.config.InputError`: a config key, a data file, an argument, or a
path that does not exist) is reported as one message on stderr with exit status 2; a traceback
means a bug, and ``--debug`` (or ``MEGATRON_ALP_DEBUG=1``) shows it for bad input too.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import version

from megatron_alp.commands import COMMANDS, command_parser
from megatron_alp.config import InputError
from megatron_alp.runtime.console import held_warnings

EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = os.environ.get("MEGATRON_ALP_DEBUG", "") not in ("", "0")
    if argv and argv[0] == "--debug":
        debug, argv = True, argv[1:]
    parser = argparse.ArgumentParser(prog="megatron-alp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for bad input too")
    parser.add_argument("--version", action="version", version=f"megatron-alp {version('megatron-alp')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if argv[:1] in (["-h"], ["--help"], ["--version"]):
        try:
            parser.parse_args(argv[:1])
        except SystemExit as done:  # argparse exits once it has printed the help or the version
            return int(done.code or 0)
    if not argv:
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
    with held_warnings():  # import-time warnings of the libraries belong in the command's log
        cmd_parser, module = command_parser(argv[0])
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
