"""The rollout-engine interface: what the trainer needs from vLLM, SGLang or any other engine."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Mapping, Optional, Protocol, Union

import numpy as np
import torch

from megatron_alp.config import RolloutConfig
from megatron_alp.data.trajectory import check_routing
from megatron_alp.rollout.placement import check_sync_placement


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings the engine must apply exactly; the reported logprobs are those of the
    distribution actually sampled from (temperature applied, top-p/top-k renormalised)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = True
    # When set, sample j of prompt i draws from its own random stream seeded by (seed, i, j), so
    # what it samples depends neither on the engine's process and batching nor on retries: a
    # multi-rank, re-laid-out or resumed run samples what a one-rank run does.
    seed: Optional[int] = None


@dataclass
class Completion:
    """One sampled response."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # rollout-engine logprob of each response token, same length as response_ids
    finish_reason: str  # "stop" (EOS or stop string), "length" (max_tokens) or "abort"
    text: str = ""
    stop_reason: Optional[str | int] = None  # the stop string or token that ended it, if any
    # Partial rollouts: (first response token, weight version) of each span generated under one
    # version, when the response spans several; None: one version throughout.
    version_spans: Optional[list[tuple[int, int]]] = None
    # MoE with rollout.return_routed_experts: the experts of every token the engine fed through the
    # model, [prompt + response - 1, layers, k] (the last sampled token is never fed back), uint8 for
    # up to 256 experts, else uint16 (vLLM's convention)
    routed_experts: Optional[np.ndarray] = None

    def __post_init__(self):
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(
                f"engine returned {len(self.logprobs)} logprobs for {len(self.response_ids)} tokens"
            )
        check_routing(self.routed_experts, len(self.prompt_ids) + len(self.response_ids))


class Interruption(Protocol):
    """What a partial-rollout engine asks between decoding steps (``rollout.partial_rollout``;
    :class:`~megatron_alp.rollout.producer.RolloutProducer` implements it)."""

    version: int  # the weight version the engine holds

    def requested(self) -> bool:
        """A weight update is waiting: stop the unfinished requests and :meth:`pause`."""

    def cut_after(self) -> Optional[int]:
        """A fixed cut for the running job (the deterministic schedule): each response's first span
        ends after this many tokens and the rest waits, in :meth:`pause`, for the next version; None:
        the cut is wherever :meth:`requested` finds the job."""

    def pause(self) -> int:
        """Block while the weights change; returns the new version."""


# A LoRA adapter's PEFT-named tensors: a dict, or (name, tensor) pairs (a stream from the trainer).
Adapter = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def tensor_pairs(tensors: Adapter) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a dict or of pairs already."""
    return tensors.items() if isinstance(tensors, Mapping) else tensors


class RolloutError(RuntimeError):
    """The engine failed in a way retries did not fix; the message says what and where."""


class EngineRestarted(RolloutError):
    """The engine died and was restarted, but holds its initial weights again (the synced ones
    lived only in its memory): sync the trainer's weights, then retry the request."""


