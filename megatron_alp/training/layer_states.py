"""The hidden states of Megatron's decoder layers on given token sequences, from plain forwards.

Per decoder layer and kind: ``input``, the residual stream entering the layer (what ALP perturbs);
``residual``, the stream after it; ``attention`` and ``mlp``, the branches it adds to the stream.
The per-layer mismatch report compares them with the rollout engine's
(:mod:`megatron_alp.diagnostics.layer_divergence`), and ``perturbation.calibration_mode:
per_layer`` sizes each layer's sigma from the divergence of its ``input``
(:mod:`megatron_alp.training.calibration`). ``per_layer_added`` feeds the engine's input of chosen
layers in place of Megatron's own, so that the recorded input of the next one is what Megatron's
layers make of the engine's states: its difference from the engine's is the drift the engine added
in between.

Every rank of the job runs the same forwards: tensor-parallel layers all-reduce and expert layers
exchange tokens with their expert-parallel group, so every rank takes part. Under sequence
parallelism a layer sees 1/TP of the tokens; they are gathered over the tensor-parallel group (the
sequence padded at its end to a multiple of TP first, which leaves the causal states of its own
tokens unchanged). One pipeline stage only: the whole model runs in one forward.

On an MoE model a forward given ``routing`` replays those experts (the tokens given none route on
their own): under routing replay R3 every training pass uses the engine's experts, so the probe
that sizes sigma must too, or its drift would include routing flips the update never sees.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator, Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.utils import unwrap_model

from megatron_alp.models.routing import MicroBatchRouting, no_expert, routing_of, to_router
from megatron_alp.runtime.comm import comm_device

KINDS = ("input", "residual", "attention", "mlp")


def _first(output) -> torch.Tensor:
    """A Megatron module's output: layers return ``(hidden, context)``, attention and MLP ``(out, bias)``
    (a bias the layer adds with the residual, part of the branch as in the engine's projection)."""
    if not isinstance(output, tuple):
        return output
    out, bias = output[0], output[1]
    return out if bias is None else out + bias


def _layers(model) -> list:
    chunks = unwrap_model(model)
    chunks = chunks if isinstance(chunks, list) else [chunks]
    if len(chunks) != 1 or not chunks[0].pre_process or not chunks[0].post_process:
        raise ValueError("decoder-layer states need the whole model in one forward (pipeline parallel size 1)")
    return list(chunks[0].decoder.layers)


@contextmanager
def captured(model, kinds: tuple[str, ...] = KINDS, given: Optional[dict[int, torch.Tensor]] = None
             ) -> Iterator[dict[str, list[list[torch.Tensor]]]]:
    """Record, per kind and decoder layer, the ``[s, b, h]`` tensors of the forward passes inside
    (this rank's sequence shard under sequence parallelism), as float32 copies on the CPU. ``given``:
    per layer, the ``[s, b, h]`` input (the whole sequence) it runs on instead of its own; its own
    is what ``input`` records."""
    layers = _layers(model)
    given = given or {}
    records = {kind: [[] for _ in layers] for kind in kinds}
    hooks = []

    def keep(kind, i, value):
        if kind in kinds:
            records[kind][i].append(value.detach().to("cpu", torch.float32, copy=True))

    def recorder(kind, i):
        return lambda module, args, output: keep(kind, i, _first(output))

    def input_recorder(i):
        def record(module, args, kwargs):
            named = "hidden_states" in kwargs
            own = kwargs["hidden_states"] if named else args[0]
            keep("input", i, own)
            if i not in given:
                return None
            fed = _own_shard(given[i], layers[i].config.sequence_parallel).to(own.device, own.dtype)
            return (args, {**kwargs, "hidden_states": fed}) if named else ((fed, *args[1:]), kwargs)
        return record

    for i, layer in enumerate(layers):
        if "input" in kinds or i in given:
            hooks.append(layer.register_forward_pre_hook(input_recorder(i), with_kwargs=True))
        for kind, module in (("residual", layer), ("attention", layer.self_attention), ("mlp", layer.mlp)):
            if kind in kinds:
                hooks.append(module.register_forward_hook(recorder(kind, i)))
    try:
        yield records
    finally:
        for hook in hooks:
            hook.remove()


def _own_shard(whole: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """This rank's part of ``whole`` (``[s, b, h]``) as a layer sees it: under sequence parallelism
    the r-th of TP equal slices along the sequence, else all of it."""
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if not sequence_parallel or tp == 1:
        return whole
    size = whole.shape[0] // tp
    rank = ps.get_tensor_model_parallel_rank()
    return whole[rank * size:(rank + 1) * size].contiguous()


def _whole_sequence(shard: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """``[s, 1, h]`` of all the sequence's tokens from this rank's ``shard`` of them."""
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if not sequence_parallel or tp == 1:
        return shard
    group = ps.get_tensor_model_parallel_group()
    moved = shard.to(comm_device(group))
    parts = [torch.empty_like(moved) for _ in range(tp)]
    torch.distributed.all_gather(parts, moved, group=group)
    return torch.cat(parts).cpu()


def _replaying(chunk, routing: Optional[torch.Tensor], length: int):
    """The routing pass of one probe forward: ``routing`` (``[tokens, layers, k]``, every layer of
    the model) replayed, padded to ``length`` with "no expert"; nothing for a dense model or none given."""
    control = routing_of(chunk)
    if control is None or routing is None:
        return nullcontext()
    pad = torch.full((length - len(routing), *routing.shape[1:]), no_expert(routing.dtype), dtype=routing.dtype)
    laid = control.local_layers(torch.cat([routing[:length], pad])[None])
    device = next(chunk.parameters()).device
    tokens = torch.ones(length, dtype=torch.bool, device=device)

    @contextmanager
    def replay():
        with control.pass_(training=False):
            control.begin_microbatch(MicroBatchRouting(
                tokens=tokens, replay=to_router(laid, control.sequence_parallel).to(device)))
            yield
    return replay()


@torch.no_grad()
def megatron_layer_states(model, sequences: list[list[int]], kinds: tuple[str, ...] = KINDS,
                          routing: Optional[list[Optional[torch.Tensor]]] = None,
                          fed: Optional[list[torch.Tensor]] = None, at: tuple[int, ...] = ()
                          ) -> list[dict[str, torch.Tensor]]:
    """Per sequence and kind ``[layers, tokens, hidden]`` float32 (CPU), from a plain causal
    forward of the sequence alone (eval mode, no perturbation: noise is added only inside
    :func:`~megatron_alp.training.perturbation.perturbed_step`). ``routing``: per sequence, the
    experts to replay (``[tokens, layers, k]``) or None. ``fed``: per sequence, ``[layers, tokens,
    hidden]`` inputs that layers ``at`` run on instead of their own (the recorded ``input`` stays
    their own). Every rank calls it with the same ``sequences`` and gets the same states."""
    layers = _layers(model)
    config = layers[0].config
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    chunks = model if isinstance(model, list) else [model]
    device = next(chunks[0].parameters()).device
    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    states = []
    try:
        for i, sequence in enumerate(sequences):
            padded = list(sequence) + [0] * (-len(sequence) % tp if config.sequence_parallel else 0)
            tokens = torch.tensor([padded], device=device)
            given = routing[i] if routing is not None else None
            inputs = {layer: _padded(fed[i][layer], len(padded)) for layer in at} if fed is not None else None
            with captured(model, kinds, inputs) as records, _replaying(chunks[0], given, len(padded)):
                chunks[0](tokens, torch.arange(len(padded), device=device).unsqueeze(0), None)
            # [s, 1, h] per layer -> [layers, s, h]
            states.append({kind: torch.stack([_whole_sequence(calls[0], config.sequence_parallel)[:len(sequence), 0]
                                              for calls in per_layer]) for kind, per_layer in records.items()})
    finally:
        for c, mode in zip(chunks, was_training):
            c.train(mode)
    return states


def _padded(states: torch.Tensor, length: int) -> torch.Tensor:
    """``[tokens, hidden]`` -> ``[length, 1, hidden]``, zeros after the sequence's own tokens (where
    only padding for the sequence-parallel split sits, which no earlier token attends to)."""
    return torch.nn.functional.pad(states, (0, 0, 0, length - states.shape[0]))[:, None]
