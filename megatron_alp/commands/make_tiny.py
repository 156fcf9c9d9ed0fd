"""`megatron-alp make-tiny FAMILY OUT_DIR`: a tiny random Hugging Face model of a registered family
and the local tokenizer, as an ordinary model directory (tests, quickstarts, trying a config).
Library output goes to ``OUT_DIR.log`` beside it."""

from __future__ import annotations

from pathlib import Path

from megatron_alp.commands.context import library_log
from megatron_alp.models.families import FAMILIES
from megatron_alp.models.tiny import make_tiny_model
from megatron_alp.runtime.console import say


def add_arguments(parser) -> None:
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def run(args) -> int:
    out = Path(args.out_dir).absolute()
    log = out.with_name(f"{out.name}.log")
    with library_log(log, None, announce=False):
        make_tiny_model(args.family, out, seed=args.seed, dtype=args.dtype)
    say(f"wrote a tiny {args.family} model and its tokenizer to {out} (library output in {log})")
    return 0
