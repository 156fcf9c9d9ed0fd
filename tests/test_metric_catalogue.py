"""The metric catalogue (megatron_alp/trainer/metric_catalogue.py) is the one list of the metrics a run
writes: every key the shared CI-sized runs write has an entry, every entry said to be there every
iteration is, and each names a module that exists. docs/reference/metrics.md is generated from it
(tests/test_config_docs.py keeps that current)."""

from pathlib import Path

import pytest
from helpers import metrics

from megatron_alp.trainer.metric_catalogue import METRICS, metric_of

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_alp"


def _check(run: Path) -> None:
    records = metrics(run)
    assert records, run
    unknown = sorted({k for r in records for k in r if metric_of(k) is None})
    assert not unknown, f"keys with no entry in megatron_alp/trainer/metric_catalogue.py: {unknown}"
    training = [r for r in records if r["iteration"] >= 0]
    always = [m for m in METRICS if m.when == "every iteration"]
    missing = sorted({m.pattern for m in always for r in training if not any(m.matches(k) for k in r)})
    assert not missing, f"catalogued as written every iteration, absent from a record of {run}: {missing}"


def test_every_key_the_shared_run_writes_is_catalogued(sync_run):
    _check(sync_run)


def test_every_key_the_two_rank_run_writes_is_catalogued(dp2_run):
    _check(dp2_run)


@pytest.mark.parametrize("key, pattern", [
    ("sigma/layer_03/mean", "sigma/{site}/mean"), ("sigma/mean", "sigma/mean"), ("val/pass@16", "val/pass@{k}"),
    ("val/math500/pass@4", "val/{file}/pass@{k}"), ("val/reward_mean", "val/reward_mean"),
    ("tir/status_frac/timeout", "tir/status_frac/{status}"), ("val/pass@x", None), ("sigma/a/b/mean", None),
    ("timing/total_s", "timing/total_s"), ("timing/unknown_s", None),
])
def test_keys_match_their_entry_and_nothing_else(key, pattern):
    entry = metric_of(key)
    assert (entry.pattern if entry else None) == pattern


def test_every_entry_is_unique_and_names_a_module_that_exists():
    patterns = [m.pattern for m in METRICS]
    assert len(patterns) == len(set(patterns))
    for m in METRICS:
        assert (PACKAGE / (m.module.replace(".", "/") + ".py")).exists(), m
        assert m.meaning.strip() and m.when.strip(), m
