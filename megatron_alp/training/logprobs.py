"""Log-probabilities and entropy of the sampled tokens from vocab-parallel logits.

Megatron's output layer leaves each tensor-parallel rank with a slice ``[b, s, V/tp]`` of the
logits. The naive path (gather the vocabulary, ``log_softmax`` in fp32) materialises several
full-vocabulary fp32 copies per token, which at V = 152k dominates the memory of the policy
update. :func:`token_logprobs` instead walks over the tokens in chunks; each chunk upcasts its
logits, reduces max / sum-exp / target logit / ``sum p*x`` locally and combines them across the
tensor-parallel group with one MAX and one SUM all-reduce. Only the logits shard (which autograd
keeps anyway) and a few numbers per token are saved; the backward recomputes the softmax of one
chunk at a time and needs no communication, because the saved log-normaliser is already global.

:func:`linear_token_logprobs` goes one step further for the policy update: it takes the final
hidden states and the output weight shard and computes the logits tile by tile (tokens x
vocabulary chunks, an online max / sum-exp over the chunks), so neither the ``[tokens, V/tp]``
logits (~4.9 GB per 16K-token sequence per TP rank in bf16) nor their gradient ever exist; it saves
the hidden states it is given and a few numbers per token, and its backward recomputes each chunk's
logits once (one extra GEMM of the output layer's three).

Temperature is applied as vLLM applies it before sampling: logits cast to fp32, then divided by
the temperature. (vLLM reports such *processed* logprobs only with
``logprobs_mode="processed_logprobs"``; its default reports raw, temperature-free logprobs.)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

# Elements of one fp32 working chunk (tokens x local vocabulary). On a CPU ~16 MiB keeps the two
# per-chunk temporaries near the caches; on a GPU ~256 MiB chunks keep kernels large enough that
# launch overhead does not matter, still far below a full-batch fp32 copy.
CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}


def _group_size(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _work_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 logits (as vLLM computes), fp64 for fp64 logits."""
    return torch.promote_types(logits.dtype, torch.float32)


def _temperature(value: float, logits: torch.Tensor) -> Optional[torch.Tensor]:
    return None if value == 1.0 else torch.full((1, 1), value, dtype=_work_dtype(logits), device=logits.device)


def _shifted(chunk: torch.Tensor, temperature: Optional[torch.Tensor], shift: torch.Tensor) -> torch.Tensor:
    """``fp32(chunk) / temperature - shift`` as a fresh tensor (fp64 for fp64 logits): one pass over
    the chunk when T = 1. The temperature is a tensor, so the division is the one vLLM performs."""
    if temperature is None:
        return torch.sub(chunk, shift.unsqueeze(-1))  # type promotion upcasts bf16/fp16
    return torch.div(chunk, temperature).sub_(shift.unsqueeze(-1))