def check_prompts(prompts: list[list[int]], vocab_size: int, max_model_len: int) -> None:
    """Refuse a batch the engine would reject or cut, before anything is sent: each prompt must be
    a non-empty list of token ids inside the vocabulary, leaving room for at least one token."""
    if not isinstance(prompts, (list, tuple)):
        raise RolloutError(f"prompts: expected a list of token-id lists, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise RolloutError(f"prompt {i}: expected a non-empty list of token ids, got {p!r:.80}")
        if len(p) >= max_model_len:
            raise RolloutError(
                f"prompt {i} has {len(p)} tokens but the engine context is {max_model_len} tokens "
                f"(rollout.max_model_len), leaving no room for a response"
            )
        bad = next((t for t in p if not isinstance(t, int) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RolloutError(f"prompt {i}: token {bad!r} is not an id in the vocabulary [0, {vocab_size})")


def check_sampling(params: SamplingParams) -> None:
    if params.n < 1:
        raise RolloutError(f"sampling: n must be >= 1 (got {params.n})")
    if params.temperature < 0:
        raise RolloutError(f"sampling: temperature must be >= 0 (got {params.temperature})")
    if not 0 < params.top_p <= 1:
        raise RolloutError(f"sampling: top_p must be in (0, 1] (got {params.top_p})")
    if params.top_k == 0 or params.top_k < -1:
        raise RolloutError(f"sampling: top_k must be -1 (disabled) or >= 1 (got {params.top_k})")
    if params.max_tokens < 1:
        raise RolloutError(f"sampling: max_tokens must be >= 1 (got {params.max_tokens})")


def collect_samples(engine: str, prompts: list[list[int]], n: int, attempts: int,
                    attempt: Callable[[list[tuple[int, int]], int], tuple[dict, Optional[str]]]
                    ) -> list[list[Completion]]:
    """The retry loop every engine shares: call ``attempt(pending, number)`` (returning the finished
    ``{(prompt, sample): Completion}`` and what went wrong with the rest, or None) on the samples not
    yet in, at most ``attempts`` times. A batch is never returned short: whatever is still missing
    is a :class:`RolloutError` that quotes every attempt's problem."""
    wanted = [(i, j) for i in range(len(prompts)) for j in range(n)]
    done: dict[tuple[int, int], Completion] = {}
    history: list[str] = []
    for number in range(1, attempts + 1):
        pending = [k for k in wanted if k not in done]
        if not pending:
            break
        got, problem = attempt(pending, number)
        done.update(got)
        if problem:
            history.append(f"attempt {number}: {problem}")
    missing = [k for k in wanted if k not in done]
    if missing:
        i, j = missing[0]
        raise RolloutError(
            f"{engine} returned {len(wanted) - len(missing)} of {len(wanted)} samples "
            f"({len(prompts)} prompts x n={n}) after {attempts} attempt(s): {'; '.join(history)}; "
            f"first missing: prompt {i} sample {j}"
        )
    return [[done[(i, j)] for j in range(n)] for i in range(len(prompts))]


# What :meth:`RolloutEngine.layer_states` can show of each decoder layer: ``input``, the residual stream
# entering it; ``residual``, the stream after it; ``attention`` and ``mlp``, the branches it adds
LAYER_KINDS = ("input", "residual", "attention", "mlp")


class RolloutEngine(abc.ABC):
    """An inference engine that samples responses and takes weight updates from the trainer. Its
    ``memory`` (:class:`~megatron_alp.rollout.engine_memory.EngineMemory`) holds what of its memory is
    awake and moves it with the library's sleep/wake calls."""

    name: ClassVar[str]
    # How weights can reach the engine (``rollout.sync_method``), preferred first.
    sync_methods: ClassVar[tuple[str, ...]] = ("folder",)
    # Whether generate() can pause between decoding steps for a weight update and continue the
    # unfinished sequences afterwards (``rollout.partial_rollout``; see :class:`Interruption`).
    partial_rollouts: ClassVar[bool] = False
    # Whether :meth:`layer_states` can show the hidden states of every decoder layer
    # (``megatron-alp mismatch --layers``, ``perturbation.calibration_mode: per_layer``).
    captures_layers: ClassVar[bool] = False
    # Whether the engine can apply LoRA adapters itself (``lora.sync: adapter``): started with LoRA
    # on (``lora_rank``), it loads the base weights once and :meth:`update_adapter` sends only A and B.
    takes_adapters: ClassVar[bool] = False
    # The keys of the rollout section that are this engine's own: set under another engine, resolving refuses them.
    options: ClassVar[tuple[str, ...]] = ()
    # Set by the replica's producer when partial rollouts are on.
    interruption: Optional[Interruption] = None
    # How many times the engine was started again; each restart starts from its start weights.
    restarts: int = 0

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 keys: Optional[list[int]] = None) -> list[list[Completion]]:
        """``params.n`` completions for each prompt (token ids), in prompt order. Never drops or
        truncates a request silently: failures raise :class:`RolloutError`. ``keys``: each prompt's
        index in the caller's whole batch (default: its position here); per-sample seeds derive
        from it, so a prompt samples the same whichever replica serves it."""

    @abc.abstractmethod
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights given as (Hugging Face parameter name, full tensor) pairs."""

    def update_adapter(self, tensors: Adapter, config: dict | Callable[[list[str]], dict]) -> None:
        """Generate with this LoRA adapter from now on, where :attr:`takes_adapters`: PEFT-named
        ``tensors`` (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``, ...; a dict
        or (name, tensor) pairs) and the ``adapter_config.json`` dict that PEFT's ``save_pretrained``
        writes with them (or a function of the tensor names that returns it)."""
        raise RolloutError(f"rollout.engine {self.name} cannot apply LoRA adapters itself (lora.sync: adapter); "
                           "use lora.sync: merged")

    def layer_states(self, sequences: list[list[int]], kinds: tuple[str, ...] = LAYER_KINDS
                     ) -> list[dict[str, torch.Tensor]]:
        """Per token sequence, fed whole as one prompt, and per kind of ``kinds`` (:data:`LAYER_KINDS`)
        ``[layers, len(sequence), hidden]`` float32, where :attr:`captures_layers`."""
        raise RolloutError(f"rollout.engine {self.name} cannot show its layers' hidden states")

    def keeps_weights(self) -> bool:
        """Whether the next weight update reaches the engine that took the last one (a broken or dead
        engine is restarted by it, from its start weights, so it needs the whole model)."""
        return True

    def shutdown(self) -> None:
        """Release the engine (processes, memory)."""

    @property
    def max_model_len(self) -> int:
        raise NotImplementedError

    @classmethod
    def check_config(cls, cfg: RolloutConfig) -> None:
        """Refuse settings this engine cannot honour (``ValueError`` naming the keys). Runs when a
        config is validated, possibly on another machine than the job's: no hardware checks here.
        Engines that override it call this one too."""
        if cfg.sync_method is not None and cfg.sync_method not in cls.sync_methods:
            raise ValueError(f"rollout.sync_method={cfg.sync_method} is not available with rollout.engine="
                             f"{cls.name} (it supports: {', '.join(cls.sync_methods)})")
        check_sync_placement(cfg, gpu=False)
        if cfg.partial_rollout and not cls.partial_rollouts:
            raise ValueError(f"rollout.partial_rollout is not available with rollout.engine={cls.name} (its "
                             "generations cannot pause for a weight update)")

    @classmethod
    def sync_method(cls, cfg: RolloutConfig) -> str:
        """``rollout.sync_method``, or this engine's preferred method for its placement (``broadcast``
        for engines on devices of their own, where the engine supports it)."""
        if cfg.sync_method is not None:
            return cfg.sync_method
        if cfg.placement == "separate" and "broadcast" in cls.sync_methods:
            return "broadcast"
        return cls.sync_methods[0]


ENGINES: dict[str, type[RolloutEngine]] = {}


def register_engine(name: str):
    """Class decorator adding an engine to the registry under ``name`` (config `rollout.engine`)."""

    def deco(cls):
        cls.name = name
        ENGINES[name] = cls
        return cls

    return deco


def get_engine(name: str) -> type[RolloutEngine]:
    """The engine class registered as ``name``; importing the package registers the shipped ones."""
    import megatron_alp.rollout  # noqa: F401  (registers vllm and sglang)

    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; registered engines: {sorted(ENGINES)}")
    return ENGINES[name]


def resolve_max_model_len(cfg: RolloutConfig, hf_config: dict) -> int:
    """``rollout.max_model_len``, or prompt + response budget capped at the model's positions."""
    if cfg.max_model_len is not None:
        return cfg.max_model_len
    budget = cfg.sampling.max_prompt_length + cfg.sampling.max_response_length
    return min(budget, int(hf_config.get("max_position_embeddings", budget)))


def attempt_timeout(cfg: RolloutConfig, samples: int, max_tokens: int) -> float:
    """Seconds one generate attempt of ``samples`` samples of up to ``max_tokens`` tokens may take:
    ``request_timeout_s`` plus the batch's worst-case tokens at ``min_tokens_per_s``, so a 16K-token
    batch of thousands of samples is not aborted while it is still making progress."""
    return cfg.request_timeout_s + samples * max_tokens / cfg.min_tokens_per_s

