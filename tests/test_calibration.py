"""``perturbation.init_std: auto``: sigma calibrated from the measured engine-training mismatch."""

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import dist_job, read_results

from megatron_alp.config import InputError, PerturbationConfig
from megatron_alp.training import calibration
from megatron_alp.training.calibration import (
    MAX_EVALUATIONS,
    MAX_SCALE,
    NOISE_DRAWS,
    TOLERANCE,
    _next_scale,
    calibrate_sigma,
    calibration_line,
    real_positions,
    robust_rms,
)
from megatron_alp.training.micro_batch import Batching, micro_batches
from megatron_alp.training.rl_batch import RLBatch


CALIBRATION = dist_job("calibration", "check_calibration.py", "{dir}/result.json")


@pytest.fixture(scope="module")
def calibrated(dist_jobs):
    return read_results(dist_jobs.run("calibration") / "result.json")


@CALIBRATION
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


@CALIBRATION
@pytest.mark.parametrize("run", ["dp2/1", "pp2/1", "tp2_sp/1", "dp2/4"])
def test_calibration_leaves_the_logprob_passes_unperturbed(calibrated, run):
    assert calibrated[run]["unperturbed_unchanged"] is True


def _per_layer(sigmas: list[dict]) -> dict:
    merged = {}
    for rank in sigmas:
        for key, value in rank.items():
            assert merged.setdefault(key, value) == value, (key, sigmas)  # replicas of a layer agree exactly
    return merged


@CALIBRATION
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


# ------------------------------------------- failure modes (audit of issue 26), one process, no model


class _Simulated:
    """Stands in for the model's passes: ``rollout`` vs ``old`` logprobs given, and a perturbed pass
    whose log-ratio to ``old`` is ``bound * tanh(sigma / rms) * z_j`` per token (draw j): KL grows
    as sigma^2 for small sigma and saturates (as a policy swamped by noise does)."""

    def __init__(self, monkeypatch, rollout, old, bound=2.0):
        self.sigmas, self.passes, self.bound = [], 0, bound
        self.rms = [0.5, 2.0]
        self.batch = RLBatch(torch.zeros(old.shape, dtype=torch.long), torch.zeros(old.shape, dtype=torch.long),
                             torch.ones(old.shape), rollout, torch.zeros(old.shape[0]),
                             torch.full((old.shape[0],), old.shape[1]), old_logprobs=old)
        fake_ps = SimpleNamespace(is_pipeline_last_stage=lambda: True, get_data_parallel_world_size=lambda: 1,
                                  get_tensor_model_parallel_world_size=lambda: 1)
        monkeypatch.setattr(calibration, "ps", fake_ps)
        monkeypatch.setattr(calibration, "from_last_stage", lambda v: v)
        monkeypatch.setattr(calibration, "layer_input_rms", lambda model, batch, passes: list(self.rms))
        monkeypatch.setattr(calibration, "set_sigmas", lambda model, sigmas: self.sigmas.append(list(sigmas)))
        monkeypatch.setattr(calibration, "compute_logprobs", self.perturbed)

    def perturbed(self, model, batch, *, perturb_step, **passes):
        self.passes += 1
        z = _draw(batch.old_logprobs.shape, perturb_step)
        return batch.old_logprobs + self.bound * math.tanh(self.sigmas[-1][0] / self.rms[0]) * z

    def calibrate(self, target):
        cfg = PerturbationConfig(enabled=True, init_std="auto", calibration_target=target)
        return calibrate_sigma(None, self.batch, cfg, iteration=0, batching=None, temperature=1.0, pad_id=0,
                               fused=True)


class _EverySite(_Simulated):
    """As :class:`_Simulated`, with every site's noise moving the policy: the log-ratio to ``old`` is
    ``bound * tanh(sqrt(sum_h (sigma_h / rms_h)^2)) * z_j``."""

    def size(self, sigmas: list[float]) -> float:
        return self.bound * math.tanh(math.sqrt(sum((s / r) ** 2 for s, r in zip(sigmas, self.rms))))

    def perturbed(self, model, batch, *, perturb_step, **passes):
        self.passes += 1
        return batch.old_logprobs + self.size(self.sigmas[-1]) * _draw(batch.old_logprobs.shape, perturb_step)


