"""The Hugging Face directory a run starts from: ``model.hf_path``, or for a tiny model
``RUN/base_model``, created (and warm-started if asked) once per run directory.

This is the one model-directory rule: the trainer creates the tiny base model here, and every
command that needs the run's model (``eval``, ``mismatch``, ``intervene``) finds it here.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from megatron_alp.config import Config, InputError
from megatron_alp.data.prompts import PromptDataset, load_tokenizer
from megatron_alp.models.tiny import make_tiny_model
from megatron_alp.runtime.console import say
from megatron_alp.trainer.phases import PhaseRunner
from megatron_alp.trainer.warm_start import warm_start, warmup_examples


def base_model_dir(cfg: Config) -> Path:
    """``model.hf_path``, else ``trainer.output_dir/base_model`` (a tiny model's)."""
    if cfg.model.hf_path is not None:
        return Path(cfg.model.hf_path)
    return Path(cfg.trainer.output_dir) / "base_model"


def run_model_dir(cfg: Config, phases: PhaseRunner, rank: int) -> Path:
    """Collective: the directory a run's engine and Megatron model start from, the tiny base model
    made (in the ``warm_start`` phase, on rank 0) when the run directory has none yet."""
    path = base_model_dir(cfg)
    if cfg.model.hf_path is not None:
        return check_model_dir(path, "model.hf_path")
    if not (path / "config.json").is_file():
        phases.enter("warm_start")
        if rank == 0:
            make_base_model(cfg, path)
    dist.barrier()
    return path


def check_model_dir(path: Path, key: str, hint: str = "") -> Path:
    """``path`` if it is a Hugging Face model directory, else an :class:`InputError` naming ``key``
    (and ``hint``: what else the user can pass)."""
    if not (Path(path) / "config.json").is_file():
        raise InputError(f"{key}: {path} has no config.json (expected a Hugging Face model directory{hint})")
    return Path(path)


def make_base_model(cfg: Config, path: Path) -> None:
    """Create the tiny ``model.tiny`` model at ``path`` and, with ``trainer.sft_warmup_steps``, warm
    start it on the training answers; written beside and moved into place, so a kill leaves none."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        make_tiny_model(cfg.model.tiny, tmp, seed=cfg.trainer.seed, **cfg.model.tiny_config)
        if cfg.trainer.sft_warmup_steps:
            tok = load_tokenizer(tmp)
            data = PromptDataset.from_config(cfg.data, tok, cfg.rollout.sampling.max_prompt_length, split="train")
            examples = warmup_examples(data, tok, cfg.trainer.sft_warmup_format, cfg.tir.tool_format,
                                       unboxed=cfg.trainer.sft_warmup_unboxed, seed=cfg.trainer.seed)
            stats = warm_start(tmp, examples, tok, steps=cfg.trainer.sft_warmup_steps, lr=cfg.trainer.sft_warmup_lr,
                               seed=cfg.trainer.seed, progress=_every(30.0, cfg.trainer.sft_warmup_steps))
            say(f"warm start: loss {stats['warmstart/first_loss']:.3f} -> {stats['warmstart/last_loss']:.3f} "
                f"in {stats['warmstart/steps']} steps")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, path)


def _every(seconds: float, steps: int):
    """A warm-start progress printer: a line every ``seconds`` (the warm start of a TIR model can
    take many minutes), never for the last step (the summary line follows)."""
    last = [time.time()]

    def show(step: int, loss: float) -> None:
        if step < steps and time.time() - last[0] >= seconds:
            last[0] = time.time()
            say(f"warm start: step {step} of {steps}, loss {loss:.3f}")

    return show
