"""The rollout API the trainer calls collectively: one engine for the job, results on every rank.

Placement: a single engine, owned by global rank 0. The other ranks take part in every call and
receive results (and errors) by broadcast over a gloo group, so they hold no engine memory and
a failure raises the same error everywhere instead of leaving ranks waiting.

- One-rank jobs run vLLM in process: it starts in seconds and weights arrive in memory.
  Unseeded, its sampling draws from this process's torch RNG, which the trainer seeds every
  iteration; an engine subprocess's draws also depend on when requests reach it. With
  per-sample seeds (``SamplingParams.seed``, on by default on the CPU) both sample the same.
- Under torchrun, vLLM runs in its engine-core subprocess on rank 0 (an in-process vLLM would
  adopt the trainer's default process group and wait for the other ranks); weights go through
  a safetensors folder in ``rollout.sync_dir`` (/dev/shm by default). On GPUs the same layout
  colocates the engine with training: it takes ``gpu_memory_utilization`` of the first
  ``tensor_parallel_size`` GPUs and sleeps (weights offloaded, KV cache freed) while Megatron
  trains when ``free_memory_during_training`` is set. vLLM's ``external_launcher`` SPMD mode (one
  engine shard per trainer rank, weights handed over in memory on every rank) would remove the
  rank-0 funnel; it runs here on the CPU but is not wired in, because the engine's parallel
  groups would then live in the trainer's process group, and an engine failure could not be
  recovered by restarting it.

Weight sync streams :func:`megatron_alp.models.hf_weights.iter_hf_weights` (TP/PP/EP gathered in
``sync_bucket_mb`` buckets, ALP sigmas skipped) into the engine; with ``verify_sync`` a short
sampled probe is scored by the engine and by the Megatron model and must agree.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_alp.comm import cpu_group
from megatron_alp.config import RolloutConfig
from megatron_alp.rollout.base import (
    Completion,
    EngineRestarted,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    Trajectory,
    get_engine,
    resolve_max_model_len,
)
from megatron_alp.rollout.weight_sync import WeightStream, default_verify_tolerance


# (model, probe trajectories) -> mismatch_stats of the engine's logprobs vs the model's, on every rank.
# The trainer supplies it (megatron_alp.policy_update.probe_mismatch): scoring is a training pass.
Scorer = Callable[[Any, list[Trajectory]], dict]


def build_engine(cfg: RolloutConfig, model_dir: str, seed: int) -> RolloutEngine:
    """The engine registered under ``cfg.engine`` (``vllm``, ``sglang``), started on ``model_dir``."""
    return get_engine(cfg.engine)(cfg, model_dir, seed)


def _single(models):
    if isinstance(models, (list, tuple)):
        if len(models) != 1:
            raise ValueError(f"weight sync takes one model chunk per rank (got {len(models)}; virtual "
                             "pipeline stages are not supported)")
        return models[0]
    return models


class DistributedRollout:
    """Every trainer rank calls every method (collective); see the module docstring."""

    def __init__(self, cfg: RolloutConfig, model_dir: str, seed: int, scorer: Optional[Scorer] = None):
        self.cfg = cfg
        self.model_dir = str(model_dir)
        self.scorer = scorer
        self.multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.multi else 0
        # CPU-side broadcasts of Python objects, also on NCCL jobs. The other ranks wait in them
        # while rank 0 generates, retries and restarts the engine; rank 0 bounds all of that itself
        # (attempt timeouts that scale with the batch, retries) and broadcasts its errors, so the wait
        # only needs to end a rank 0 stuck outside the engine.
        wait = 24 * 3600
        self.group = cpu_group(timeout=timedelta(seconds=wait)) if self.multi else None
        self.engine: Optional[RolloutEngine] = None
        self._models = None
        error = None
        if self.rank == 0:
            try:
                self.engine = build_engine(cfg, model_dir, seed)
            except Exception as err:
                error = err
        self._raise_everywhere(error, "starting the rollout engine")

    # ---------------------------------------------------------------------------- plumbing

    def _broadcast(self, obj: Any) -> Any:
        if not self.multi:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _raise_everywhere(self, error: Optional[BaseException], what: str) -> None:
        """Re-raise rank 0's error on rank 0 and as a RolloutError on the other ranks."""
        message = None if error is None else f"{type(error).__name__}: {error}"
        message = self._broadcast(message)
        if message is None:
            return
        if error is not None:
            raise error
        raise RolloutError(f"{what} failed on rank 0: {message}")

    # ---------------------------------------------------------------------------- rollouts

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt, identical on every rank."""
        resyncs = 0
        while True:
            outcome: tuple = ("ok", None)
            error = None
            if self.rank == 0:
                try:
                    outcome = ("ok", self.engine.generate(prompts, params))
                except EngineRestarted as err:
                    outcome, error = ("resync", str(err)), err
                except Exception as err:
                    outcome, error = ("error", f"{type(err).__name__}: {err}"), err
            status, payload = self._broadcast(outcome)
            if status == "ok":
                return payload
            if status == "resync" and self._models is not None and resyncs < self.cfg.max_retries:
                resyncs += 1
                self.sync_weights(self._models)
                continue
            if error is not None:
                raise error
            raise RolloutError(f"generation failed on rank 0: {payload}")

    def sync_weights(self, models) -> dict:
        """Stream the trainer's weights into the engine; returns ``sync/*`` statistics."""
        from megatron_alp.models.hf_weights import iter_hf_weights

        model = _single(models)
        t0 = time.time()
        stream = WeightStream(iter_hf_weights(model, self.cfg.sync_bucket_mb << 20))
        error = None
        if self.rank == 0:
            try:
                self.engine.update_weights(stream)
            except Exception as err:
                error = err
        stream.drain()  # every rank reaches the end of the collective, even after an engine error
        self._raise_everywhere(error, "weight sync")
        self._models = models
        stats = {"sync/seconds": time.time() - t0, "sync/bytes": float(stream.bytes),
                 "sync/tensors": float(stream.tensors)}
        if self.cfg.verify_sync:
            stats.update(self.verify(model))
        return stats

    def verify(self, model) -> dict:
        """Sample a short probe from the engine and score it with the Megatron model (``scorer``):
        the engine must report the trainer's logprobs (within ``rollout.verify_tolerance``)."""
        if self.scorer is None:
            raise RolloutError("rollout.verify_sync needs the trainer's scorer: DistributedRollout(..., scorer=...)")
        vocab = self._vocab_size()
        prompts = [[3 + (7 * i + 13 * k) % (vocab - 3) for k in range(8)] for i in range(4)]
        groups = self.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=16))
        stats = self.scorer(model, [Trajectory.from_completion(c) for g in groups for c in g])
        trainer_dtype = next(model.parameters()).dtype
        tol = self.cfg.verify_tolerance or default_verify_tolerance(
            self.cfg.dtype, self.cfg.quantization, self.cfg.kv_cache_dtype, trainer_dtype)
        if not stats["mean"] <= tol:
            raise RolloutError(
                f"weight sync verification failed: engine and trainer logprobs differ by mean "
                f"{stats['mean']:.3e} (max {stats['max']:.3e}) over {stats['tokens']} probe tokens, "
                f"above rollout.verify_tolerance={tol:g}; the engine does not hold the trainer's weights"
            )
        return {"sync/verify_mean_abs_diff": stats["mean"], "sync/verify_max_abs_diff": stats["max"]}

    def _vocab_size(self) -> int:
        from megatron_alp.models.families import load_hf_config

        return int(load_hf_config(self.model_dir)["vocab_size"])

    @property
    def max_model_len(self) -> int:
        """The engine's context length (prompt + response), known on every rank."""
        from megatron_alp.models.families import load_hf_config

        return resolve_max_model_len(self.cfg, load_hf_config(self.model_dir))

    # --------------------------------------------------------------------------- lifecycle

    def sleep(self) -> None:
        if self.engine is not None:
            self.engine.sleep()

    def wake_up(self) -> None:
        if self.engine is not None:
            self.engine.wake_up()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
