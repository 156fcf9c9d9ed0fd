"""The phase table and the trainer following it: what is resident in every phase, measured."""

import json
from pathlib import Path

import pytest
import torch
from helpers import QUICKSTART_TIR, SEPARATE, train

from megatron_alp.plan.phases import PHASES
from megatron_alp.trainer.phases import STRICT_ENV, PhaseRunner
from megatron_alp.training.offload import TrainingStateOffloader

# What each phase must hold, written from the description of the phases (not read from the table)
MEGATRON = {
    "rollout": set(), "engine_start": set(), "validation": set(),
    "logprob": {"weights"}, "weight_sync": {"weights"}, "sync_verification": {"weights"}, "layer_probe": {"weights"},
    "engine_restart_resync": {"weights"}, "policy_update": {"weights", "grads", "optimizer"},
    "checkpoint_save": {"weights", "optimizer"},
}
ENGINE = {
    "rollout": "awake", "validation": "awake", "sync_verification": "awake", "layer_probe": "awake",
    "logprob": "asleep", "policy_update": "asleep", "checkpoint_save": "asleep",
    "weight_sync": "weights", "engine_restart_resync": "weights",
}


class FakeRollout:
    """Records, at every change of engine memory, what Megatron held at that moment."""

    sleeps = True

    def __init__(self, offloader):
        self.memory, self.offloader, self.events, self.entering = "awake", offloader, [], None

    def set_memory(self, state, resync=False):
        if state == self.memory:
            return
        held = {k for k, v in self.offloader.resident_bytes().items() if v}
        self.events.append((self.entering, self.memory, state, held))
        self.memory = state

    @property
    def held_memory(self):
        return self.memory