# Below this a shifted logit's probability is exactly 0 in fp32 and fp64 (exp underflows).
_NEG_FLOOR = -1e4


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` raised to :data:`_NEG_FLOOR` in place: a masked logit (-inf) then has probability 0
    and a finite log, so its ``p * log p`` terms are 0 instead of ``0 * -inf = nan``; no value
    whose probability is non-zero changes."""
    return x.clamp_(min=_NEG_FLOOR)


def _logit_grad(logp, u, w, entropy, inv_t, col, here) -> torch.Tensor:
    """dL/dlogits of a chunk from its log-probabilities ``logp`` (consumed) and the upstream
    gradients of the logprobs ``u`` and of the entropy ``w`` (None: unused). With x = logits / T and
    p = softmax(x): d lp_t / dx_j = 1[j = t] - p_j and d H / dx_j = -p_j (log p_j + H), so
    dL/dlogits_j = (u 1[j = t] - p_j (u + w H + w log p_j)) / T; the target term only where the
    target is in the chunk (``here``, at column ``col``)."""
    u_c = u.unsqueeze(-1)
    if w is not None:
        w_c = w.unsqueeze(-1)
        p = torch.exp(logp)
        g = _finite(logp).mul_(-w_c * inv_t).sub_((u_c + w_c * entropy.unsqueeze(-1)) * inv_t).mul_(p)
        del p
    else:
        g = logp.exp_().mul_(-u_c * inv_t)
    return g.scatter_add_(-1, col.unsqueeze(-1), torch.where(here.unsqueeze(-1), u_c * inv_t, 0.0).to(g.dtype))


class _VocabParallelTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature_value, group, vocab_start, chunk, with_entropy):
        n, v_local = logits.shape
        temperature = _temperature(temperature_value, logits)
        tp = _group_size(group)
        work = _work_dtype(logits)
        lse = torch.empty(n, dtype=work, device=logits.device)
        logprobs = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else None
        local = targets - vocab_start
        here = (local >= 0) & (local < v_local)
        local = torch.where(here, local, torch.zeros_like(local))
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            m = logits[s:e].amax(dim=-1, keepdim=True).to(work)
            m = (m if temperature is None else m / temperature).squeeze(-1)
            if tp > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            x = _shifted(logits[s:e], temperature, m)
            stats = torch.zeros(3 if with_entropy else 2, e - s, dtype=work, device=x.device)
            picked = x.gather(-1, local[s:e].unsqueeze(-1)).squeeze(-1)
            stats[1] = torch.where(here[s:e], picked, torch.zeros_like(picked))
            if with_entropy:
                p = torch.exp(x)
                stats[0] = p.sum(dim=-1)
                stats[2] = p.mul_(_finite(x)).sum(dim=-1)  # sum_j exp(x_j) x_j, in place: two chunk-sized tensors
                del p
            else:
                stats[0] = x.exp_().sum(dim=-1)
            del x
            if tp > 1:
                dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
            log_z = stats[0].log()
            logprobs[s:e] = stats[1] - log_z
            lse[s:e] = m + log_z
            if with_entropy:
                entropy[s:e] = log_z - stats[2] / stats[0]
        ctx.save_for_backward(logits, local, here, lse, entropy if with_entropy else lse)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature_value, chunk, with_entropy
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # unused entropy gets None, not zeros: backward skips its term
        return (logprobs, entropy) if with_entropy else (logprobs, lse)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_second):
        logits, local, here, lse, entropy = ctx.saved_tensors
        chunk, with_entropy, inv_t = ctx.chunk, ctx.with_entropy, 1.0 / ctx.temperature
        temperature = _temperature(ctx.temperature, logits)
        u = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs.to(lse.dtype)
        w = grad_second.to(lse.dtype) if with_entropy and grad_second is not None else None
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            e = min(s + chunk, logits.shape[0])
            logp = _shifted(logits[s:e], temperature, lse[s:e])
            g = _logit_grad(logp, u[s:e], None if w is None else w[s:e], entropy[s:e], inv_t, local[s:e], here[s:e])
            grad[s:e].copy_(g)
            del g, logp
        return grad, None, None, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    with_entropy: bool = False,
    chunk_tokens: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probability (and entropy) of ``targets`` under ``softmax(logits / temperature)``.

    ``logits`` is this rank's vocabulary shard ``[b, s, V/tp]`` exactly as Megatron's GPTModel
    returns it (``parallel_output=True``), in any float dtype; ``targets`` ``[b, s]`` are global
    token ids. Returns fp32 (fp64 for fp64 logits) ``[b, s]`` logprobs and entropy (None unless ``with_entropy``),
    identical on all ranks of ``tp_group`` and differentiable w.r.t. ``logits``.
    ``chunk_tokens`` bounds the working set (default: see ``CHUNK_ELEMENTS``).
    """
    if logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(f"logits: expected a float tensor [batch, seq, vocab/tp], got {tuple(logits.shape)} {logits.dtype}")
    if tuple(targets.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"targets: expected shape {tuple(logits.shape[:2])} (logits' [batch, seq]), got {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 (got {chunk_tokens})")
    b, s, v_local = logits.shape
    tp = _group_size(tp_group)
    rank = dist.get_rank(tp_group) if tp > 1 else 0
    flat_targets = _checked_targets(targets, v_local * tp)
    budget = CHUNK_ELEMENTS.get(logits.device.type, CHUNK_ELEMENTS["cuda"])
    chunk = chunk_tokens or max(1, budget // max(v_local, 1))
    lp, second = _VocabParallelTokenLogprobs.apply(
        logits.reshape(b * s, v_local), flat_targets, float(temperature), tp_group if tp > 1 else None,
        rank * v_local, chunk, with_entropy,
    )
    return lp.view(b, s), (second.view(b, s) if with_entropy else None)


def _checked_targets(targets: torch.Tensor, vocab: int) -> torch.Tensor:
    flat = targets.reshape(-1).long()
    if flat.numel() and bool(((flat < 0) | (flat >= vocab)).any()):
        bad = flat[(flat < 0) | (flat >= vocab)][0].item()
        raise ValueError(f"targets: token id {bad} is outside the vocabulary [0, {vocab})")
    return flat


# Tokens of one tile of the fused linear path: the output weight is read once per tile, so tiles are
# large; the vocabulary is then walked in chunks of CHUNK_ELEMENTS / tile entries.
LINEAR_TILE_TOKENS = 4096


def _tiles(n: int, v_local: int, device: torch.device, chunk_tokens: Optional[int], chunk_vocab: Optional[int]):
    budget = CHUNK_ELEMENTS.get(device.type, CHUNK_ELEMENTS["cuda"])
    tile = chunk_tokens or max(1, min(n, LINEAR_TILE_TOKENS))
    return tile, chunk_vocab or max(1, min(v_local, budget // tile))


class _LinearTokenLogprobs(torch.autograd.Function):
    """Logprobs/entropy of ``hidden @ weight.T`` by token tiles x vocabulary chunks, with an online
    (rescaled) max, sum-exp and ``sum p*x`` per token over the chunks; the backward recomputes each
    chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature_value, group, vocab_start, tile, chunk, with_entropy):
        n, v_local = hidden.shape[0], weight.shape[0]
        work = _work_dtype(hidden)
        temperature = _temperature(temperature_value, hidden)
        tp = _group_size(group)
        lse = torch.empty(n, dtype=work, device=hidden.device)
        logprobs = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else None
        local = targets - vocab_start
        here = (local >= 0) & (local < v_local)
        for s in range(0, n, tile):
            e = min(s + tile, n)
            h = hidden[s:e]
            m = torch.full((e - s,), float("-inf"), dtype=work, device=hidden.device)
            total = torch.zeros_like(m)  # sum exp(x - m)
            px = torch.zeros_like(m)  # sum exp(x - m) (x - m)
            picked = torch.zeros_like(m)
            for v in range(0, v_local, chunk):
                w = min(v + chunk, v_local)
                x = _scaled(torch.nn.functional.linear(h, weight[v:w]), temperature)
                m_new = torch.maximum(m, x.amax(dim=-1))
                if with_entropy:  # re-centre the running sum of p*(x - m) on the new max
                    px = torch.where(total > 0, px + (m - m_new) * total, px)
                scale = torch.exp(m - m_new)
                x.sub_(m_new.unsqueeze(-1))
                inside = here[s:e] & (local[s:e] >= v) & (local[s:e] < w)
                col = torch.where(inside, local[s:e] - v, torch.zeros_like(local[s:e]))
                picked = torch.where(inside, x.gather(-1, col.unsqueeze(-1)).squeeze(-1) + m_new, picked)
                p = torch.exp(x)
                total = total * scale + p.sum(dim=-1)
                if with_entropy:
                    px = px * scale + p.mul_(x).sum(dim=-1)
                m = m_new
                del x, p
            if tp > 1:
                m_all = m.clone()
                dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=group)
                scale = torch.exp(m - m_all)
                stats = torch.stack([total * scale, (px + (m - m_all) * total) * scale,
                                     torch.where(here[s:e], picked, torch.zeros_like(picked))])
                dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
                m, total, px, picked = m_all, stats[0], stats[1], stats[2]
            log_z = total.log()
            lse[s:e] = m + log_z
            logprobs[s:e] = picked - lse[s:e]
            if with_entropy:
                entropy[s:e] = log_z - px / total
        ctx.save_for_backward(hidden, weight, local, here, lse, entropy if with_entropy else lse)
        ctx.temperature, ctx.tile, ctx.chunk, ctx.with_entropy = temperature_value, tile, chunk, with_entropy
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return (logprobs, entropy) if with_entropy else (logprobs, lse)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_second):
        # The gradient w.r.t. a chunk's logits is _logit_grad's; then
        # dL/dh = g W_c and dL/dW_c = g^T h in fp32. Vocabulary chunks are the outer loop, so each
        # weight row's gradient is complete after its chunk's token tiles and is written once, in the
        # weight's dtype; only the hidden states' gradient [tokens, h] accumulates (in fp32).
        hidden, weight, local, here, lse, entropy = ctx.saved_tensors
        tile, chunk, inv_t = ctx.tile, ctx.chunk, 1.0 / ctx.temperature
        temperature = _temperature(ctx.temperature, hidden)
        n, v_local = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(weight.dtype, torch.float32)
        u = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs.to(lse.dtype)
        w_up = grad_second.to(lse.dtype) if ctx.with_entropy and grad_second is not None else None
        grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if ctx.needs_input_grad[0] else None
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        for v in range(0, v_local, chunk):
            w = min(v + chunk, v_local)
            w_chunk = weight[v:w]
            w_acc = w_chunk.to(acc)
            g_w = torch.zeros(w_chunk.shape, dtype=acc, device=weight.device) if grad_weight is not None else None
            for s in range(0, n, tile):
                e = min(s + tile, n)
                h = hidden[s:e]
                logp = _scaled(torch.nn.functional.linear(h, w_chunk), temperature).sub_(lse[s:e].unsqueeze(-1))
                inside = here[s:e] & (local[s:e] >= v) & (local[s:e] < w)
                col = torch.where(inside, local[s:e] - v, torch.zeros_like(local[s:e]))
                g = _logit_grad(logp, u[s:e], None if w_up is None else w_up[s:e], entropy[s:e], inv_t, col, inside)
                g = g.to(acc)
                if grad_hidden is not None:
                    grad_hidden[s:e].addmm_(g, w_acc)
                if g_w is not None:
                    g_w.addmm_(g.t(), h.to(acc))
                del g, logp
            if g_w is not None:
                grad_weight[v:w] = g_w
        return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None, grad_weight,
                None, None, None, None, None, None, None)


def _scaled(logits: torch.Tensor, temperature: Optional[torch.Tensor]) -> torch.Tensor:
    """``fp32(logits) / temperature`` (fp64 for fp64), as a fresh tensor."""
    x = logits.to(_work_dtype(logits))
    return x if temperature is None else x.div_(temperature)


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    with_entropy: bool = False,
    chunk_tokens: Optional[int] = None,
    chunk_vocab: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`token_logprobs` of the logits ``hidden @ weight.T``, without materialising them.

    ``hidden`` ``[b, s, h]``: final hidden states, identical on every rank of ``tp_group``;
    ``weight`` ``[V/tp, h]``: this rank's vocabulary shard of the output layer (rows
    ``rank * V/tp ...``), same dtype. The logits of a tile of ``chunk_tokens`` tokens x
    ``chunk_vocab`` vocabulary rows are computed as ``F.linear`` computes them (model dtype), then
    upcast and divided by the temperature as in :func:`token_logprobs`; nothing of size
    ``[tokens, V/tp]`` is kept. Differentiable w.r.t. ``hidden`` and ``weight``; the backward
    recomputes each chunk's logits. The gradient returned for ``hidden`` is this rank's share only
    (from its vocabulary rows): the caller sums it over ``tp_group``, as Megatron's output layer
    does with its input (see :mod:`megatron_alp.models.output_layer`).
    """
    if hidden.dim() != 3 or not hidden.is_floating_point():
        raise ValueError(f"hidden: expected a float tensor [batch, seq, hidden], got {tuple(hidden.shape)} {hidden.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2] or weight.dtype != hidden.dtype:
        raise ValueError(f"weight: expected [vocab/tp, {hidden.shape[2]}] in {hidden.dtype} (hidden's size and dtype), "
                         f"got {tuple(weight.shape)} {weight.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"targets: expected shape {tuple(hidden.shape[:2])} (hidden's [batch, seq]), got {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    for name, value in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1 (got {value})")
    b, s, size = hidden.shape
    v_local = weight.shape[0]
    tp = _group_size(tp_group)
    rank = dist.get_rank(tp_group) if tp > 1 else 0
    flat_targets = _checked_targets(targets, v_local * tp)
    tile, chunk = _tiles(b * s, v_local, hidden.device, chunk_tokens, chunk_vocab)
    lp, second = _LinearTokenLogprobs.apply(
        hidden.reshape(b * s, size), weight, flat_targets, float(temperature), tp_group if tp > 1 else None,
        rank * v_local, tile, chunk, with_entropy,
    )
    return lp.view(b, s), (second.view(b, s) if with_entropy else None)


def reference_token_logprobs(
    full_logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The plain path on full-vocabulary logits: fp32 ``log_softmax`` and a gather (tests, benchmarks)."""
    logp = torch.log_softmax(full_logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return lp, entropy
