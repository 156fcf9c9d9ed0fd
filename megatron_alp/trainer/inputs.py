"""Everything a run reads, checked before it creates anything.

A missing data file, a bad row, a model directory without its config, an output directory that
is a file or a batch that does not split over the data-parallel ranks would otherwise surface after the warm start or the engine start, with a lock file, a
config and a half-made base model left behind. :func:`check_run_inputs` reads the config's paths
and every row of its data files (no tokenizer needed), and raises an
:class:`~megatron_alp.config.InputError` naming the key and the file (``file:line`` for a row).
Every rank runs it; it writes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_alp.batches.evaluation import benchmark_rows
from megatron_alp.config import Config, InputError
from megatron_alp.data.prompts import BadRows, DataError, prompt_rows
from megatron_alp.trainer.base_model import check_model_dir
from megatron_alp.training.policy import weights_kind
from megatron_alp.training.rl_batch import check_batch_layout


def check_run_inputs(cfg: Config) -> None:
    """Refuse, naming the key, what a run would fail on later: see the module docstring."""
    out = Path(cfg.trainer.output_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"trainer.output_dir {out} is a file: expected a directory (a new one, or a run's)")
    if cfg.model.hf_path is not None:
        check_model_dir(Path(cfg.model.hf_path), "model.hf_path")
    if cfg.model.load is not None and weights_kind(cfg.model.load, "model.load") != "megatron":
        raise InputError(f"model.load {cfg.model.load}: expected a megatron-alp checkpoint directory; a Hugging "
                         "Face model directory goes in model.hf_path")
    p = cfg.parallel
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % model_parallel == 0:  # a layout that does not divide is refused where the groups are made
        check_batch_layout(cfg.trainer, cfg.rollout.sampling.n, world // model_parallel)
    d = cfg.data
    if not d.train_files:
        raise DataError("data.train_files is empty: list the training prompt files (.parquet or .jsonl)")
    bad = BadRows(d.skip_bad_rows)
    for path in d.train_files:
        if not prompt_rows(path, prompt_key=d.prompt_key, answer_key=d.answer_key, system_prompt=d.system_prompt,
                           replace_system_prompt=d.replace_system_prompt, bad=bad):
            raise DataError(f"data.train_files: {path} has no usable prompt")
    if cfg.trainer.eval_interval:
        if not d.val_files:
            raise DataError("trainer.eval_interval needs data.val_files (the validation prompt files)")
        for path in d.val_files:
            benchmark_rows(path, cfg, bad)
