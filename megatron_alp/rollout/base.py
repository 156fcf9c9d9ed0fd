"""The rollout-engine interface: what the trainer needs from vLLM, SGLang or any other engine."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterable, Optional

import torch


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


@dataclass
class Completion:
    """One sampled response."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # rollout-engine logprob of each response token, same length as response_ids
    finish_reason: str  # "stop" (EOS or stop string), "length" (max_tokens) or "abort"
    text: str = ""
    stop_reason: Optional[str | int] = None  # the stop string or token that ended it, if any

    def __post_init__(self):
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(
                f"engine returned {len(self.logprobs)} logprobs for {len(self.response_ids)} tokens"
            )


@dataclass
class Trajectory:
    """What the trainer learns from: one response (single- or multi-turn) to one prompt.

    ``response_ids`` holds every token after the prompt (model tokens and, in multi-turn
    episodes, tool outputs); ``loss_mask`` is 1 on the tokens the policy is trained on and 0 on
    tool outputs and void turns; ``rollout_logprobs`` is aligned with ``response_ids`` (0.0 where
    the mask is 0)."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    loss_mask: list[int]
    response_text: str
    finish_reason: str
    num_turns: int = 1
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        n = len(self.response_ids)
        if len(self.rollout_logprobs) != n or len(self.loss_mask) != n:
            raise ValueError(
                f"trajectory misaligned: {n} response tokens, {len(self.rollout_logprobs)} logprobs, "
                f"{len(self.loss_mask)} mask entries"
            )

    @classmethod
    def from_completion(cls, c: "Completion") -> "Trajectory":
        return cls(
            prompt_ids=list(c.prompt_ids),
            response_ids=list(c.response_ids),
            rollout_logprobs=list(c.logprobs),
            loss_mask=[1] * len(c.response_ids),
            response_text=c.text,
            finish_reason=c.finish_reason,
        )


class RolloutError(RuntimeError):
    """The engine failed in a way retries did not fix; the message says what and where."""


class RolloutEngine(abc.ABC):
    """An inference engine that samples responses and takes weight updates from the trainer."""

    name: ClassVar[str]

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions for each prompt (token ids), in prompt order. Never drops or
        truncates a request silently: failures raise :class:`RolloutError`."""

    @abc.abstractmethod
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights given as (Hugging Face parameter name, full tensor) pairs."""

    def sleep(self) -> None:
        """Free accelerator memory (KV cache, weights) while the trainer runs, where supported."""

    def wake_up(self) -> None:
        """Undo :meth:`sleep` before the next generation."""

    def shutdown(self) -> None:
        """Release the engine (processes, memory)."""

    @property
    def max_model_len(self) -> int:
        raise NotImplementedError


ENGINES: dict[str, Callable[..., RolloutEngine]] = {}


def register_engine(name: str):
    """Class decorator adding an engine to the registry under ``name`` (config `rollout.engine`)."""

    def deco(cls):
        cls.name = name
        ENGINES[name] = cls
        return cls

    return deco
