"""Offloading Megatron's training state for a colocated rollout: the round trip is bit-identical and
really releases the storage (torchrun, gloo; the same code moves GPU state to pinned host memory)."""

from __future__ import annotations

import pytest
from helpers import read_results, torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("offload") / "result.json"
    torchrun("check_offload.py", str(path))
    return read_results(path)


@pytest.mark.parametrize("layout", ["dp2_bf16_distopt", "pp2_fp32"])
def test_offload_round_trip_is_bit_identical(results, layout):
    r = results[layout]
    assert r["released"] and r["grads_released"], r
    assert r["identical"], "weights or optimizer state changed in the round trip"
    assert r["same_training"], "the next step differs from a run that never offloaded"
    assert r["offload/bytes_moved"] > 0 and r["reload/bytes_moved"] == r["offload/bytes_moved"]
    assert r["offload/bytes_freed"] > r["offload/bytes_moved"]  # gradients are freed without a copy
