"""Trainer -> rollout-engine weight transfer, and the check that engine and trainer agree.

The trainer's side is :func:`megatron_alp.models.hf_weights.iter_hf_weights`: a collective that
gathers TP/PP/EP shards in bounded buckets and yields ``(HF name, full tensor)`` on every rank.
This module adapts that stream for the engines:

- :class:`WeightStream` drops ALP sigmas (Megatron-only state; the exporter already skips them,
  this is the engine's own guard), counts tensors and bytes, and can be drained, so every rank of
  the collective reaches its end even when the engine stopped consuming early (an error).
- :func:`write_hf_checkpoint` turns a stream into a safetensors folder (the HF export's writer,
  :func:`megatron_alp.models.hf_weights.write_hf_folder`), sharded at the bucket size so memory
  stays bounded, appearing only when complete: engines in another process (vLLM's engine-core
  subprocess, the SGLang server) reload from it.
- :func:`mismatch_stats` compares engine and trainer logprobs of the same tokens: max and P98 of
  |log ratio| and the k3 estimate of KL(rollout || train), the quantities the paper tracks.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from megatron_alp.models.hf_weights import write_hf_folder
from megatron_alp.models.weight_mapping import is_sigma

# Copied next to the weights so the folder is a loadable model directory (engine restarts).
_CONFIG_FILES = ("config.json", "generation_config.json")


class WeightStream:
    """An ``(HF name, tensor)`` iterator without ALP sigmas, with byte and tensor counts."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]):
        self._source = iter(weights)
        self._gen = self._filtered()
        self.tensors = 0
        self.bytes = 0
        self.skipped: list[str] = []

    def _filtered(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._source:
            if is_sigma(name):
                self.skipped.append(name)
                continue
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._gen

    def drain(self) -> None:
        """Consume what is left (a collective source needs every rank to reach its end)."""
        for _ in self._gen:
            pass


def write_hf_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, *, bucket_bytes: int, config_dir: str | Path
) -> Path:
    """Write ``weights`` as an HF safetensors folder at ``out_dir`` (shards of about
    ``bucket_bytes``), with the config files of ``config_dir``. Atomic: the folder appears
    complete under its name or not at all. Returns ``out_dir``."""

    def add_config(tmp: Path) -> None:
        for cfg in _CONFIG_FILES:
            if (Path(config_dir) / cfg).is_file():
                shutil.copyfile(Path(config_dir) / cfg, tmp / cfg)

    return write_hf_folder(weights, out_dir, max_shard_bytes=bucket_bytes, add_files=add_config)


def default_sync_root(configured: str | None) -> Path:
    """The folder weight checkpoints for out-of-process engines go to: ``rollout.sync_dir``, else
    /dev/shm (memory-backed, no disk traffic) when writable, else the temp folder."""
    import tempfile

    if configured:
        root = Path(configured)
    elif os.access("/dev/shm", os.W_OK):
        root = Path("/dev/shm")
    else:
        root = Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="megatron-alp-weights-", dir=root))


def _flat(values) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().double().reshape(-1).cpu()
    out: list[float] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.extend(float(x) for x in v)
        else:
            out.append(float(v))
    return torch.tensor(out, dtype=torch.float64)


def mismatch_stats(engine_logprobs: Sequence | torch.Tensor, trainer_logprobs: Sequence | torch.Tensor) -> dict:
    """Mismatch between the rollout engine and the trainer on the same sampled tokens.

    Both arguments hold one logprob per token (flat, or nested per sequence, same layout). With
    ``r = trainer - engine`` (the log importance ratio): ``max`` and ``p98`` of ``|r|``, its mean,
    and ``k3 = mean(exp(r) - 1 - r)``, the non-negative estimate of KL(rollout || train) from
    tokens sampled by the engine."""
    e, t = _flat(engine_logprobs), _flat(trainer_logprobs)
    if e.shape != t.shape:
        raise ValueError(f"engine and trainer logprobs differ in length: {e.numel()} vs {t.numel()} tokens")
    if e.numel() == 0:
        raise ValueError("no tokens to compare")
    if not (torch.isfinite(e).all() and torch.isfinite(t).all()):
        raise ValueError("non-finite logprobs: the engine or the trainer produced NaN/inf")
    r = t - e
    a = r.abs()
    return {
        "max": a.max().item(),
        "p98": torch.quantile(a, 0.98).item(),
        "mean": a.mean().item(),
        "k3": (torch.expm1(r) - r).mean().item(),
        "tokens": int(r.numel()),
    }


def format_mismatch(label: str, stats: dict) -> str:
    return (f"{label:<28} max|log r| {stats['max']:.3e}  p98|log r| {stats['p98']:.3e}  "
            f"mean|log r| {stats['mean']:.3e}  k3 KL {stats['k3']:.3e}  ({stats['tokens']} tokens)")


def default_verify_tolerance(engine_dtype: str, quantization: str, kv_cache_dtype: str,
                             trainer_dtype: torch.dtype) -> float:
    """Mean |log ratio| a correct sync stays under on the probe: float32 on both sides agrees to
    rounding; lower precision or quantization on either side is allowed a few percent."""
    exact = engine_dtype == "float32" and quantization == "none" and kv_cache_dtype == "auto"
    return 1e-3 if exact and trainer_dtype == torch.float32 else 0.05


def is_finite(values: Sequence[float]) -> bool:
    return all(math.isfinite(v) for v in values)
