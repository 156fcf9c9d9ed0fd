"""Trainer -> rollout-engine weight sync: what travels (:mod:`~megatron_alp.sync.sources`: full
weights, LoRA adapters, or the elements changed since the last sync) and the collective loop that
streams it into the live replicas, verifies and retries (:mod:`~megatron_alp.sync.weight_sync`).

Above the rollout (it drives the replicas' engines through their receivers) and beside training
(it reads the Megatron model through :mod:`megatron_alp.models`' export, never the trainer).
"""

from megatron_alp.sync.sources import AdapterWeights, DeltaWeights, FullWeights, WeightSource, weight_source
from megatron_alp.sync.weight_sync import WeightSync

__all__ = ["AdapterWeights", "DeltaWeights", "FullWeights", "WeightSource", "WeightSync", "weight_source"]
