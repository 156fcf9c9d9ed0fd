"""benchmarks/compare_methods.py's pure parts: the 95% interval over seeds, the collapse rule, arm
parsing and refusals (no training is run)."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import compare_methods as cm  # noqa: E402  (benchmarks/ is not a package)


def test_ci95_of_three_seeds_by_hand():
    vals = [0.40, 0.50, 0.75]
    mean = (0.40 + 0.50 + 0.75) / 3  # 0.55
    sd = math.sqrt(((0.40 - mean) ** 2 + (0.50 - mean) ** 2 + (0.75 - mean) ** 2) / 2)  # n-1 = 2 dof
    half = 4.303 * sd / math.sqrt(3)  # t(0.975, 2) = 4.303 from the printed tables
    got_mean, got_half = cm.mean_ci95(vals)
    assert got_mean == pytest.approx(mean)
    assert got_half == pytest.approx(half, rel=1e-4)


def test_ci95_degenerate_and_order_free():
    assert math.isnan(cm.mean_ci95([0.3])[1])  # one seed: no interval
    assert cm.mean_ci95([0.3])[0] == pytest.approx(0.3)
    assert math.isnan(cm.mean_ci95([])[0])
    assert cm.mean_ci95([0.2, 0.2, 0.2])[1] == 0.0
    a, b = cm.mean_ci95([0.1, 0.9, 0.4, 0.6]), cm.mean_ci95([0.6, 0.4, 0.9, 0.1])
    assert a == pytest.approx(b)


def test_t_quantile_known_values_and_large_dof():
    # textbook two-sided 95% values, and the normal limit
    for dof, t in [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042), (60, 2.000), (120, 1.980)]:
        assert cm.t_quantile(dof) == pytest.approx(t, abs=2e-3), dof
    assert cm.t_quantile(10_000) == pytest.approx(1.95996, abs=1e-3)
    qs = [cm.t_quantile(d) for d in range(1, 200)]
    assert all(x > y for x, y in zip(qs, qs[1:]))  # decreasing towards the normal quantile
    with pytest.raises(ValueError):
        cm.t_quantile(0)


def test_t_quantile_matches_scipy_if_installed():
    stats = pytest.importorskip("scipy.stats")
    for dof in list(range(1, 40)) + [50, 100, 1000]:
        assert cm.t_quantile(dof) == pytest.approx(stats.t.ppf(0.975, dof), abs=1e-3)


def _rows(vals: dict[int, float], loss=0.1, kl=1e-5):
    """metrics.jsonl records: validation at the given iterations (-1 = base model), 4 training
    iterations with the given loss and KL."""
    rows = [{"iteration": -1, "val/reward_mean": vals[-1]}] if -1 in vals else []
    for i in range(4):
        row = {"iteration": i, "loss/total": loss, "mismatch/kl_k3": kl, "ratio/p2": 0.8, "ratio/p98": 1.2,
               "timing/total_s": 2.0 + i}
        if i in vals:
            row["val/reward_mean"] = vals[i]
        rows.append(row)
    return rows


def test_collapse_rule():
    assert cm.collapse_reason(_rows({-1: 0.05, 1: 0.4, 3: 0.5})) is None  # learns
    assert cm.collapse_reason(_rows({-1: 0.05, 3: 0.04})) is None  # no progress, no loss of half
    assert cm.collapse_reason(_rows({-1: 0.05, 1: 0.6, 3: 0.2})) is not None  # lost its skill: 0.2 < 0.3
    assert cm.collapse_reason(_rows({-1: 0.05, 1: 0.6, 3: 0.31})) is None  # just above half of the best
    assert cm.collapse_reason(_rows({-1: 0.4, 3: 0.1})) is not None  # below half of the base model
    assert cm.collapse_reason(_rows({-1: 0.0, 3: 0.0})) is None
    assert "loss/total" in cm.collapse_reason(_rows({-1: 0.05, 3: 0.5}, loss=math.nan))
    assert "mismatch/kl_k3" in cm.collapse_reason(_rows({-1: 0.05, 3: 0.5}, kl=math.inf))
    # the base model's validation row (iteration -1) has no loss: not a non-finite one
    assert cm.collapse_reason([{"iteration": -1, "val/reward_mean": 0.1, "loss/total": math.nan}]) is None


def test_run_result_and_aggregate():
    a = cm.run_result(_rows({-1: 0.05, 1: 0.6, 3: 0.2}))
    b = cm.run_result(_rows({-1: 0.05, 3: 0.5}))
    assert a["val_final"] == 0.2 and b["val_final"] == 0.5 and a["val_base"] == 0.05
    assert a["collapsed"] and not b["collapsed"]
    assert a["envelope"] == pytest.approx(1.2 / 0.8)
    assert a["s_per_iteration"] == pytest.approx(statistics.mean([2.0, 3.0, 4.0, 5.0]))
    cell = cm.aggregate([a, b])
    assert cell["seeds"] == 2 and cell["collapsed"] == 1
    assert cell["val_mean"] == pytest.approx(0.35)
    assert cell["val_ci95"] == pytest.approx(12.706 * statistics.stdev([0.2, 0.5]) / math.sqrt(2), rel=1e-3)


def test_parse_arm():
    assert cm.parse_arm("grpo").loss == "grpo" and cm.parse_arm("grpo").overrides == ()
    auto = cm.parse_arm("alp_seq:auto")
    assert auto.loss == "alp_seq" and "perturbation.init_std=auto" in auto.overrides
    assert auto.dirname == "alp_seq-auto"
    per_layer = cm.parse_arm("alp_token:per_layer")
    assert set(per_layer.overrides) == {"perturbation.init_std=auto", "perturbation.calibration_mode=per_layer"}
    added = cm.parse_arm("alp_seq:per_layer_added")
    assert set(added.overrides) == {"perturbation.init_std=auto", "perturbation.calibration_mode=per_layer_added"}
    for name in cm.DEFAULT_ARMS:  # the default matrix parses
        assert cm.parse_arm(name).label == name


@pytest.mark.parametrize("arm, words", [
    ("nosuchloss", ["nosuchloss", "unknown loss"]),
    ("grpo:auto", ["grpo:auto", "does not perturb"]),
    ("seq_bypass:per_layer", ["seq_bypass:per_layer", "does not perturb"]),
    ("alp_token:sometimes", ["alp_token:sometimes", "suffix"]),
    ("alp_token:", ["alp_token:", "suffix"]),
])
def test_arm_refusals(arm, words, capsys):
    with pytest.raises(ValueError) as err:
        cm.parse_arm(arm)
    assert all(w in str(err.value) for w in words)
    with pytest.raises(SystemExit) as stop:  # argparse: status 2, the arm named on stderr
        cm.parse_args(["--arms", "grpo", arm])
    assert stop.value.code == 2
    assert arm in capsys.readouterr().err


def test_cli_refusals(capsys):
    for argv, word in [(["--arms", "grpo", "grpo"], "twice"), (["--seeds", "1", "1"], "twice"),
                       (["--precisions", "int4"], "invalid choice"), (["loss.name=grpo"], "--arms"),
                       (["rollout.dtype=float16"], "--precisions"), (["trainer.seed=3"], "--seeds")]:
        with pytest.raises(SystemExit):
            cm.parse_args(argv)
        assert word in capsys.readouterr().err, argv
    args = cm.parse_args(["trainer.sft_warmup_steps=10"])  # other overrides pass, defaults are the full matrix
    assert [a.label for a in args.arms] == cm.DEFAULT_ARMS and args.precisions == ["fp32", "bf16", "fp8"]
    assert args.seeds == [1, 2, 3]


def test_finished_needs_final_validation():
    rows = _rows({-1: 0.05, 3: 0.5})
    assert cm.finished(rows, 4)
    assert not cm.finished(rows, 5)  # a longer matrix
    assert not cm.finished(rows[:-1], 4)  # killed before the last iteration


def test_parse_stress():
    assert cm.parse_stress("sync").overrides == ("trainer.max_staleness=0",)
    stale = cm.parse_stress("stale:8")
    assert set(stale.overrides) == {"rollout.placement=separate", "trainer.max_staleness=8"}
    assert stale.dirname == "stale-8"
    assert cm.parse_stress("updates:16").overrides == ("trainer.updates_per_iteration=16",)
    for text, word in [("sync:2", "no value"), ("stale", "K >= 1"), ("stale:0", "K >= 1"), ("stale:x", "K >= 1"),
                       ("updates:-1", "N >= 1"), ("hot", "unknown stressor")]:
        with pytest.raises(ValueError, match=word):
            cm.parse_stress(text)
    # every key a stressor sets is one a matrix-wide override may not set
    for name, (_, letter, make) in cm.STRESSORS.items():
        for item in cm.parse_stress(name if letter is None else f"{name}:3").overrides:
            assert item.partition("=")[0] in cm.CELL_KEYS, item


def test_stress_cli(capsys):
    args = cm.parse_args(["--stress", "sync", "stale:2", "--control", "sync/fp32/grpo"])
    assert [s.label for s in args.stress] == ["sync", "stale:2"]
    assert [s.label for s in cm.parse_args([]).stress] == ["sync"]
    for argv, word in [(["--stress", "stale:2", "stale:2"], "twice"), (["trainer.max_staleness=2"], "--stress"),
                       (["rollout.placement=separate"], "--stress"), (["--control", "grpo"], "STRESS/PRECISION/ARM")]:
        with pytest.raises(SystemExit):
            cm.parse_args(argv)
        assert word in capsys.readouterr().err, argv


def test_paired_differences_by_seed():
    arm = {1: {"val_final": 0.30}, 2: {"val_final": 0.20}, 3: {"val_final": 0.50}}
    ref = {1: {"val_final": 0.25}, 2: {"val_final": 0.10}, 4: {"val_final": 0.90}}
    d = [0.30 - 0.25, 0.20 - 0.10]  # seeds 1 and 2 only: 3 and 4 are unpaired
    mean, half, n = cm.paired_ci95(arm, ref)
    assert n == 2 and mean == pytest.approx(sum(d) / 2)
    assert half == pytest.approx(12.706 * statistics.stdev(d) / math.sqrt(2), rel=1e-3)
    assert cm.paired_ci95(arm, {})[2] == 0


def test_sweep_table_pairs_with_control_and_grpo():
    def cell(vals):
        runs = {s: cm.run_result(_rows({-1: 0.05, 3: v})) for s, v in vals.items()}
        return {**cm.aggregate(list(runs.values())), "runs": runs, "failed": 0}

    cells = {"sync/fp32": {"grpo": cell({1: 0.5, 2: 0.4}), "alp_token": cell({1: 0.5, 2: 0.5})},
             "stale:8/fp32": {"grpo": cell({1: 0.3, 2: 0.3}), "alp_token": cell({1: 0.4, 2: 0.35})}}
    md = cm.markdown_table(cells, ["grpo", "alp_token"], list(cells), 4, "sync/fp32/grpo")
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): line for line in md.splitlines()
            if line.startswith("| ") and "`" in line}
    stale_alp = rows[("stale:8", "fp32", "`alp_token`")].split("|")
    # minus control: (0.4 - 0.5, 0.35 - 0.4) -> mean -0.075; minus grpo: (0.4 - 0.3, 0.35 - 0.3) -> +0.075
    assert stale_alp[5].strip().startswith("-0.075") and stale_alp[5].strip().endswith("(2)")
    assert stale_alp[6].strip().startswith("+0.075")
    control_row = rows[("sync", "fp32", "`grpo`")].split("|")
    assert control_row[5].strip() == "-" and control_row[6].strip() == "-"  # itself
    its, kl = cm.mean_series(list(cells["stale:8/fp32"]["grpo"]["runs"].values()), 2)
    assert its == [0, 1, 2, 3] and kl == pytest.approx([1e-5] * 4)
