"""``perturbation.init_std: auto``: sigma calibrated from the measured engine-training mismatch."""

import math

import pytest
from helpers import read_results, torchrun

from megatron_alp.config import PerturbationConfig
from megatron_alp.training.calibration import _next_scale, calibration_due


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("calibration") / "result.json"
    torchrun("check_calibration.py", str(out))
    return read_results(out)


@pytest.mark.parametrize("run", ["dp2/1", "pp2/1", "tp2_sp/1", "dp2/4"])
def test_the_perturbed_kl_meets_its_target_for_noise_the_search_never_drew(calibrated, run):
    """KL(pi_train || pi_train,sigma), estimated by the check script's own arithmetic over eight
    noise draws the calibration did not use, is within 10% of calibration_target x the measured
    engine-training KL; the calibration's measured KL is the script's."""
    r = calibrated[run]
    target = float(run.split("/")[1])
    measured = r["metrics"]["calibration/train_engine_kl"]
    assert measured == pytest.approx(r["engine_kl"], rel=1e-9)
    assert r["engine_kl"] > 0
    draws = r["perturbed_kl"]
    assert sum(draws) / len(draws) == pytest.approx(target * r["engine_kl"], rel=0.10), draws
    assert r["metrics"]["calibration/evaluations"] <= 6


@pytest.mark.parametrize("run", ["dp2/1", "pp2/1", "tp2_sp/1", "dp2/4"])
def test_calibration_leaves_the_logprob_passes_unperturbed(calibrated, run):
    assert calibrated[run]["unperturbed_unchanged"] is True


def _per_layer(sigmas: list[dict]) -> dict:
    merged = {}
    for rank in sigmas:
        for key, value in rank.items():
            assert merged.setdefault(key, value) == value, (key, sigmas)  # replicas of a layer agree exactly
    return merged


def test_every_layout_sets_the_same_sigmas_relative_to_the_layer_inputs(calibrated):
    """sigma_h = scale x RMS(input of layer h): sigma / scale is the layer's input RMS, the same in
    every layout (up to the sums' order); replicas (DP, TP) hold identical sigmas; a 4x KL target
    doubles every sigma (KL grows as sigma^2)."""
    rms = {}
    for run in ("dp2/1", "pp2/1", "tp2_sp/1"):
        scale = calibrated[run]["metrics"]["calibration/scale"]
        layers = _per_layer(calibrated[run]["sigmas"])
        assert len(layers) == 4
        rms[run] = {k: v / scale for k, v in layers.items()}
    for run in ("pp2/1", "tp2_sp/1"):
        for k, v in rms[run].items():
            assert v == pytest.approx(rms["dp2/1"][k], rel=1e-5), (run, k)
    one, four = _per_layer(calibrated["dp2/1"]["sigmas"]), _per_layer(calibrated["dp2/4"]["sigmas"])
    for k in one:
        assert four[k] / one[k] == pytest.approx(2.0, rel=0.1)


def test_calibration_runs_before_the_first_iteration_and_every_k():
    auto = PerturbationConfig(enabled=True, init_std="auto", calibrate_every=3)
    assert [i for i in range(10) if calibration_due(auto, i)] == [0, 3, 6, 9]
    once = PerturbationConfig(enabled=True, init_std="auto")
    assert [i for i in range(10) if calibration_due(once, i)] == [0]
    assert not any(calibration_due(PerturbationConfig(enabled=True, init_std=1e-4), i) for i in range(5))


def test_the_search_step_solves_a_power_law_in_one_step():
    """KL = c s^p: from two points the secant recovers p and lands on the target exactly; a draw
    too small to move any logprob (KL 0) grows the scale tenfold."""
    c, p, target = 3.0, 2.0, 1e-5
    history = [(1e-2, c * 1e-2 ** p)]
    s = _next_scale(history, target)  # slope 2 assumed first
    assert c * s ** p == pytest.approx(target, rel=1e-9)
    p = 1.5
    history = [(1e-2, c * 1e-2 ** p), (2e-2, c * 2e-2 ** p)]
    s = _next_scale(history, target)
    assert c * s ** p == pytest.approx(target, rel=1e-9)
    assert _next_scale([(1e-3, 0.0)], target) == pytest.approx(1e-2)
    assert math.isfinite(_next_scale([(1e-2, 1e300)], target))
    assert _next_scale([(1e-2, 2e-5), (1.0, math.inf)], target) == pytest.approx(0.1)  # overflow: back off
    assert _next_scale([(1e-2, 2e-5), (1.0, math.nan)], target) == pytest.approx(0.1)