def _draw(shape, perturb_step):
    """The simulated noise of one perturbed pass: standard normal, seeded by the pass's step."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(-perturb_step))


def _k3(log_ratio: torch.Tensor) -> float:
    """mean(r - 1 - log r) over the given log-ratios."""
    d = log_ratio.double()
    return float((d.exp() - 1 - d).mean())


def _logprobs(seed, shape=(8, 50)):
    return -torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_a_reachable_target_is_met(monkeypatch):
    old = _logprobs(1)
    sim = _Simulated(monkeypatch, old + 0.01 * _logprobs(2), old)
    m = sim.calibrate(1.0)
    assert m["calibration/perturbed_kl"] == pytest.approx(m["calibration/target_kl"], rel=TOLERANCE)
    assert m["calibration/fallback"] == 0.0 and sim.sigmas[-1] == [m["calibration/scale"] * r for r in sim.rms]


def test_an_unreachable_target_stops_with_an_error_naming_the_key(monkeypatch):
    """Target 1e7 x the mismatch: the perturbed KL saturates below it, the search stops at the
    largest scale it allows and refuses to go on with the closest candidate."""
    old = _logprobs(1)
    sim = _Simulated(monkeypatch, old + 0.01 * _logprobs(2), old)
    with pytest.raises(InputError, match=r"^perturbation\.calibration_target: 1e\+07 x the engine-train KL .* out of "
                                         r"reach.*perturbation\.init_std"):
        sim.calibrate(1e7)
    assert sim.passes <= MAX_EVALUATIONS * NOISE_DRAWS
    assert max(s[0] for s in sim.sigmas) <= MAX_SCALE * sim.rms[0] * (1 + 1e-12)


@pytest.mark.parametrize("case", ["all_nan", "identical"])
def test_no_measurable_mismatch_falls_back_to_the_default_sigma_with_a_warning(monkeypatch, case):
    """No finite engine logprob at all, or an engine bit-identical to the trainer (KL 0), gives no
    size to match: every sigma is perturbation.init_std's default (> 0: log-sigma finite, its
    gradient alive), the metrics say so and the terminal line is a warning."""
    old = _logprobs(1)
    rollout = torch.full_like(old, float("nan")) if case == "all_nan" else old.clone()
    sim = _Simulated(monkeypatch, rollout, old)
    m = sim.calibrate(1.0)
    default = PerturbationConfig.model_fields["init_std"].default
    assert sim.sigmas == [[default] * len(sim.rms)] and default > 0
    assert m["calibration/fallback"] == 1.0 and sim.passes == 0
    assert m["calibration/bad_tokens"] == (old.numel() if case == "all_nan" else 0)
    line = calibration_line(m, {"sigma/mean": default, "sigma/layer0/mean": default}, PerturbationConfig(), 0)
    assert line.startswith("WARNING: sigma not calibrated") and "perturbation.init_std" in line
    assert (f"{old.numel()} tokens with a non-finite logprob left out" in line) == (case == "all_nan")


def test_tokens_with_a_non_finite_logprob_are_left_out_and_counted(monkeypatch):
    """Issue 41 audit: one NaN or -inf engine logprob (or -inf old-policy logprob) among the batch's
    tokens no longer voids the calibration: those tokens are left out of both KLs, counted in
    calibration/bad_tokens and named on the terminal line; the measured KL is the k3 over the
    finite tokens and the target is met."""
    old = _logprobs(1)
    rollout = old + 0.01 * _logprobs(2)
    rollout[0, 0], rollout[3, 7], old[5, 2] = float("nan"), float("-inf"), float("-inf")
    sim = _Simulated(monkeypatch, rollout, old)
    m = sim.calibrate(1.0)
    finite = torch.ones(old.shape, dtype=torch.bool)
    finite[0, 0] = finite[3, 7] = finite[5, 2] = False
    assert m["calibration/bad_tokens"] == 3 and m["calibration/fallback"] == 0.0
    assert m["calibration/train_engine_kl"] == pytest.approx(_k3((old - rollout)[finite]), rel=1e-12)
    assert m["calibration/perturbed_kl"] == pytest.approx(m["calibration/target_kl"], rel=TOLERANCE)
    line = calibration_line(m, {"sigma/layer_00/mean": 1e-3, "sigma/layer_01/mean": 2e-3}, PerturbationConfig(), 0)
    assert line.startswith("sigma calibrated") and line.endswith("; 3 tokens with a non-finite logprob left out")


def test_the_layer_rms_excludes_padding_and_filler_micro_batches():
    """real_positions marks, in a layer input's [tokens * rows] order, exactly each sequence's own
    tokens, for padded and packed micro-batches; a filler micro-batch has none."""
    lengths = torch.tensor([5, 2, 7])
    batch = RLBatch(torch.ones(3, 7, dtype=torch.long), torch.ones(3, 7, dtype=torch.long), torch.ones(3, 7),
                    torch.zeros(3, 7), torch.zeros(3), lengths)
    for pack in (False, True):
        mbs = micro_batches(batch, Batching(max_tokens=16, pack=True) if pack else Batching(size=2), pad_id=0,
                            one_row=pack)
        real = sum(int(real_positions(mb, False).sum()) for mb in mbs if not mb.filler)
        assert real == int(lengths.sum()), pack
        for mb in mbs:
            keep = real_positions(mb, False).reshape(mb.tokens.shape[1], mb.tokens.shape[0]).T
            assert keep.sum() == mb.batch.lengths.sum()
    filler = dataclasses.replace(micro_batches(batch, Batching(size=3), pad_id=0)[0], filler=True)
    assert not real_positions(filler, False).any()


def test_a_few_massive_dimensions_do_not_set_the_rms():
    """Qwen-like inputs: 4 of 256 dimensions 1000x larger. The plain RMS is ~125x the typical
    dimension's; the robust RMS (median over dimensions of each dimension's RMS) stays within 5%."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 256, generator=g, dtype=torch.float64)
    x[:, :4] *= 1000.0
    sums = torch.cat([(x ** 2).sum(0), torch.tensor([400.0], dtype=torch.float64)]).unsqueeze(0)
    plain = float(x.pow(2).mean().sqrt())
    (robust,) = robust_rms(sums)
    assert robust == pytest.approx(1.0, rel=0.05) and plain > 100


