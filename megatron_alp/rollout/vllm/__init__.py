"""The ``vllm`` rollout engine: the engine (:mod:`.engine`) and its collaborators: its process
(:mod:`.process`), the weight transports (:mod:`.transports`), its LoRA adapter (:mod:`.adapters`),
one attempt of a generate (:mod:`.generation`), the capture of its layers (:mod:`.layer_capture`);
what runs in vLLM's workers (:mod:`.worker`) and its general plugin (:mod:`.plugin`). Importing
this package registers the engine; vLLM itself is imported when an engine starts."""

from megatron_alp.rollout.vllm.engine import VLLMEngine

__all__ = ["VLLMEngine"]
