"""The ``vllm`` rollout engine: the engine and its process (:mod:`.engine`), the weight transports
(:mod:`.transports`), what runs in vLLM's workers (:mod:`.worker`) and its general plugin
(:mod:`.plugin`). Importing this package registers the engine; vLLM itself is imported when an
engine starts."""

from megatron_alp.rollout.vllm.engine import VLLMEngine

__all__ = ["VLLMEngine"]