# ------------------------------------------------------ calibration_mode: per_layer, no model


def test_the_input_divergence_is_the_typical_dimensions_rms_of_the_difference():
    """Per chosen layer, over the tokens of every probe sequence: the median over hidden dimensions
    of each dimension's RMS of h_engine - h_train at the layer's input, computed here with numpy; a
    few massive dimensions (1000x) do not set it, and states of another shape are refused."""
    g = torch.Generator().manual_seed(3)
    train = [{"input": torch.randn(3, n, 65, generator=g)} for n in (5, 9)]  # odd: one median dimension
    noise = torch.tensor([1e-3, 4e-3, 2e-2])  # the engine's drift at each layer's input
    engine = []
    for t in train:
        d = torch.randn(t["input"].shape, generator=g) * noise[:, None, None]
        d[:, :, :2] *= 1000.0
        engine.append({"input": t["input"] + d})
    got = calibration.input_divergence(engine, train, [2, 0])
    for value, layer in zip(got, [2, 0]):
        diff = np.concatenate([(e["input"][layer] - t["input"][layer]).double().numpy() for e, t in zip(engine, train)])
        expected = float(np.sqrt(np.median((diff ** 2).mean(axis=0))))
        assert value == pytest.approx(expected, rel=1e-6)
        assert value == pytest.approx(float(noise[layer]), rel=0.15)
    with pytest.raises(ValueError, match=r"layer probe sequence 0: the engine's layer inputs are \(3, 4, 64\)"):
        calibration.input_divergence([{"input": torch.zeros(3, 4, 64)}], train[:1], [0])


