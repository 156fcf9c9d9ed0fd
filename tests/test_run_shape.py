"""The run shape (megatron_alp/plan/shape.py): what a config runs and when, decided in one place.
Expected schedules are written out from the keys' documented meaning, not computed by the code."""

import pytest

from megatron_alp.plan.phases import PHASES
from megatron_alp.plan.shape import RunShape
from megatron_alp.resolve import config_from_dict
from megatron_alp.trainer.trainer import RLTrainer

TINY = {"model": {"tiny": "qwen2"}}


def shape(**sections) -> RunShape:
    data = {**TINY, **sections}
    return RunShape.of(config_from_dict(data))


def test_calibration_runs_before_the_first_iteration_and_every_k():
    auto = shape(perturbation={"init_std": "auto", "calibrate_every": 3}, trainer={"iterations": 10})
    assert [i for i in range(10) if auto.calibrates(i)] == [0, 3, 6, 9]
    assert [i for i in range(10) if "calibration" in auto.due(i)] == [0, 3, 6, 9]
    once = shape(perturbation={"init_std": "auto"})
    assert [i for i in range(10) if once.calibrates(i)] == [0]
    fixed = shape(perturbation={"init_std": 1e-4})
    assert not any(fixed.calibrates(i) for i in range(5))
    assert not any(fixed.probes_layers(i) for i in range(5))


def test_the_layer_probe_comes_with_a_per_layer_calibration_only():
    per_layer = shape(perturbation={"init_std": "auto", "calibrate_every": 2, "calibration_mode": "per_layer"},
                      trainer={"iterations": 6})
    assert [i for i in range(6) if per_layer.probes_layers(i)] == [0, 2, 4]
    assert "layer_probe" not in per_layer.skipped
    added = shape(perturbation={"init_std": "auto", "calibration_mode": "per_layer_added"})
    assert added.probes_layers(0) and not added.probes_layers(1)
    plain = shape(perturbation={"init_std": "auto", "calibrate_every": 2})
    assert not any(plain.probes_layers(i) for i in range(6))
    assert plain.skipped["layer_probe"] == "perturbation.calibration_mode: per_layer not set"


def test_checkpoints_and_validation_follow_their_intervals_and_the_last_iteration():
    s = shape(trainer={"iterations": 7, "save_interval": 3, "eval_interval": 2, "validate_base": True})
    assert [done for done in range(8) if s.saves(done)] == [3, 6, 7]
    assert [done for done in range(8) if s.validates(done)] == [0, 2, 4, 6, 7]
    assert [i for i in range(7) if "checkpoint_save" in s.due(i)] == [2, 5, 6]
    quiet = shape(trainer={"iterations": 4, "eval_interval": 0, "validate_base": True})
    assert not any(quiet.validates(done) for done in range(5))
    assert quiet.skipped["validation"] == "trainer.eval_interval: 0"


QUIET = {"mismatch_metrics": False}


@pytest.mark.parametrize("sections, reference, old_pass", [
    ({"loss": {"name": "grpo", "kl_coef": 0.0}, "trainer": QUIET}, None, True),  # its ratio is pi_theta / pi_old
    ({"loss": {"name": "seq_bypass", "kl_coef": 0.0}, "trainer": QUIET}, None, False),  # pi_theta / pi_rollout
    ({"loss": {"name": "seq_bypass", "kl_coef": 0.0}}, None, True),  # the mismatch metrics read the old pass
    # ALP's one ratio is perturbed train / rollout: on a dense model nothing needs the old pass
    ({"loss": {"name": "alp_seq", "kl_coef": 0.0}, "trainer": QUIET}, None, False),
    # on an MoE model its update replays the old pass's routing (perturbation.moe_routing: fixed)
    ({"model": {"tiny": "qwen3_moe"}, "loss": {"name": "alp_seq", "kl_coef": 0.0}, "trainer": QUIET,
      "perturbation": {"moe_routing": "fixed"}}, None, True),
    ({"loss": {"name": "seq_bypass", "kl_coef": 0.01}, "trainer": QUIET}, "model", False),
    ({"loss": {"name": "seq_bypass", "kl_coef": 0.01}, "trainer": QUIET, "lora": {"enabled": True}}, "adapters_off",
     False),
])
def test_the_models_and_passes_a_config_needs(sections, reference, old_pass):
    s = shape(**sections)
    assert (s.reference, s.old_pass) == (reference, old_pass)


def test_every_phase_the_shape_skips_is_a_phase_of_the_table_and_says_why():
    s = shape(trainer={"eval_interval": 0, "sft_warmup_steps": 0}, rollout={"verify_sync": False})
    assert set(s.skipped) == {"validation", "warm_start", "sync_verification", "layer_probe"}
    assert set(s.skipped) <= set(PHASES)
    assert all(why for why in s.skipped.values())
    assert any("validation" in line for line in s.describe())


def test_the_shape_refuses_an_unresolved_config():
    from megatron_alp.config import validate_schema

    with pytest.raises(ValueError, match="resolved config"):
        RunShape.of(validate_schema(TINY))


class _Learner:
    """Counts the passes the trainer asks for."""
    reference = None

    def __init__(self):
        self.passes = []

    def old_pass(self, local):
        self.passes.append("old")


class _Calibrator:
    def __init__(self, shape: RunShape, learner: _Learner):
        self.shape, self.learner = shape, learner

    def due(self, iteration: int) -> bool:
        return self.shape.calibrates(iteration)

    def calibrate(self, local, iteration, divergence) -> dict:
        self.learner.passes.append("calibrate")
        return {}


def passes_per_iteration(iterations: int, **sections) -> list[list[str]]:
    """The logprob passes ``RLTrainer._logprob_passes`` runs in each iteration of a config."""
    trainer = RLTrainer.__new__(RLTrainer)
    trainer.shape, trainer.learner = shape(**sections), _Learner()
    trainer.calibrator = _Calibrator(trainer.shape, trainer.learner)
    out = []
    for i in range(iterations):
        trainer.iteration, trainer.learner.passes = i, []
        trainer._logprob_passes(None, {}, None)
        out.append(trainer.learner.passes)
    return out


@pytest.mark.parametrize("sections, expected", [
    # ALP's one ratio is perturbed train / rollout: without mismatch metrics or calibration, no extra pass
    ({"loss": {"name": "alp_token", "kl_coef": 0.0}, "trainer": QUIET}, [[], [], []]),
    # the default mismatch metrics run the old pass for ALP too, so ALP and GRPO run the same passes
    ({"loss": {"name": "alp_token", "kl_coef": 0.0}}, [["old"]] * 3),
    ({"loss": {"name": "grpo", "kl_coef": 0.0}, "trainer": QUIET}, [["old"]] * 3),
    # a calibration needs the old pass, only in the iterations it runs
    ({"loss": {"name": "alp_token", "kl_coef": 0.0}, "trainer": QUIET, "perturbation": {"init_std": "auto"}},
     [["old", "calibrate"], [], []]),
])
def test_an_alp_iteration_runs_the_old_pass_only_when_something_reads_it(sections, expected):
    assert passes_per_iteration(3, **sections) == expected