def test_every_phase_releases_before_it_allocates():
    """An engine wakes only after what the phase does not need of Megatron has left, and Megatron's
    state comes back only after the engine has gone to sleep."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    offloader = TrainingStateOffloader([model], optimizer)
    full = offloader.resident_bytes()
    assert all(full.values()), full
    runner = PhaseRunner()
    rollout = FakeRollout(offloader)
    runner.attach(offloader=offloader, rollout=rollout)
    before = [p.detach().clone() for p in model.parameters()]
    previous = "rollout"
    for name in ("rollout", "layer_probe", "logprob", "policy_update", "weight_sync", "sync_verification", "checkpoint_save",
                 "rollout", "engine_restart_resync", "rollout", "validation"):
        rollout.entering = name
        runner.enter(name)
        held = offloader.resident_bytes()
        assert {k for k, v in held.items() if v} == MEGATRON[name], (name, held)
        assert all(held[k] == full[k] for k in MEGATRON[name]), (name, held, full)
        assert rollout.memory == ENGINE[name], name
        for entering, old, new, then in [e for e in rollout.events if e[0] == name]:
            if ["asleep", "weights", "awake"].index(new) > ["asleep", "weights", "awake"].index(old):
                assert then <= MEGATRON[name], (name, old, new, then)  # woken beside only what the phase needs
            else:
                assert then <= MEGATRON[previous], (name, old, new, then)  # asleep before anything comes back
        previous = name
    runner.enter("policy_update")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the round trips are exact
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())  # gradients come back as zeros
    stats = runner.take_stats()
    assert stats["offload/bytes_moved"] == stats["reload/bytes_moved"] > 0


class StuckRollout:
    """An engine that never moves: awake whatever the phase asks."""

    memory, held_memory, sleeps = "awake", "awake", True

    def set_memory(self, state, resync=False):
        self.memory = state


def test_an_engine_holding_other_memory_than_its_phase_is_an_error_in_tests_and_one_warning_line_else(
        monkeypatch, capsys):
    runner = PhaseRunner()
    runner.attach(rollout=StuckRollout())
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(RuntimeError, match="phase logprob: the rollout engine's memory is 'awake', the phase table "
                                           "wants 'asleep'"):
        runner.enter("logprob")
    monkeypatch.setenv(STRICT_ENV, "0")
    for _ in range(3):
        runner.enter("logprob")
        runner.enter("rollout")
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["warning: phase logprob: the rollout engine's memory is 'awake', the phase table wants 'asleep'"]
    runner.rollout.sleeps = False  # engines that never sleep stay awake in every phase: nothing to say
    runner.enter("policy_update")
    assert capsys.readouterr().out == ""


def test_the_table_names_every_phase_the_trainer_and_the_plan_use():
    assert set(MEGATRON) | {"warm_start", "model_build"} == set(PHASES)
    assert {p.plan_row for p in PHASES.values()} == {"warm_start", "training", "rollout", "engine_restart_resync",
                                                      "weight_sync", "sync_verification", "layer_probe",
                                                      "checkpoint_save"}


def _ledger(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "phase_ledger" / "rank_0.jsonl").read_text().splitlines()]


def _check_follows_the_table(rows: list[dict], offloads: bool) -> None:
    """Every entry holds what its phase needs; with offloading nothing more, without it everything."""
    full = {k: max(r["megatron"][k] for r in rows if r["megatron"]) for k in ("weights", "grads", "optimizer")}
    seen_update = False
    for r in rows:
        phase = r["phase"]
        if phase in ("warm_start", "model_build", "engine_start") or r["at"] != "entry":
            continue
        held = {k for k, v in r["megatron"].items() if v}
        needed = MEGATRON[phase] if offloads else {"weights", "grads", "optimizer"}
        if not seen_update:
            needed = needed - {"optimizer"}  # Adam's state exists from the first update on
        assert held == needed, (phase, r["iteration"], r["megatron"])
        if offloads and phase == "checkpoint_save":  # the policy's weights, the reference model's left offloaded
            assert r["megatron"]["weights"] < full["weights"], r
            needed = needed - {"weights"}
        assert all(r["megatron"][k] == full[k] for k in needed), (phase, r)
        assert r["engine"] == (ENGINE[phase] if offloads else "awake"), (phase, r)
        seen_update = seen_update or phase == "policy_update"


def test_the_trainer_follows_the_phase_table(sync_run):
    """The shared quickstart run (tests/conftest.py: ledger on, sync verification, a checkpoint after
    every iteration, validation after the last): each phase entered in the trainer's order, holding
    what the table says, the offload moves running on the CPU too."""
    rows = _ledger(sync_run)
    entries = [p for p, _ in ((r["phase"], r["iteration"]) for r in rows if r["at"] == "entry")]
    iteration = ["rollout", "logprob", "policy_update", "weight_sync", "sync_verification", "weight_sync"]
    assert entries == ["warm_start", "model_build", "engine_start", *iteration, "checkpoint_save", *iteration,
                       "checkpoint_save", *iteration, "validation", "checkpoint_save"], entries
    _check_follows_the_table(rows, offloads=True)
    metrics = [json.loads(line) for line in (sync_run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["offload/bytes_moved"] > 0 and m["reload/bytes_moved"] > 0 for m in metrics)


@pytest.mark.slow  # a kill/crash soak (minutes on 2 cores): pytest -m slow
def test_the_trainer_follows_the_phase_table_through_an_engine_crash(tmp_path):
    """The CPU quickstart with the ledger on (the offload moves run on the CPU too), sync
    verification, validation, a checkpoint every iteration, and the engine (in its own process)
    SIGKILLed as the second rollout starts: it is restarted and resynced with Megatron's weights back, and the run finishes."""
    run = tmp_path / "run"
    rc, out = train(run, "trainer.iterations=2", "trainer.save_interval=1", "trainer.eval_interval=2",
                    "rollout.verify_sync=true", "trainer.phase_ledger=true", "rollout.engine_process=subprocess",
                    env={"MEGATRON_ALP_KILL_ENGINE_AT_ROLLOUT": "1"})
    assert rc == 0, out[-6000:]
    rows = _ledger(run)
    entries = [(r["phase"], r["iteration"]) for r in rows if r["at"] == "entry"]
    iteration = ["logprob", "policy_update", "weight_sync", "sync_verification", "weight_sync"]
    assert [p for p, _ in entries] == (
        ["warm_start", "model_build", "engine_start", "rollout", *iteration, "checkpoint_save",
         "rollout", "engine_restart_resync", "sync_verification", "engine_restart_resync", "rollout",
         *iteration, "validation", "checkpoint_save"]), entries
    _check_follows_the_table(rows, offloads=True)
    engine_start_exit = next(r for r in rows if r["phase"] == "engine_start" and r["at"] == "exit")
    assert engine_start_exit["engine"] == "awake" and not any(engine_start_exit["megatron"].values())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # every sync was verified (a failed verification ends the run), the resync's too
    assert [m["iteration"] for m in metrics] == [0, 1] and all("sync/verify_mean_abs_diff" in m for m in metrics)
    assert all(m["offload/bytes_moved"] > 0 and m["reload/bytes_moved"] > 0 for m in metrics)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["async", "tir"])
def test_async_and_tir_runs_follow_the_phase_table(tmp_path, variant):
    """Separate engines never sleep and nothing is offloaded; a TIR run takes the colocated phases."""
    run = tmp_path / variant
    if variant == "async":
        rc, out = train(run, "trainer.iterations=2", "trainer.phase_ledger=true", *SEPARATE,
                        "trainer.max_staleness=1")
    else:
        rc, out = train(run, "trainer.iterations=2", "trainer.phase_ledger=true", config=QUICKSTART_TIR)
    assert rc == 0, out[-6000:]
    _check_follows_the_table(_ledger(run), offloads=variant == "tir")

