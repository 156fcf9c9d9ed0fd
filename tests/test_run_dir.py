"""The run directory (megatron_alp/trainer/run_dir.py): one run per directory, and a run's
checkpoint pruning never removes what is not its own."""

from pathlib import Path

import pytest

from megatron_alp.config import InputError
from megatron_alp.trainer.run_dir import claim_fresh, previous_run, prune_checkpoints


def _earlier_run(run: Path, iterations=(4, 6)) -> None:
    for i in iterations:
        (run / "checkpoints" / f"iter_{i:07d}").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"iteration": 5}\n')
    (run / "config.yaml").write_text("old: true\n")
    (run / "base_model").mkdir()
    (run / "logs").mkdir()


def test_a_fresh_run_refuses_a_directory_an_earlier_run_left_files_in(tmp_path):
    run = tmp_path / "run"
    _earlier_run(run)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    with pytest.raises(InputError, match=r"holds an earlier run \(checkpoints, metrics.jsonl, config.yaml, base_model "
                                         r"\(iter_0000004, iter_0000006\)\).*trainer.archive_previous=true"):
        claim_fresh(run, archive=False)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before  # nothing moved, nothing removed
    empty = tmp_path / "empty"
    (empty / "logs").mkdir(parents=True)  # a lock and logs alone are not a run
    (empty / ".lock").write_text("1")
    claim_fresh(empty, archive=False)
    assert previous_run(empty) == []


def test_archive_previous_moves_the_earlier_run_aside(tmp_path):
    run = tmp_path / "run"
    _earlier_run(run)
    claim_fresh(run, archive=True)
    assert previous_run(run) == [] and (run / "logs").is_dir()
    (archived,) = (run / "archive").iterdir()
    assert sorted(p.name for p in archived.iterdir()) == ["base_model", "checkpoints", "config.yaml", "metrics.jsonl"]
    assert sorted(p.name for p in (archived / "checkpoints").iterdir()) == ["iter_0000004", "iter_0000006"]


def test_pruning_keeps_the_newest_of_this_runs_checkpoints_only(tmp_path):
    """A run at iteration 3 never removes a checkpoint of a later iteration (not its own)."""
    for i in (1, 2, 3, 6):
        (tmp_path / "checkpoints" / f"iter_{i:07d}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "iter_0000004.tmp-x").mkdir()  # a save in progress is never counted
    prune_checkpoints(tmp_path, keep=2, upto=3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "iter_0000002", "iter_0000003", "iter_0000004.tmp-x", "iter_0000006"]
