"""Delta weight export (megatron_alp/models/hf_delta.py): after an anchor, receivers rebuild the model
from the changed elements alone, bit for bit those of the dense HF gather (iter_hf_weights).

One launch of tests/dist/check_hf_delta.py on two gloo ranks under the collective-device checker
(every collective's tensors where NCCL takes them on a GPU job) records each scenario; the expected
values come from iter_hf_weights gathers of the same models."""

from __future__ import annotations

import pytest
from helpers import dist_job, read_results

HF_DELTA = dist_job("hf_delta", "check_hf_delta.py", "{dir}/result.json",
                    env={"MEGATRON_ALP_CHECK_COLLECTIVE_DEVICES": "1"})
pytestmark = HF_DELTA

# layout -> receivers (tests/dist/check_hf_delta.py: LAYOUTS)
LAYOUTS = {"tp2": [0], "pp2": [0], "ep2": [1], "dp2": [0], "dp2_both": [0, 1]}
INDEX_AND_BF16 = 4 + 2  # bytes of one changed element sent as a pair


@pytest.fixture(scope="module")
def results(dist_jobs) -> dict:
    return read_results(dist_jobs.run("hf_delta") / "result.json")


def ranks(results: dict, scenario: str) -> list[dict]:
    return [results[f"{scenario}_rank{r}"] for r in (0, 1)]


def receiving(results: dict, layout: str) -> list[dict]:
    return [rec for r, rec in enumerate(ranks(results, layout)) if r in LAYOUTS[layout]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_receivers_rebuild_the_model_bit_for_bit(results, layout):
    """An anchor, then three deltas (1% of the elements' lowest bit flipped; at the second also one
    tensor changed everywhere): the anchor's tensors with every delta's yields laid over them equal a
    fresh iter_hf_weights, tensor by tensor; a delta yields exactly the HF tensors of the Megatron
    tensors that changed; a rank that is no receiver yields nothing."""
    for r, rec in enumerate(ranks(results, layout)):
        assert rec["receiver"] == (r in LAYOUTS[layout])
        assert rec["anchor"]["stats"]["anchor"] and rec["anchor"]["differs"] == []
        for step in rec["steps"]:
            assert not step["stats"]["anchor"] and step["differs"] == [], step["differs"]
            if rec["receiver"]:
                assert step["yielded"] and sorted(step["yielded"]) == sorted(step["expected_yield"])
                assert len(step["yielded"]) < rec["anchor"]["yielded"]  # some tensors kept no change
            else:
                assert step["yielded"] == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_changed_fraction_is_the_models_on_every_rank(results, layout):
    """``changed`` / ``elements``: the elements whose bits differ between the gathers before and after
    the change, out of all of them, the same on every rank."""
    expected = receiving(results, layout)[0]
    for rec in ranks(results, layout):
        for step, want in zip(rec["steps"], expected["steps"]):
            assert step["stats"]["changed"] == want["expected_changed"] > 0
            assert step["stats"]["elements"] == want["expected_elements"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_sparse_delta_moves_a_few_percent_of_the_dense_bytes(results, layout):
    """An anchor brings a receiver the dense model; a delta of 1% flipped elements at least an index
    and a value per change and under a tenth of the dense bytes; a rank that is no receiver nothing."""
    for r, rec in enumerate(ranks(results, layout)):
        if not rec["receiver"]:
            assert all(s["stats"]["bytes"] == 0 for s in [rec["anchor"], *rec["steps"]])
            continue
        dense = rec["steps"][0]["dense_bytes"]
        assert rec["anchor"]["stats"]["bytes"] == dense
        for step in rec["steps"][::2]:  # without the dense change
            assert INDEX_AND_BF16 * step["stats"]["changed"] <= step["stats"]["bytes"] < dense / 10


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_corrupted_mirror_raises_on_its_receiver_and_the_next_stream_is_full(results, layout):
    """One bit flipped in the first receiver's mirror: that receiver, and it alone, raises DeltaMismatch
    naming the tensor once the stream is over (no rank waits: the job went on); the next stream is an
    anchor on every rank and exact again."""
    first = LAYOUTS[layout][0]
    for r, rec in enumerate(ranks(results, layout)):
        raised = rec["mismatch"]["raised"]
        assert ("embedding.word_embeddings.weight" in raised) if r == first else raised == "", raised
        after = rec["mismatch"]["after"]
        assert after["stats"]["anchor"] and after["differs"] == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reset_on_one_rank_makes_the_next_stream_dense_everywhere(results, layout):
    """reset() on rank 1 alone: the next stream is an anchor on both ranks, every HF tensor yielded to
    each receiver, the dense bytes, exact."""
    for rec in ranks(results, layout):
        reset = rec["reset"]
        assert reset["stats"]["anchor"] and reset["differs"] == []
        if rec["receiver"]:
            assert len(reset["yielded"]) == rec["anchor"]["yielded"]
            assert reset["stats"]["bytes"] == reset["dense_bytes"]


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "dp2_both"])
def test_memory_snapshot_is_a_shard_and_mirror_the_model(results, layout):
    """Mirror: the model's dense bytes. Snapshot: the rank's own shard, so the two ranks of one model
    replica (TP=2, PP=2) hold the model once between them, and a data-parallel rank all of it."""
    dense = receiving(results, layout)[0]["steps"][0]["dense_bytes"]
    memory = [rec["memory"] for rec in ranks(results, layout)]
    assert all(m["mirror"] == dense for m in memory)
    if layout.startswith("dp2"):
        assert all(m["snapshot"] == dense for m in memory)
    else:
        assert memory[0]["snapshot"] + memory[1]["snapshot"] == dense and 0 < memory[1]["snapshot"] < dense


def test_float32_with_every_element_changed_falls_back_to_dense_shards(results):
    """Every element of a float32 TP=2 model changed: pairs would be three times the dense bytes, so
    each shard travels dense; a receiver gets the dense bytes plus headers, exact."""
    rec = ranks(results, "float32")[0]
    stats, dense = rec["stats"], rec["dense_bytes"]
    assert stats["changed"] == stats["elements"] == rec["expected_changed"] == rec["expected_elements"]
    assert dense <= stats["bytes"] < dense * 1.01 and rec["differs"] == []


def test_one_real_optimizer_step_of_a_tied_model(results):
    """One Adam step (lr 1e-5) of a tied bf16 model under Megatron DDP on two data-parallel ranks, the
    snapshot in host memory: the receiver rebuilds it exactly from the changed elements."""
    rec = ranks(results, "optimizer")[0]
    stats = rec["stats"]
    assert rec["differs"] == [] and sorted(rec["yielded"]) == sorted(rec["expected_yield"])
    assert 0 < stats["changed"] == rec["expected_changed"] < stats["elements"] == rec["expected_elements"]
    assert stats["bytes"] < rec["dense_bytes"]


def test_lora_layers_send_their_merged_weight(results):
    """TP=2 LoRA: new B factors of the QKV adapters change the merged W + s B A of those layers only;
    receiver rank 1 yields exactly their q/k/v tensors, bit for bit the merged gather."""
    rec = ranks(results, "lora")[1]
    assert rec["differs"] == [] and rec["yielded"]
    assert sorted(rec["yielded"]) == sorted(rec["expected_yield"])
    assert all(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) for n in rec["yielded"])
    assert ranks(results, "lora")[0]["yielded"] == []
