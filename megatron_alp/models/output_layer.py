"""Megatron's output layer, able to hand back the final hidden states instead of the logits.

The policy update needs only the sampled token's logprob and the entropy per position, which
:func:`~megatron_alp.training.logprobs.linear_token_logprobs` computes from the hidden states and the
output weight chunk by chunk, without the ``[tokens, vocab/TP]`` logits (about 4.9 GB per 16K-token
sequence per TP rank in bf16) or their gradient. :func:`emitting_hidden` switches a model's output
layer to return its input, prepared as the layer itself would prepare it for its GEMM: gathered
over sequence-parallel ranks, or marked so the backward sums the input gradient over
tensor-parallel ranks. Everything before it (the final norm, ALP's logits-site noise) is unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.utils import unwrap_model


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tensor-parallel group. Megatron's
    ``copy_to_tensor_model_parallel_region`` would too, but it all-reduces ``grad.contiguous()`` and
    returns the original: a non-contiguous gradient (the transpose GPTModel applies to its output
    makes one whenever batch > 1) would come back unreduced."""

    @staticmethod
    def forward(ctx, hidden, group):
        ctx.group = group
        return hidden

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class HiddenOutputLayer(ColumnParallelLinear):
    """:class:`ColumnParallelLinear` whose forward returns ``(hidden, None)`` while ``emit_hidden``."""

    emit_hidden = False

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output=None):
        if not self.emit_hidden:
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, group=self.tp_group), None
        if self.tp_group.size() > 1:
            return _SumGradOverTP.apply(input_, self.tp_group), None
        return input_, None


def install_hidden_output(gpt) -> None:
    """Give a last-stage GPTModel a :class:`HiddenOutputLayer` (same parameters, same state dict:
    the instance's class is swapped, nothing is copied)."""
    if getattr(gpt, "post_process", False) and type(gpt.output_layer) is ColumnParallelLinear:
        gpt.output_layer.__class__ = HiddenOutputLayer


def output_weight(model) -> torch.Tensor:
    """This rank's vocabulary shard of the output weight ``[V/tp, h]`` (the embedding when tied)."""
    gpt = unwrap_model(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


@contextlib.contextmanager
def emitting_hidden(model, enabled: bool = True) -> Iterator[bool]:
    """Inside: the model returns final hidden states ``[b, s, h]`` instead of logits, if its output
    layer can (last pipeline stage built by :func:`~megatron_alp.training.builder.build_gpt_model`).
    Yields whether it does."""
    layer = getattr(unwrap_model(model), "output_layer", None)
    on = enabled and isinstance(layer, HiddenOutputLayer)
    if on:
        layer.emit_hidden = True
    try:
        yield on
    finally:
        if on:
            layer.emit_hidden = False