def test_the_probe_takes_the_first_sequences_up_to_its_token_budget():
    sequences = [list(range(n)) for n in (300, 150, 200, 40)]
    probe = calibration.probe_sequences(sequences, budget=512)
    assert [len(s) for s in probe] == [300, 150, 62] and probe[2] == list(range(62))
    assert calibration.probe_sequences(sequences, budget=100) == [list(range(100))]


def test_per_layer_sigmas_follow_each_layers_divergence_and_meet_the_target(monkeypatch):
    """sigma_h = scale x divergence_h: the ratio of two layers' sigmas is that of their divergences
    (not of their input RMS), the perturbed KL meets the target, and a layer the engine reproduces
    exactly (divergence 0) gets scale x DRIFT_FLOOR x the largest divergence, never 0."""
    old = _logprobs(1)
    sim = _Simulated(monkeypatch, old + 0.01 * _logprobs(2), old)
    cfg = PerturbationConfig(enabled=True, init_std="auto", calibration_mode="per_layer")
    divergence = [4e-3, 1e-3]
    m = calibrate_sigma(None, sim.batch, cfg, iteration=0, batching=None, temperature=1.0, pad_id=0, fused=True,
                        divergence=divergence + [0.0])
    sigmas = sim.sigmas[-1]
    assert m["calibration/per_layer"] == 1.0 and m["calibration/fallback"] == 0.0
    assert m["calibration/perturbed_kl"] == pytest.approx(m["calibration/target_kl"], rel=TOLERANCE)
    assert sigmas[0] / sigmas[1] == pytest.approx(4.0) and sigmas[0] == pytest.approx(m["calibration/scale"] * 4e-3)
    assert sigmas[2] == pytest.approx(m["calibration/scale"] * calibration.DRIFT_FLOOR * 4e-3, rel=1e-12)
    # noise never above the activations it is added to: scale x divergence <= input RMS in every layer
    assert all(s[0] <= sim.rms[0] * (1 + 1e-12) and s[1] <= sim.rms[1] * (1 + 1e-12) for s in sim.sigmas)


def test_no_layer_divergence_with_a_measured_mismatch_stops_naming_the_mode(monkeypatch):
    old = _logprobs(1)
    sim = _Simulated(monkeypatch, old + 0.01 * _logprobs(2), old)
    cfg = PerturbationConfig(enabled=True, init_std="auto", calibration_mode="per_layer")
    with pytest.raises(InputError, match=r"^perturbation\.calibration_mode: per_layer: .* use "
                                         r"perturbation\.calibration_mode: global"):
        calibrate_sigma(None, sim.batch, cfg, iteration=0, batching=None, temperature=1.0, pad_id=0, fused=True,
                        divergence=[0.0, 0.0])
    assert sim.passes == 0


