"""Log-probabilities and entropy of the sampled tokens from vocab-parallel logits.

Megatron's output layer leaves each tensor-parallel rank with a slice ``[b, s, V/tp]`` of the
logits. The naive path (gather the vocabulary, ``log_softmax`` in fp32) materialises several
full-vocabulary fp32 copies per token, which at V = 152k dominates the memory of the policy
update. :func:`token_logprobs` instead walks over the tokens in chunks; each chunk upcasts its
logits, reduces max / sum-exp / target logit / ``sum p*x`` locally and combines them across the
tensor-parallel group with one MAX and one SUM all-reduce. Only the logits shard (which autograd
keeps anyway) and a few numbers per token are saved; the backward recomputes the softmax of one
chunk at a time and needs no communication, because the saved log-normaliser is already global.

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
        # x = logits / T, p = softmax(x):  d lp_t / dx_j = 1[j = t] - p_j,  d H / dx_j = -p_j (log p_j + H).
        # With upstream gradients (u, w): dL/dlogits_j = (u 1[j = t] - p_j (u + w H + w log p_j)) / T.
        logits, local, here, lse, entropy = ctx.saved_tensors
        chunk, with_entropy, inv_t = ctx.chunk, ctx.with_entropy, 1.0 / ctx.temperature
        temperature = _temperature(ctx.temperature, logits)
        u = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs.to(lse.dtype)
        w = grad_second.to(lse.dtype) if with_entropy and grad_second is not None else None
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            e = min(s + chunk, logits.shape[0])
            u_c = u[s:e].unsqueeze(-1)
            logp = _shifted(logits[s:e], temperature, lse[s:e])
            if w is not None:
                w_c = w[s:e].unsqueeze(-1)
                p = torch.exp(logp)
                g = _finite(logp).mul_(-w_c * inv_t).sub_((u_c + w_c * entropy[s:e].unsqueeze(-1)) * inv_t).mul_(p)
                del p
            else:
                g = logp.exp_().mul_(-u_c * inv_t)
            g.scatter_add_(-1, local[s:e].unsqueeze(-1), torch.where(here[s:e].unsqueeze(-1), u_c * inv_t, 0.0).to(g.dtype))
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
    vocab = v_local * tp
    flat_targets = targets.reshape(-1).long()
    if flat_targets.numel() and bool(((flat_targets < 0) | (flat_targets >= vocab)).any()):
        bad = flat_targets[(flat_targets < 0) | (flat_targets >= vocab)][0].item()
        raise ValueError(f"targets: token id {bad} is outside the vocabulary [0, {vocab})")
    budget = CHUNK_ELEMENTS.get(logits.device.type, CHUNK_ELEMENTS["cuda"])
    chunk = chunk_tokens or max(1, budget // max(v_local, 1))
    lp, second = _VocabParallelTokenLogprobs.apply(
        logits.reshape(b * s, v_local), flat_targets, float(temperature), tp_group if tp > 1 else None,
        rank * v_local, chunk, with_entropy,
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
