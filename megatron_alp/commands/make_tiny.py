"""`megatron-alp make-tiny FAMILY OUT_DIR`: a tiny random Hugging Face model of a registered family
and the local tokenizer, as an ordinary model directory (tests, quickstarts, trying a config)."""

from __future__ import annotations

from megatron_alp.models.families import FAMILIES
from megatron_alp.models.tiny import make_tiny_model


def add_arguments(parser) -> None:
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def run(args) -> int:
    print(make_tiny_model(args.family, args.out_dir, seed=args.seed, dtype=args.dtype))
    return 0
