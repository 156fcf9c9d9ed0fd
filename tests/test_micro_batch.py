"""Micro-batches by rows, by token budget, and packed (megatron_alp/training/micro_batch.py); and, on real
Megatron models over gloo, packed / budgeted / fused-linear passes equal the padded pass."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import dist_job, read_results

from megatron_alp.config import ConfigError
from megatron_alp.resolve import config_from_dict
from megatron_alp.training.micro_batch import Batching, micro_batches
from megatron_alp.training.rl_batch import RLBatch


def _batch(lengths: list[int], seed: int = 0) -> RLBatch:
    g = torch.Generator().manual_seed(seed)
    n, width = len(lengths), max(lengths)
    tokens = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width)
    for i, length in enumerate(lengths):
        tokens[i, :length] = torch.randint(3, 100, (length,), generator=g)
        mask[i, 1: length - 1] = 1
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1), value=0)
    return RLBatch(tokens, targets, mask, torch.randn(n, width, generator=g) * mask, torch.arange(float(n)),
                   torch.tensor(lengths))


def _lengths(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [min(120, max(2, int(rng.lognormvariate(3.0, 0.8)))) for _ in range(n)]


WAYS = {
    "rows": (Batching(size=3), True),
    "budget": (Batching(max_tokens=150), True),
    "packed_one_row": (Batching(max_tokens=150, pack=True), True),
    "packed_rows": (Batching(max_tokens=150, pack=True), False),
}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("way", WAYS)
def test_every_sequence_once_with_its_own_tokens(seed, way):
    batching, one_row = WAYS[way]
    batch = _batch(_lengths(seed))
    micro = micro_batches(batch, batching, pad_id=0, one_row=one_row)
    assert sorted(i for m in micro for i in m.rows.tolist()) == list(range(len(batch)))
    for m in micro:
        for j, row in enumerate(m.rows.tolist()):
            n = int(batch.lengths[row])
            # the padded view holds the sequence exactly; unpacking the model input gives it back
            assert torch.equal(m.batch.tokens[j, :n], batch.tokens[row, :n])
            assert torch.equal(m.unpack(m.tokens)[j, :n], batch.tokens[row, :n])
            assert torch.equal(m.unpack(m.targets)[j, :n], batch.targets[row, :n])
            assert torch.equal(m.unpack(m.positions)[j, :n], torch.arange(n))
            assert torch.equal(m.batch.loss_mask[j], batch.loss_mask[row, : m.batch.tokens.shape[1]])
        past_end = torch.arange(m.batch.tokens.shape[1]) >= m.batch.lengths.unsqueeze(1)
        assert bool((m.unpack(m.tokens.float() + 1)[past_end] == 0).all())


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_is_respected_and_packing_computes_no_padding(seed):
    lengths = _lengths(seed)
    batch = _batch(lengths)
    padded = micro_batches(batch, Batching(max_tokens=150), pad_id=0)
    packed = micro_batches(batch, Batching(max_tokens=150, pack=True), pad_id=0)
    rows = micro_batches(batch, Batching(max_tokens=150, pack=True), pad_id=0, one_row=False)
    assert all(m.computed_tokens <= 150 for m in padded + packed)
    assert all(m.tokens.shape[0] == 1 for m in packed)
    assert sum(m.computed_tokens for m in packed) == sum(lengths)
    assert sum(m.computed_tokens for m in padded) >= sum(lengths)
    # LPT bins: at most one bin more than the lower bound, and none far emptier than the others
    assert len(packed) <= -(-sum(lengths) // 150) + 1
    loads = [m.computed_tokens for m in packed]
    assert max(loads) - min(loads) <= max(lengths)
    # masked rows: as wide as the micro-batch's longest sequence, within the budget, and never more
    # tokens than the padded rows of the same budget
    for m in rows:
        assert m.tokens.shape[1] == int(m.batch.lengths.max()) and m.computed_tokens <= 150
    assert sum(m.computed_tokens for m in rows) <= sum(m.computed_tokens for m in padded)


def test_rows_mode_groups_longest_first():
    batch = _batch([5, 9, 2, 7, 3])
    micro = micro_batches(batch, Batching(size=2), pad_id=0, pad_multiple=4)
    assert [m.rows.tolist() for m in micro] == [[1, 3], [0, 4], [2]]
    assert [m.tokens.shape[1] for m in micro] == [12, 8, 4]


def _expected_mask(segments: list[int]) -> torch.Tensor:
    t = len(segments)
    out = torch.ones(t, t, dtype=torch.bool)
    for q in range(t):
        for k in range(q + 1):
            if segments[q] == segments[k]:
                out[q, k] = False
    return out


def test_block_diagonal_causal_mask_and_thd_bounds():
    batch = _batch([3, 2, 4])
    (m,) = micro_batches(batch, Batching(max_tokens=12, pack=True), pad_id=0, pad_multiple=5)
    assert m.tokens.shape == (1, 10)  # 9 tokens + a pad tail of 1 to the multiple of 5
    order = sorted(range(3), key=lambda j: int(m.index[j, 0]))
    segments = [s for s, j in enumerate(order) for _ in range(int(m.batch.lengths[j]))] + [3]
    assert torch.equal(m.attention_mask()[0, 0], _expected_mask(segments))
    params = m.packed_seq_params()
    bounds = [0]
    for j in order:
        bounds.append(bounds[-1] + int(m.batch.lengths[j]))
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == bounds + [10]
    assert params.max_seqlen_q == 4


def test_masked_rows_fill_first_fit():
    batch = _batch([6, 2, 3, 4, 1])
    (m,) = micro_batches(batch, Batching(max_tokens=18, pack=True), pad_id=0, one_row=False)
    # rows of width 6, longest first, each into the first with room: [6], [4, 2], [3, 1 + pad 2]
    assert m.tokens.shape == (3, 6)
    mask = m.attention_mask()
    assert mask.shape == (3, 1, 6, 6)
    assert torch.equal(mask[0, 0], _expected_mask([0] * 6))
    assert torch.equal(mask[1, 0], _expected_mask([1] * 4 + [2] * 2))
    assert torch.equal(mask[2, 0], _expected_mask([3] * 3 + [4] + [5] * 2))
    with pytest.raises(ValueError, match="one packed row"):
        m.packed_seq_params()


def test_equal_length_rows_for_pipeline_parallel():
    batch = _batch(_lengths(3))
    micro = micro_batches(batch, Batching(max_tokens=150, pack=True), pad_id=0, pad_multiple=2, equal_length=True)
    widths = {m.tokens.shape[1] for m in micro}
    assert len(widths) == 1 and widths.pop() % 2 == 0


@pytest.mark.parametrize("way", WAYS)
def test_per_sequence_values_lay_out_into_the_rows_and_back(way):
    """MicroBatch.layout (per-sequence [n, L, ...] -> the model's rows [r, T, ...], as routing replay
    uses it) puts each sequence's value at its own tokens and ``fill`` everywhere else, and
    unpack inverts it, trailing dimensions included."""
    batching, one_row = WAYS[way]
    batch = _batch(_lengths(3))
    for m in micro_batches(batch, batching, pad_id=0, one_row=one_row, pad_multiple=4):
        n, width = m.batch.tokens.shape
        values = torch.arange(n * width * 6, dtype=torch.int16).reshape(n, width, 3, 2)
        laid = m.layout(values, fill=-1)
        assert laid.shape == (*m.tokens.shape, 3, 2)
        own = m.layout(torch.ones(n, width, dtype=torch.bool), fill=False)
        assert int(own.sum()) == int(m.batch.lengths.sum())  # exactly the sequences' own tokens
        assert bool((laid[~own] == -1).all())
        assert torch.equal(m.layout(m.batch.tokens)[own], m.tokens[own])  # the same slots as the input ids
        back = m.unpack(laid, fill=-1)
        inside = torch.arange(width) < m.batch.lengths.unsqueeze(1)
        assert torch.equal(back[inside], values[inside]) and bool((back[~inside] == -1).all())


@pytest.mark.parametrize("way", WAYS)
def test_min_count_splits_then_adds_fillers(way):
    """Expert parallelism needs one micro-batch count on every rank: min_count splits the fullest
    micro-batches (every sequence still exactly once, the budget still held) and, past one sequence
    per micro-batch, repeats the smallest as fillers with no loss tokens and zero advantages."""
    batching, one_row = WAYS[way]
    batch = _batch([40, 7, 13, 9, 30, 5])
    natural = micro_batches(batch, batching, pad_id=0, one_row=one_row)
    for target in (len(natural) + 1, 6, 9):
        micro = micro_batches(batch, batching, pad_id=0, one_row=one_row, min_count=target)
        assert len(micro) == max(target, len(natural))
        real = [m for m in micro if not m.filler]
        assert sorted(i for m in real for i in m.rows.tolist()) == list(range(6))
        assert len(real) == min(max(target, len(natural)), 6)
        if batching.max_tokens:
            assert all(m.computed_tokens <= batching.max_tokens for m in real)
        for f in (m for m in micro if m.filler):
            assert f.batch.loss_mask.sum() == 0 and bool((f.batch.advantages == 0).all())
            assert f.computed_tokens == min(m.computed_tokens for m in real)


def test_too_long_sequence_is_a_clear_error():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        micro_batches(_batch([5, 30]), Batching(max_tokens=20, pack=True), pad_id=0)
    with pytest.raises(ValueError, match="exactly one"):
        Batching(size=2, max_tokens=10)
    with pytest.raises(ValueError, match="token budget"):
        Batching(size=2, pack=True)


def test_config_checks_the_budget_against_the_engine_context():
    base = {"model": {"tiny": "qwen2"}, "rollout": {"sampling": {"max_prompt_length": 64, "max_response_length": 64}}}
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch=100 cannot hold"):
        config_from_dict({**base, "trainer": {"max_tokens_per_micro_batch": 100}})
    with pytest.raises(ConfigError, match="sequence_packing needs"):
        config_from_dict({**base, "trainer": {"sequence_packing": True}})
    cfg = config_from_dict({**base, "trainer": {"max_tokens_per_micro_batch": 128, "sequence_packing": True}})
    assert Batching.for_update(cfg.trainer) == Batching(max_tokens=128, pack=True)
    assert Batching.for_logprobs(cfg.trainer) == Batching(max_tokens=128, pack=True)


# fp32 on CPU: the packed row runs RoPE at shifted absolute positions (relative offsets are equal)
# and sums in another order; the fused-linear path reduces the vocabulary in chunks.
LOGPROB_TOL, LOSS_TOL, GRAD_REL_TOL, WEIGHT_TOL = 2e-5, 2e-5, 2e-4, 2e-4


TWO_RANKS = dist_job("packing", "check_packing.py", "{dir}/result.json", "dp2", "tp2", "tp2_sp", "pp2", timeout=900)
ONE_RANK = dist_job("packing_one_rank", "check_packing.py", "{dir}/result.json", "single", nproc=1)


@pytest.fixture(scope="module")
def packing_two_ranks(dist_jobs):
    return read_results(dist_jobs.run("packing") / "result.json")


@pytest.fixture(scope="module")
def packing_one_rank(dist_jobs):
    return read_results(dist_jobs.run("packing_one_rank") / "result.json")


def _check(results: dict) -> None:
    ways = {k.split("/")[2] for k in results}
    assert ways == {"padded", "padded_fused", "budget", "packed", "packed_one_row"}
    for key, row in results.items():
        assert row["grad_rel"] <= GRAD_REL_TOL, (key, row)
        assert row["weight_abs"] <= WEIGHT_TOL, (key, row)
        if "logprob_abs" in row:
            assert row["logprob_abs"] <= LOGPROB_TOL, (key, row)
            assert row["loss_abs"] <= LOSS_TOL, (key, row)
    tokens = {way: sum(r["computed_tokens"] for k, r in results.items() if f"/{way}/" in k) for way in ways}
    assert tokens["packed"] <= tokens["budget"] and tokens["packed_one_row"] < tokens["padded"], tokens


@ONE_RANK
def test_packed_budget_and_fused_equal_padded_on_one_rank(packing_one_rank):
    _check(packing_one_rank)


@TWO_RANKS
@pytest.mark.parametrize("layout", ["dp2", "tp2", "tp2_sp", "pp2"])
def test_packed_budget_and_fused_equal_padded_on_two_ranks(packing_two_ranks, layout):
    _check({k: v for k, v in packing_two_ranks.items() if k.startswith(layout + "/")})
