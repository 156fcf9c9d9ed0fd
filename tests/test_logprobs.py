"""Fused chunked token logprobs/entropy: values and gradients vs the plain log_softmax path, what
the backward keeps, bad input, and temperature applied as the real vLLM engine applies it."""

from __future__ import annotations

import pytest
import torch

from megatron_alp.training.logprobs import linear_token_logprobs, reference_token_logprobs, token_logprobs


def _random(b, s, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, s, v, generator=g) * 4).to(dtype)
    targets = torch.randint(0, v, (b, s), generator=g)
    return logits, targets


def _fwd_bwd(fn, logits, targets, temperature, with_entropy, seed=1, **kw):
    leaf = logits.clone().requires_grad_()
    lp, ent = fn(leaf, targets, temperature=temperature, with_entropy=with_entropy, **kw)
    g = torch.Generator().manual_seed(seed)
    loss = (lp * torch.randn(lp.shape, generator=g)).sum()
    if with_entropy:
        loss = loss + (ent * torch.randn(ent.shape, generator=g)).sum()
    loss.backward()
    return lp.detach(), (ent.detach() if ent is not None else None), leaf.grad


@pytest.mark.parametrize("shape", [(1, 1, 7), (3, 7, 50), (2, 33, 1000)])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, None])
def test_fused_matches_reference_fp32(shape, temperature, with_entropy, chunk):
    logits, targets = _random(*shape, torch.float32)
    lp, ent, grad = _fwd_bwd(token_logprobs, logits, targets, temperature, with_entropy, chunk_tokens=chunk)
    r_lp, r_ent, r_grad = _fwd_bwd(reference_token_logprobs, logits, targets, temperature, with_entropy)
    assert lp.dtype == torch.float32 and lp.shape == shape[:2]
    assert torch.allclose(lp, r_lp, atol=1e-5, rtol=0)
    assert torch.allclose(grad, r_grad, atol=1e-5, rtol=0)
    if with_entropy:
        assert torch.allclose(ent, r_ent, atol=1e-5, rtol=0)
    else:
        assert ent is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_upcast(dtype):
    logits, targets = _random(2, 9, 300, dtype)
    lp, ent, grad = _fwd_bwd(token_logprobs, logits, targets, 0.8, True, chunk_tokens=4)
    r_lp, r_ent, r_grad = _fwd_bwd(reference_token_logprobs, logits, targets, 0.8, True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32 and grad.dtype == dtype
    assert torch.allclose(lp, r_lp, atol=1e-5) and torch.allclose(ent, r_ent, atol=1e-5)
    assert torch.allclose(grad.float(), r_grad.float(), atol=1e-2)


def test_no_token_inputs():
    for shape in ((0, 4, 10), (2, 0, 10)):
        logits = torch.randn(*shape, requires_grad=True)
        lp, ent = token_logprobs(logits, torch.zeros(shape[:2], dtype=torch.long), with_entropy=True)
        assert lp.shape == shape[:2] and ent.shape == shape[:2]
        (lp.sum() + ent.sum()).backward()
        assert logits.grad.shape == logits.shape


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[[1e4, -1e4, 0.0, 50.0], [-3e4, -3e4, -3e4, -3e4]]], requires_grad=True)
    targets = torch.tensor([[1, 2]])
    lp, ent = token_logprobs(logits, targets, with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(logits.grad).all()
    assert lp[0, 0].item() == pytest.approx(-2e4, rel=1e-6)
    assert lp[0, 1].item() == pytest.approx(-torch.log(torch.tensor(4.0)).item(), abs=1e-6)


def _exact(logits, targets, temperature):
    """log_softmax in the logits' own dtype (fp64 here): the textbook formulas."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    return lp, -(torch.where(p > 0, p * logp, torch.zeros_like(p))).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp64_logits_forward_and_backward_in_fp64(temperature):
    logits, targets = _random(2, 9, 40, torch.float64, seed=3)
    lp, ent, grad = _fwd_bwd(token_logprobs, logits, targets, temperature, True, chunk_tokens=4)
    ref_lp, ref_ent, ref_grad = _fwd_bwd(lambda x, t, temperature, with_entropy: _exact(x, t, temperature),
                                         logits, targets, temperature, True)
    assert lp.dtype == torch.float64 and grad.dtype == torch.float64
    assert torch.allclose(lp, ref_lp, rtol=0, atol=1e-12)
    assert torch.allclose(ent, ref_ent, rtol=0, atol=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_minus_inf_logits_give_finite_entropy_and_gradients(dtype):
    """A -inf logit (a masked vocabulary entry) has probability 0: entropy and gradients equal those of
    the vocabulary without it, not NaN."""
    logits, targets = _random(2, 6, 30, dtype, seed=4)
    targets = targets % 20  # targets among the kept entries
    masked = logits.clone()
    masked[..., 20:] = float("-inf")
    lp, ent, grad = _fwd_bwd(token_logprobs, masked, targets, 0.8, True)
    ref_lp, ref_ent, ref_grad = _fwd_bwd(lambda x, t, temperature, with_entropy: _exact(x.double(), t, temperature),
                                         logits[..., :20], targets, 0.8, True)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.isfinite(ent).all() and torch.isfinite(grad).all()
    assert torch.allclose(lp.double(), ref_lp, atol=tol) and torch.allclose(ent.double(), ref_ent, atol=tol)
    assert torch.allclose(grad[..., :20].double(), ref_grad.double(), atol=tol)
    assert (grad[..., 20:] == 0).all()


def test_backward_keeps_no_full_size_fp32_copy():
    """The autograd graph of the fused path holds the logits shard and a few numbers per token;
    the plain path holds at least one extra full-vocabulary fp32 tensor."""
    logits, targets = _random(2, 64, 4096, torch.bfloat16)

    def saved_bytes(fn):
        sizes = {}

        def pack(t):
            sizes[t.data_ptr()] = t.numel() * t.element_size()
            return t

        leaf = logits.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, ent = fn(leaf, targets, with_entropy=True)
        return sum(sizes.values()) - leaf.numel() * leaf.element_size()

    n_tokens = targets.numel()
    fused, plain = saved_bytes(token_logprobs), saved_bytes(reference_token_logprobs)
    assert fused <= 64 * n_tokens, f"fused path saved {fused} bytes beyond the logits"
    assert plain >= logits.numel() * 4, "the plain path should keep a full fp32 copy (test is meaningful)"


def test_bad_inputs_are_named():
    logits, targets = _random(2, 3, 10, torch.float32)
    with pytest.raises(ValueError, match=r"targets: token id 10 is outside the vocabulary \[0, 10\)"):
        token_logprobs(logits, torch.full((2, 3), 10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        token_logprobs(logits, torch.full((2, 3), -100))
    with pytest.raises(ValueError, match=r"targets: expected shape \(2, 3\)"):
        token_logprobs(logits, targets[:, :2])
    with pytest.raises(ValueError, match=r"logits: expected a float tensor \[batch, seq, vocab/tp\]"):
        token_logprobs(logits[0], targets[0])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        token_logprobs(logits, targets, chunk_tokens=0)


# ------------------------------------------------------------------ the real rollout engine


@pytest.fixture(scope="module")
def tiny_qwen2(tiny_model):
    return tiny_model("qwen2")


def test_temperature_matches_vllm_processed_logprobs(tiny_qwen2, tmp_path, monkeypatch):
    """vLLM samples from softmax(fp32 logits / T) and, with processed logprobs, reports the
    logprobs of that distribution: token_logprobs(temperature=T) on the same model's logits
    reproduces them; the temperature-free logprobs do not."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm_cache"))
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from megatron_alp.rollout.vllm.process import forget_dead_vllm_groups

    T = 0.6
    forget_dead_vllm_groups()  # torch.distributed may have been torn down by an earlier test
    llm = LLM(model=str(tiny_qwen2), dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
              logprobs_mode="processed_logprobs")
    prompts = [[5, 17, 99, 300], [8, 41]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(n=3, temperature=T, max_tokens=12, logprobs=0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), torch_dtype=torch.float32).eval()
    worst_tempered, worst_raw = 0.0, float("inf")
    for prompt, out in zip(prompts, outs):
        for comp in out.outputs:
            ids = list(comp.token_ids)
            engine = torch.tensor([lp[t].logprob for lp, t in zip(comp.logprobs, ids)])
            seq = torch.tensor([prompt + ids])
            with torch.no_grad():
                logits = hf(seq).logits[:, len(prompt) - 1: -1]
            tempered, _ = token_logprobs(logits, torch.tensor([ids]), temperature=T)
            raw, _ = token_logprobs(logits, torch.tensor([ids]))
            worst_tempered = max(worst_tempered, (tempered[0] - engine).abs().max().item())
            worst_raw = min(worst_raw, (raw[0] - engine).abs().max().item())
    assert worst_tempered < 1e-4, f"max |token_logprobs(T) - vLLM| = {worst_tempered}"
    assert worst_raw > 10 * worst_tempered, "temperature made no measurable difference: test is not meaningful"


