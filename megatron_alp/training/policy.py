"""The trained policy and its frozen reference, built for this rank's layout and loaded the same
way for every caller (the trainer, ``mismatch``, ``intervene``, the benchmarks).

Weights come from a Hugging Face directory or a megatron-alp checkpoint (a Megatron distributed
checkpoint, as training and ``megatron-alp convert`` write them); :func:`load_weights` tells them
apart by their files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron.core.utils import unwrap_model

from megatron_alp.config import Config, InputError, ParallelConfig, PerturbationConfig
from megatron_alp.models.families import MegatronModelArgs
from megatron_alp.models.hf_weights import load_hf_weights
from megatron_alp.training.builder import build_gpt_model
from megatron_alp.training.dist_checkpoint import META_FILE, load_checkpoint
from megatron_alp.training.optim import build_optimizer, wrap_for_training


def weights_kind(path: str | Path, key: str = "weights") -> str:
    """``megatron`` for a megatron-alp checkpoint directory, ``hf`` for a Hugging Face model
    directory; :class:`InputError` naming ``key`` (where the path came from) for anything else."""
    p = Path(path)
    if (p / META_FILE).is_file():
        return "megatron"
    if (p / "config.json").is_file():
        return "hf"
    raise InputError(f"{key} {p}: expected a megatron-alp checkpoint directory (RUN/checkpoints/iter_N, with "
                     f"{META_FILE}) or a Hugging Face model directory (with config.json)")


def load_weights(model, source: str | Path, *, strict: bool = True) -> None:
    """Load ``source``'s weights into ``model`` (any layout). ``strict`` applies to checkpoints
    (:func:`~megatron_alp.training.dist_checkpoint.load_checkpoint`)."""
    if weights_kind(source) == "megatron":
        load_checkpoint(source, model, strict=strict)
    else:
        load_hf_weights(model, source)


def build_reference(args: MegatronModelArgs, cfg: Config, source: str | Path,
                    parallel: Optional[ParallelConfig] = None, perturbation: Optional[PerturbationConfig] = None):
    """The frozen model of ``source``'s weights (the KL reference, a scorer): unperturbed, or with
    ``perturbation``'s sites for a sigma calibration's perturbed passes."""
    model = build_gpt_model(args, cfg.model, parallel or cfg.parallel, perturbation=perturbation, moe=cfg.moe)
    load_weights(model, source, strict=False)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@dataclass
class Policy:
    """The trained model (wrapped for training: DDP and, in half precision, Float16Module), its
    optimizer and learning-rate scheduler."""

    model: Any
    optimizer: Any
    scheduler: Any

    @property
    def module(self):
        """The bare GPTModel (checkpoints, weight export)."""
        return unwrap_model(self.model)


def build_policy(args: MegatronModelArgs, cfg: Config, model_dir: str | Path, total_steps: int,
                 resuming: bool = False) -> Policy:
    """The policy with ALP's perturbation sites (and ``lora``'s adapters on a frozen base), initialised
    from ``model.load`` when set, else from ``model_dir``. HF weights are loaded before the optimizer is built (a half-precision model's
    optimizer copies them into its fp32 main parameters); a checkpoint is loaded after, and the
    main parameters are then copied from it again, or the first step would put back the weights
    the optimizer was built with. ``resuming``: the caller loads a checkpoint of the run with its
    optimizer state next, which replaces every weight and main parameter, so no initial weights are read."""
    module = build_gpt_model(args, cfg.model, cfg.parallel, cfg.perturbation, moe=cfg.moe, lora=cfg.lora)
    if cfg.model.load is None and not resuming:
        load_hf_weights(module, model_dir)
    model = wrap_for_training(module, cfg.parallel)
    optimizer, scheduler = build_optimizer(model, cfg.optimizer, cfg.perturbation, cfg.parallel, total_steps)
    if cfg.model.load is not None and not resuming:
        load_checkpoint(cfg.model.load, unwrap_model(model), strict=True)
        optimizer.reload_model_params()
    return Policy(model, optimizer, scheduler)
