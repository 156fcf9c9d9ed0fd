"""What a weight sync sends, chosen once per run (:func:`weight_source`).

- :class:`FullWeights`: the whole model, HF-named (:func:`~megatron_alp.models.hf_weights.iter_hf_weights`:
  TP/PP/EP gathered in ``rollout.sync_bucket_mb`` buckets, ALP sigmas skipped, LoRA merged), into the
  engine's ``update_weights``.
- :class:`AdapterWeights` (``lora.sync: adapter``): the PEFT-named LoRA factors, into the engine's
  ``update_adapter``.
- :class:`DeltaWeights` (``rollout.sync_delta``): only the elements that changed since the last sync
  travel from the trainer ranks to the replica leaders, which rebuild the changed tensors and feed
  them to ``update_weights`` like a full sync (:mod:`~megatron_alp.models.hf_delta`); every
  ``rollout.sync_delta_anchor``-th sync, and any after :meth:`WeightSource.reset`, is a full one.

Every rank calls :meth:`WeightSource.tensors` (a collective); only the replica leaders listed
receive tensors and feed their engine.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Iterable, Optional

import torch

from megatron_alp.config import LoRAConfig, RolloutConfig
from megatron_alp.models.hf_delta import DeltaExport, DeltaMismatch
from megatron_alp.models.hf_weights import iter_hf_weights
from megatron_alp.models.lora_export import peft_adapter_config, peft_adapter_tensors
from megatron_alp.rollout.base import Adapter, RolloutEngine

Pairs = Iterable[tuple[str, torch.Tensor]]


class WeightSource(abc.ABC):
    """One kind of weight sync payload: what every rank streams and how a leader's engine takes it."""

    what: ClassVar[str] = "weight sync"  # in error messages

    @abc.abstractmethod
    def tensors(self, model, leaders: list[int]) -> Pairs | Adapter:
        """Collective on every rank: the payload on the ``leaders`` (global ranks), nothing needed elsewhere."""

    @abc.abstractmethod
    def feed(self, engine: RolloutEngine, stream: Pairs) -> None:
        """Hand one stream to this leader's engine."""

    def stale(self, engine: RolloutEngine) -> bool:
        """Before a stream, on a leader: whether its engine lost what earlier streams gave it (it
        restarted, or will on this update), which a stream of changes cannot make up for."""
        return False

    def problem(self) -> Optional[str]:
        """After a feed, on a leader: why its engine may not hold the trainer's weights although it took
        the stream (the next sync must then be a full one), or None."""
        return None

    def reset(self) -> None:
        """The next stream must bring every engine the whole state (an engine restarted, a check failed)."""

    def stats(self) -> dict:
        """``sync/*`` statistics of the last stream beyond bytes and tensors, the same on every rank."""
        return {}


class FullWeights(WeightSource):
    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes

    def tensors(self, model, leaders: list[int]) -> Pairs:
        return iter_hf_weights(model, self.bucket_bytes, receivers=leaders)

    def feed(self, engine: RolloutEngine, stream: Pairs) -> None:
        engine.update_weights(stream)


class AdapterWeights(WeightSource):
    """``tensors(model, leaders)``: the PEFT-named adapter on the leaders (a collective export, e.g.
    :func:`~megatron_alp.models.lora_export.peft_adapter_tensors`); ``config``: PEFT's
    ``adapter_config.json``, or a function of the tensor names returning it. An engine restart keeps
    its adapter, so :meth:`reset` has nothing to do."""

    what = "adapter sync"

    def __init__(self, tensors: Callable[[Any, list[int]], Adapter], config: dict | Callable[[list[str]], dict]):
        self._tensors, self.config = tensors, config

    @classmethod
    def for_lora(cls, lora: LoRAConfig, bucket_bytes: int) -> "AdapterWeights":
        return cls(lambda model, leaders: peft_adapter_tensors(model, bucket_bytes, receivers=leaders),
                   lambda names: peft_adapter_config(lora, names))

    def tensors(self, model, leaders: list[int]) -> Adapter:
        return self._tensors(model, leaders)

    def feed(self, engine: RolloutEngine, stream: Pairs) -> None:
        engine.update_adapter(stream, self.config)


class DeltaWeights(WeightSource):
    """The changed elements only, in ``dtype`` (the engine's, so a float32 trainer's rounding noise
    below bf16 does not count as a change); a full sync every ``anchor_every`` syncs and after
    :meth:`reset`. A checksum that disagrees on a leader is a :meth:`problem`: the next sync is full."""

    def __init__(self, bucket_bytes: int, anchor_every: int, dtype: Optional[torch.dtype]):
        self.bucket_bytes, self.anchor_every = bucket_bytes, anchor_every
        self.export = DeltaExport(dtype=dtype)
        self._since_anchor: Optional[int] = None  # syncs since the last anchor; None: the next is one
        self._problem: Optional[str] = None
        self._restarts = 0  # the engine's restarts at the last feed

    def tensors(self, model, leaders: list[int]) -> Pairs:
        anchor = self._since_anchor is None or self._since_anchor + 1 >= self.anchor_every
        self._since_anchor = 0 if anchor else self._since_anchor + 1
        self._problem = None
        return self._checked(self.export.stream(model, self.bucket_bytes, receivers=leaders, anchor=anchor))

    def _checked(self, stream: Pairs) -> Pairs:
        try:
            yield from stream
        except DeltaMismatch as err:
            self._problem = str(err)

    def feed(self, engine: RolloutEngine, stream: Pairs) -> None:
        engine.update_weights(stream)
        self._restarts = engine.restarts

    def stale(self, engine: RolloutEngine) -> bool:
        return engine.restarts != self._restarts or not engine.keeps_weights()

    def problem(self) -> Optional[str]:
        return self._problem

    def reset(self) -> None:
        self._since_anchor = None

    def stats(self) -> dict:
        s = self.export.stats
        return {"sync/changed_frac": s["changed"] / max(s["elements"], 1), "sync/delta_s": s["seconds"],
                "sync/delta_bytes": float(s["bytes"]), "sync/anchor": float(s["anchor"])}


def weight_source(cfg: RolloutConfig, lora: Optional[LoRAConfig] = None) -> WeightSource:
    """The run's payload: adapters with ``lora.sync: adapter``, changed elements with
    ``rollout.sync_delta``, else the full model."""
    bucket = cfg.sync_bucket_mb << 20
    if lora is not None and lora.enabled and lora.sync == "adapter":
        return AdapterWeights.for_lora(lora, bucket)
    if cfg.sync_delta:
        # compared in the engine's dtype where it only casts; a quantizing engine quantizes what it is
        # sent, so there the trainer's own values are compared (and sent), as a full sync sends them
        cast = cfg.dtype != "auto" and cfg.quantization == "none"
        dtype = getattr(torch, cfg.dtype) if cast else None
        return DeltaWeights(bucket, cfg.sync_delta_anchor, dtype)
    return FullWeights(bucket)
