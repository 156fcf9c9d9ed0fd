"""`megatron-alp plot RUN_DIR [RUN_DIR ...]`: draw the diagnostic figures of run directories
(:mod:`megatron_alp.diagnostics.figures`), several overlaid."""

from __future__ import annotations

from megatron_alp.diagnostics.figures import make_plots


def add_arguments(parser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run directory with metrics.jsonl; several are overlaid")
    parser.add_argument("--iteration", type=int,
                        help="iteration of the token-probability scatter (default: the latest dump)")
    parser.add_argument("--out", help="folder for the PNGs (default: RUN_DIR/plots of the first run)")


def run(args) -> int:
    written = make_plots(args.run_dirs, args.out, args.iteration)
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0
