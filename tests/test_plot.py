"""`megatron-alp plot`: figures from a synthetic run directory in the trainer's metrics layout."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron_alp.cli import main as cli_main
from megatron_alp.diagnostics.figures import (
    Run,
    draw_curve,
    draw_ratio_envelope,
    draw_sigma,
    make_plots,
    pearson_r,
    probability_scatter,
)

LAYERS = 4


def write_run(run_dir, iterations=30, *, sigma=True, ratios=True, token_probs=(10, 29), tail=1.0, seed=0):
    """A metrics.jsonl with every key the trainer writes (16 optimizer steps per iteration; validation
    every 10 iterations, as with trainer.eval_interval: 10)."""
    rng = np.random.default_rng(seed)
    run_dir.mkdir(parents=True)
    lines = []
    for it in range(iterations):
        rec = {"iteration": it, "step": 16 * (it + 1), "reward/mean": 0.2 + 0.5 * it / iterations,
               "response_length/mean": 30 + it, "loss/policy": -0.01, "loss/total": -0.01,
               "clip/low_frac": 0.01, "clip/high_frac": 0.02, "clip/dual_frac": 0.0, "mask/frac": 1.0,
               "mismatch/kl_k1": 1e-3 * (1 + it), "mismatch/kl_k3": 5e-4 * (1 + it), "mismatch/chi2": 2e-3,
               "mismatch/pearson_r": 0.99, "entropy/mean": 1.5 - it / iterations, "grad_norm": 0.5 + rng.random(),
               "lr": 1e-6, "timing/total_s": 3.0, "throughput/tokens_per_s": 1000.0}
        if ratios:
            spread = 0.05 + tail * 0.01 * it  # log-ratio quantiles widen over training
            rec.update({"ratio/p2": math.exp(-2 * spread), "ratio/p5": math.exp(-spread), "ratio/p50": 1.0,
                        "ratio/p95": math.exp(spread), "ratio/p98": math.exp(2 * spread),
                        "ratio/min": 0.1, "ratio/max": 9.0})
        if sigma:
            for layer in range(LAYERS):
                s = 1e-4 * (1 + it * (layer + 1) / 10)
                rec.update({f"sigma/layer_{layer:02d}/mean": s, f"sigma/layer_{layer:02d}/min": s / 2,
                            f"sigma/layer_{layer:02d}/max": 2 * s})
            rec["sigma/mean"] = 2e-4
        if (it + 1) % 10 == 0:
            rec.update({"val/reward_mean": 0.1 + 0.01 * it, "val/pass@1": 0.1 + 0.01 * it, "val/pass@4": 0.3})
        lines.append(json.dumps(rec))
    lines.insert(0, json.dumps({"iteration": -1, "step": 0, "val/reward_mean": 0.05, "val/pass@4": 0.1}))  # base model
    lines.append('{"iteration": 30, "step": 4')  # a line cut short by a kill
    (run_dir / "config.yaml").write_text("eval: {k: 4}\n")
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for it in token_probs:
        rollout = rng.random(5000)
        train = np.clip(rollout + rng.normal(0, 0.05, 5000), 0, 1)
        (run_dir / "token_probs").mkdir(exist_ok=True)
        np.savez(run_dir / "token_probs" / f"iter_{it:06d}.npz", train_prob=train.astype(np.float32),
                 rollout_prob=rollout.astype(np.float32))
    return run_dir


def _is_png(path):
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_all_figures_written(tmp_path, capsys):
    run = write_run(tmp_path / "alp")
    assert cli_main(["plot", str(run), "--iteration", "10"]) == 0
    out = capsys.readouterr().out
    expected = ["reward", "ratio_envelope", "mismatch_kl", "mismatch_k1", "entropy", "grad_norm", "response_length",
                "sigma_layers", "token_prob_scatter", "overview"]
    for name in expected:
        assert _is_png(run / "plots" / f"{name}.png"), name
        assert f"{name}:" in out
    assert "skipped 1 unreadable line" in out
    assert not list((run / "plots").glob(".*tmp*")), "temporary files left behind"


def test_missing_keys_are_skipped_with_a_note(tmp_path):
    run = write_run(tmp_path / "grpo", sigma=False, ratios=False, token_probs=())
    notes = []
    written = make_plots([run], iteration=None, log=notes.append)
    assert "reward" in written and "overview" in written
    assert "ratio_envelope" not in written and "sigma_layers" not in written
    assert "token_prob_scatter" not in written
    text = "\n".join(notes)
    assert "ratio_envelope.png" in text and "sigma_layers.png" in text and "token_prob_scatter.png" in text


def test_several_runs_are_overlaid(tmp_path):
    a = write_run(tmp_path / "alp")
    b = write_run(tmp_path / "bypass", sigma=False, tail=10.0, seed=1)
    written = make_plots([a, b], out_dir=tmp_path / "cmp", log=lambda _: None)
    assert {"token_prob_scatter_alp", "token_prob_scatter_bypass", "sigma_layers_alp", "ratio_envelope"} <= set(written)
    assert "sigma_layers_bypass" not in written
    assert all(p.parent == tmp_path / "cmp" for p in written.values())


def test_series_and_sites(tmp_path):
    run = Run(write_run(tmp_path / "r", iterations=5))
    assert run.bad_lines == 1 and run.k == 4
    x, y = run.series("reward/mean")
    assert list(x) == [0, 1, 2, 3, 4] and y[0] == pytest.approx(0.2)  # iterations, not optimizer steps
    assert run.sigma_sites() == [f"layer_{i:02d}" for i in range(LAYERS)]
    assert run.series("no/such/key") is None
    assert run.token_prob_file(None).name == "iter_000029.npz"
    assert run.token_prob_file(3) is None


def _axes():
    from matplotlib.figure import Figure

    return Figure().subplots()


def test_validation_is_drawn_in_the_reward_figure(tmp_path):
    """Validation ran after its iteration: it is drawn at the iterations trained, from the base
    model's at 0, so the curve shows the gain; the legend says average@k with the run's k."""
    ax = _axes()
    assert draw_curve(ax, [Run(write_run(tmp_path / "r"))], "reward")
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"train (rollouts)", "validation (average@4)"}
    val = lines["validation (average@4)"]
    assert list(val.get_xdata()) == [0, 10, 20, 30] and list(val.get_ydata()) == pytest.approx([0.05, 0.19, 0.29, 0.39])
    assert val.get_marker() == "o", "sparse validation points are marked"
    train = lines["train (rollouts)"]
    assert list(train.get_xdata()) == list(range(30)) and train.get_marker() in ("None", None)
    assert ax.get_xlabel().startswith("iteration")


def test_figures_read_as_a_reader_would(tmp_path):
    """KL k1 (noisy, possibly negative) has its own panel instead of flattening k3 and chi-square; a
    log axis only where the values span a decade (else one tick would be left); every sigma line is
    in the legend; the diagonal lies behind the token points."""
    run = Run(write_run(tmp_path / "r"))
    ax = _axes()
    draw_curve(ax, [run], "mismatch_kl")
    assert {line.get_label() for line in ax.get_lines()} == {"KL (k3)", "chi-square"}
    ax = _axes()
    draw_curve(ax, [run], "mismatch_k1")
    assert ax.get_yscale() == "linear" and [line.get_label() for line in ax.get_lines()] == ["_child0"]
    ax = _axes()
    draw_ratio_envelope(ax, [run])  # ratios between 0.3 and 3.3: less than a decade
    assert ax.get_yscale() == "linear"
    ax = _axes()
    draw_sigma(ax, run)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"layer {i}" for i in range(LAYERS)]
    ax = _axes()
    probability_scatter(ax, np.linspace(0, 1, 50), np.linspace(0, 1, 50))
    (diagonal,) = ax.get_lines()
    assert diagonal.get_zorder() < ax.collections[0].get_zorder()


def test_pearson_r():
    rng = np.random.default_rng(0)
    a = rng.random(1000)
    assert pearson_r(a, 2 * a + 1) == pytest.approx(1.0)
    assert abs(pearson_r(a, rng.random(1000))) < 0.1
    assert math.isnan(pearson_r(a, np.ones(1000)))


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        make_plots([tmp_path])
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="no metric records"):
        make_plots([tmp_path])
