"""Experiment trackers (megatron_alp/runtime/trackers.py), each with its real library writing to a
local directory: TensorBoard event files, a Weights & Biases offline run, an MLflow file store."""

import json

import pytest
from matplotlib.figure import Figure

from megatron_alp.config import ConfigError
from megatron_alp.resolve import config_from_dict
from megatron_alp.runtime.run_log import RunLogger

SETTINGS = {"wandb_project": "megatron-alp-test", "wandb_mode": "offline", "mlflow_tracking_uri": None,
            "mlflow_experiment": "tests"}


def _figure(path):
    fig = Figure(figsize=(2, 2))
    fig.subplots().plot([0, 1], [0, 1])
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A two-record run tracked by all three, as the trainer tracks one."""
    run = tmp_path_factory.mktemp("tracked") / "run"
    run.mkdir()
    logger = RunLogger(run, total_iterations=2, start_iteration=0, trackers=["tensorboard", "wandb", "mlflow"],
                       tracker_settings=SETTINGS, progress_bar=False, config={"loss": {"name": "alp_token"}, "seed": 1})
    logger.log(-1, {"step": 0, "val/reward_mean": 0.125})
    logger.log(0, {"step": 4, "reward/mean": 0.25, "val/pass@4": 0.5, "note": "not a number"})
    logger.figures({"reward": _figure(run / "plots" / "reward.png")})
    logger.summary({"summary/reward_last": 0.25})
    logger.close()
    return run


def test_metrics_jsonl_holds_every_record(tracked):
    records = [json.loads(line) for line in (tracked / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [-1, 0] and records[1]["note"] == "not a number"


def test_tensorboard_event_files(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tracked / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(4, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("val/reward_mean")] == [(0, 0.125)]
    assert "figures/reward" in events.Tags()["images"]


def test_mlflow_file_store(tracked):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tracked / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "tests"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.params["loss.name"] == "alp_token" and run.data.params["seed"] == "1"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [(4, 0.25)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "val/pass_4")] == [0.5]  # "@" is not allowed
    assert run.data.metrics["summary/reward_last"] == 0.25
    assert [a.path for a in client.list_artifacts(run.info.run_id, "figures")] == ["figures/reward.png"]


def test_wandb_offline_run(tracked):
    (run_dir,) = (tracked / "wandb").glob("offline-run-*")
    (records,) = run_dir.glob("*.wandb")
    data = records.read_bytes()
    assert b"reward/mean" in data and b"val/reward_mean" in data and b"alp_token" in data
    assert list(run_dir.rglob("*.png")), "the figure was logged as a W&B image"


def test_a_tracker_without_its_package_is_refused_at_config_time(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"trainer.loggers lists mlflow, whose package is not installed: "
                                          r"pip install mlflow-skinny"):
        config_from_dict({"model": {"tiny": "qwen2"}, "trainer": {"loggers": ["tensorboard", "mlflow"]}})
    with pytest.raises(ConfigError, match=r"trainer.loggers lists wandb, which needs trainer.wandb_project"):
        config_from_dict({"model": {"tiny": "qwen2"}, "trainer": {"loggers": ["wandb"]}})
    older = config_from_dict({"model": {"tiny": "qwen2"}, "trainer": {"tensorboard": False, "wandb_project": "p"}})
    assert older.trainer.loggers == ["wandb"]  # the keys of older configs still mean what they meant


def test_a_resumed_run_goes_on_in_the_same_mlflow_run(tmp_path):
    from mlflow.tracking import MlflowClient

    for start, reward in ((0, 0.25), (1, 0.5)):
        logger = RunLogger(tmp_path, total_iterations=2, start_iteration=start, trackers=["mlflow"],
                           tracker_settings=SETTINGS, progress_bar=False, config={"seed": 1})
        logger.log(start, {"step": start + 1, "reward/mean": reward})
        logger.close()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "tests"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [(1, 0.25),
                                                                                                       (2, 0.5)]
