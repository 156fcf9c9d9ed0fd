"""The engine side of the per-layer mismatch report: every decoder layer's hidden states in a vLLM
rollout engine, recorded by forward hooks inside vLLM's workers
(:meth:`~megatron_alp.rollout.vllm.worker.WorkerExtension.capture_layers`) while the engine
generates, and read back through worker calls (:mod:`megatron_alp.diagnostics.layer_divergence`
compares them with Megatron's)."""

from __future__ import annotations

from typing import Callable

import torch

from megatron_alp.rollout.base import LAYER_KINDS, RolloutError, SamplingParams
from megatron_alp.rollout.vllm.process import EngineProcess
from megatron_alp.rollout.vllm.worker import read_captured


def capture_layer_states(process: EngineProcess, generate: Callable, sequences: list[list[int]],
                         kinds: tuple[str, ...] = LAYER_KINDS) -> list[dict[str, torch.Tensor]]:
    """What every decoder layer computes for each token sequence, fed whole as one prompt to
    ``generate`` (the engine's); per kind of ``kinds``, ``[layers, len(sequence), hidden]``. One
    sequence at a time, with the prefix cache emptied first, so that the captured forward passes hold
    exactly its tokens, in order; only the first worker records and answers, in chunks of layers
    (:func:`~megatron_alp.rollout.vllm.worker.read_captured`)."""
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"layer states of kinds {unknown}: the engine shows {', '.join(LAYER_KINDS)}")
    states = []
    for i, sequence in enumerate(sequences):
        process.llm.reset_prefix_cache()
        process.rpc("capture_layers", args=(list(kinds),))
        try:
            generate([list(sequence)], SamplingParams(temperature=0.0, max_tokens=1))
        finally:
            shapes = process.rpc("captured_layers")[0]
        captured = read_captured(lambda *chunk: process.rpc("captured_chunk", args=chunk)[0], shapes)
        tokens = next(iter(captured.values())).shape[1]
        if tokens != len(sequence):
            raise RolloutError(f"sequence {i}: vLLM's layers saw {tokens} tokens of its {len(sequence)} "
                               "(padded or cached passes)")
        states.append(captured)
    return states