# ---- the fused output layer + logprob path: linear_token_logprobs(hidden, weight, targets)


def _truth(hidden, weight, targets, temperature, with_entropy):
    """log_softmax of the materialised logits, computed in fp64 from the given (rounded) inputs'
    logits as F.linear makes them in the input dtype."""
    logits = torch.nn.functional.linear(hidden, weight).double() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, (-(logp.exp() * logp).sum(-1) if with_entropy else None)


def _linear_case(dtype, seed=0, b=2, s=9, h=16, v=50):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(b, s, h, generator=g) * 2).to(dtype)
    weight = torch.randn(v, h, generator=g).to(dtype)
    return hidden, weight, torch.randint(0, v, (b, s), generator=g), torch.randn(b, s, generator=g), torch.randn(b, s, generator=g)


def _linear_grads(fn, hidden, weight, targets, up_lp, up_ent, temperature, with_entropy, use_lp=True, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fn(h, w, targets, temperature, with_entropy, **kw)
    loss = (lp * up_lp.to(lp.dtype)).sum() if use_lp else 0.0
    if with_entropy:
        loss = loss + (ent * up_ent.to(ent.dtype)).sum()
    grad_h, grad_w = torch.autograd.grad(loss, (h, w))
    return lp.detach(), (ent.detach() if ent is not None else None), grad_h, grad_w


def _fused_linear(h, w, t, temperature, with_entropy, **kw):
    return linear_token_logprobs(h, w, t, temperature=temperature, with_entropy=with_entropy, **kw)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("with_entropy, use_lp", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("chunks", [{}, {"chunk_tokens": 4, "chunk_vocab": 7}, {"chunk_tokens": 1, "chunk_vocab": 1}])
def test_linear_path_matches_log_softmax_of_the_logits(dtype, tol, temperature, with_entropy, use_lp, chunks):
    """Values and gradients (hidden and weight) equal autograd through the materialised logits;
    fp64 to rounding, fp32 within 1e-4 (logits of magnitude ~30 carry ~3e-6 rounding each)."""
    case = _linear_case(dtype)
    got = _linear_grads(_fused_linear, *case, temperature, with_entropy, use_lp, **chunks)
    ref = _linear_grads(_truth, *case, temperature, with_entropy, use_lp)
    assert got[0].dtype == torch.promote_types(dtype, torch.float32) and got[0].shape == case[2].shape
    for a, b in zip(got, ref):
        if a is None:
            assert b is None and not with_entropy
            continue
        assert torch.allclose(a.double(), b.double(), atol=tol, rtol=0), (a - b).abs().max()


def test_linear_path_in_bf16_is_closer_to_the_truth_than_bf16_autograd():
    """bf16 hidden/weight: the forward GEMM runs in bf16 as in the model, the softmax and both
    gradients in fp32, so values and gradients are at least as close to fp64 arithmetic on the same
    inputs as autograd through bf16 logits (which also rounds the logits' gradient to bf16)."""
    hidden, weight, targets, up_lp, up_ent = _linear_case(torch.bfloat16, s=33, h=64, v=500)
    got = _linear_grads(_fused_linear, hidden, weight, targets, up_lp, up_ent, 0.8, True)
    truth = _linear_grads(_truth, hidden.double(), weight.double(), targets, up_lp, up_ent, 0.8, True)

    def plain(h, w, t, temperature, with_entropy):
        return reference_token_logprobs(torch.nn.functional.linear(h, w), t, temperature, with_entropy)

    naive = _linear_grads(plain, hidden, weight, targets, up_lp, up_ent, 0.8, True)
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    for i in (0, 1):  # the bf16 logits round to ~1 part in 256
        assert (got[i].double() - truth[i]).abs().max() <= (naive[i].double() - truth[i]).abs().max() * 1.01 + 1e-6
    for i in (2, 3):
        err = (got[i].double() - truth[i].double()).abs().max()
        naive_err = (naive[i].double() - truth[i].double()).abs().max()
        assert err <= naive_err * 1.01 + 1e-6, (i, err, naive_err)


def test_linear_path_keeps_no_logits():
    """The graph keeps the hidden states, a reference to the weight and a few numbers per token;
    autograd through the logits keeps at least the [tokens, vocab] logits."""
    hidden, weight, targets, _, _ = _linear_case(torch.float32, s=64, h=32, v=4096)

    def saved_bytes(fn):
        sizes = {}

        def pack(t):
            sizes[t.data_ptr()] = t.numel() * t.element_size()
            return t

        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(h, w, targets, 1.0, True)
        return sum(v for p, v in sizes.items() if p not in (h.data_ptr(), w.data_ptr()))

    n_tokens = targets.numel()
    fused, plain = saved_bytes(_fused_linear), saved_bytes(_truth)
    assert fused <= 64 * n_tokens, f"the fused linear path saved {fused} bytes beyond hidden and weight"
    assert plain >= n_tokens * 4096 * 4


def test_linear_path_bad_inputs_are_named():
    hidden, weight, targets, _, _ = _linear_case(torch.float32)
    with pytest.raises(ValueError, match=r"weight: expected \[vocab/tp, 16\]"):
        linear_token_logprobs(hidden, weight[:, :8], targets)
    with pytest.raises(ValueError, match="weight: .* in torch.float32"):
        linear_token_logprobs(hidden, weight.double(), targets)
    with pytest.raises(ValueError, match="targets: token id 50 is outside"):
        linear_token_logprobs(hidden, weight, torch.full_like(targets, 50))
    with pytest.raises(ValueError, match="chunk_vocab must be >= 1"):
        linear_token_logprobs(hidden, weight, targets, chunk_vocab=0)
    with pytest.raises(ValueError, match="hidden: expected"):
        linear_token_logprobs(hidden[0], weight, targets[0])