def test_a_layer_the_engine_reproduces_exactly_gets_little_noise_and_the_target_stays_reachable(monkeypatch):
    """Issue 41 audit (fail): with bf16 on both sides layer 0's drift is exactly 0. It used to keep a
    fixed sigma of 1e-4 that the scale search could not shrink; here that noise alone gives about 4x
    the target KL (the precondition below, k3 ~ a^2 / 2 for a log-ratio a z), so the run stopped as
    "out of reach". Its sigma now scales with the others (DRIFT_FLOOR x the largest drift), the
    chosen sigmas meet the target by this test's own k3 over the search's noise draws, and nearly no
    noise sits on the layer the engine reproduces."""
    old = _logprobs(1)
    rollout = old + 2e-4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(5))
    sim = _EverySite(monkeypatch, rollout, old)
    sim.rms = [0.5, 2.0, 2.0]
    divergence = [0.0, 1e-3, 4e-3]
    measured = _k3(old - rollout)
    assert (sim.bound * 1e-4 / sim.rms[0]) ** 2 / 2 > 3 * measured
    cfg = PerturbationConfig(enabled=True, init_std="auto", calibration_mode="per_layer")
    m = calibrate_sigma(None, sim.batch, cfg, iteration=0, batching=None, temperature=1.0, pad_id=0, fused=True,
                        divergence=divergence)
    sigmas = sim.sigmas[-1]
    sizes = [calibration.DRIFT_FLOOR * max(divergence), 1e-3, 4e-3]
    assert sigmas == pytest.approx([m["calibration/scale"] * d for d in sizes], rel=1e-12)
    draws = [sim.size(sigmas) * _draw(old.shape, -(j + 1)) for j in range(NOISE_DRAWS)]
    assert sum(_k3(d) for d in draws) / NOISE_DRAWS == pytest.approx(measured, rel=TOLERANCE)
    assert m["calibration/train_engine_kl"] == pytest.approx(measured, rel=1e-12)
    assert m["calibration/evaluations"] <= 4


def test_the_drift_floor_scales_with_the_largest_drift():
    """A zero or below-floor drift becomes DRIFT_FLOOR x the largest, larger ones are kept, and
    scaling every drift by c scales the result by c: the floor moves with the others."""
    drifts = [0.0, 1e-9, 1e-3, 4e-3]
    floor = calibration.DRIFT_FLOOR * 4e-3
    assert calibration.DRIFT_FLOOR < 1e-2 and 1e-9 < floor
    assert calibration.floored(drifts) == [floor, floor, 1e-3, 4e-3]
    expected = [floor, floor, 1e-3, 4e-3]
    assert calibration.floored([7.0 * d for d in drifts]) == pytest.approx([7.0 * x for x in expected])


def test_the_terminal_line_names_what_sigma_is_a_multiple_of():
    m = {"calibration/scale": 1.1, "calibration/perturbed_kl": 1e-6, "calibration/target_kl": 1e-6,
         "calibration/train_engine_kl": 1e-6, "calibration/evaluations": 2.0, "calibration/fallback": 0.0,
         "calibration/bad_tokens": 0.0}
    sigmas = {"sigma/layer_00/mean": 1e-6, "sigma/layer_01/mean": 2e-3}
    for mode, words in [("global", "1.1 x layer-input RMS = 1e-06..0.002"),
                        ("per_layer", "1.1 x layer-input divergence engine-train"),
                        ("per_layer_added", "1.1 x drift added before each layer engine-train")]:
        cfg = PerturbationConfig(enabled=True, init_std="auto", calibration_mode=mode)
        assert words in calibration_line(m, sigmas, cfg, 0), mode


@CALIBRATION
@pytest.mark.parametrize("layout", ["dp2", "tp2_sp"])
def test_the_added_drift_is_the_drift_the_engine_adds_before_each_layer(calibrated, layout):
    """The check script's "engine" adds a drift delta at layer 2's input and nowhere else. The
    per_layer_added probe (the perturbed layers run on the engine's inputs) finds delta's robust RMS
    at layer 2 and nothing elsewhere; the cumulative probe (per_layer) also finds delta carried on
    to layer 3 by the network. Under TP=2 with sequence parallelism each rank feeds its own shard."""
    r = calibrated[f"added/{layout}"]
    delta = r["delta_rms"]
    assert r["added"][2] == pytest.approx(delta, rel=1e-4)
    assert max(r["added"][0], r["added"][1], r["added"][3]) < 1e-4 * delta  # TP: sums in another order
    assert r["cumulative"][:3] == pytest.approx(r["added"][:3], abs=1e-6 * delta)
    assert r["cumulative"][3] > 0.1 * delta
