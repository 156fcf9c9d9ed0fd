"""What every command shares before its own work: loading the config, where library output goes,
the model directory, the one-process distributed context, argument types and JSON output.

A command module defines ``add_arguments(parser)`` and ``run(args) -> int`` (see
:mod:`megatron_alp.cli`); it imports this context and the library, never another command. The
library pieces a command composes (building the policy or the reference, sampling parameters,
per-sample seeds, the batch of scored trajectories) are the ones the trainer uses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from pathlib import Path
from typing import Iterator, Optional

import torch.distributed as dist

from megatron_alp.config import Config, InputError, ParallelConfig
from megatron_alp.runtime.console import library_output_to, say
from megatron_alp.runtime.parallel import destroy_distributed, init_distributed
from megatron_alp.trainer.base_model import base_model_dir, check_model_dir


@contextlib.contextmanager
def library_log(path: Path, command: Optional[str], announce: bool = True) -> Iterator[Path]:
    """Engine and library output (the held warnings first: :func:`~megatron_alp.runtime.console.held_warnings`)
    to ``path`` for the block; the terminal keeps the command's own lines, starting with where the
    rest goes."""
    with library_output_to(path) as log:
        if announce:
            say(f"megatron-alp{' ' + command if command else ''}: engine and library output goes to {log}")
        yield log


def model_dir(cfg: Config, override: Optional[str] = None) -> Path:
    """``--model`` when given, else the run's model (:func:`~megatron_alp.trainer.base_model.base_model_dir`):
    ``model.hf_path``, or the tiny base model under ``trainer.output_dir``. It must be a Hugging Face
    model directory."""
    if override:
        return check_model_dir(Path(override), "--model")
    key = "model.hf_path" if cfg.model.hf_path is not None else "model"
    return check_model_dir(base_model_dir(cfg), key, hint="; pass --model DIR, or convert a Megatron "
                           "checkpoint with `megatron-alp convert`")


def refuse_torchrun(command: str) -> None:
    """A command that runs in one process (:func:`one_process`) refuses a start under torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise InputError(f"megatron-alp {command} runs in one process: start it without torchrun")


@contextlib.contextmanager
def one_process(seed: int) -> Iterator[None]:
    """torch.distributed and Megatron's parallel state for a command that runs in one process with
    the model unsharded (TP = PP = 1); groups that already exist are used and left alone."""
    owns_groups = not dist.is_initialized()
    init_distributed(ParallelConfig(), seed=seed)
    try:
        yield
    finally:
        if owns_groups:
            destroy_distributed()


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def json_ready(value):
    """NaN and infinity (a statistic undefined on a bucket, e.g. Pearson r of one token) as null:
    strict JSON."""
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: Path, data) -> None:
    """``data`` as strict, indented JSON at ``path``, written beside and moved into place."""
    write_text(path, json.dumps(json_ready(data), indent=2) + "\n")


def write_text(path: Path, text: str) -> None:
    """``text`` at ``path`` (folders created), written beside and moved into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
