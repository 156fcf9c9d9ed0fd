"""`megatron-alp mismatch`: the per-token statistics and their buckets on synthetic logprobs, bad
input, and real probes (tiny model, vLLM engines in float32, bfloat16 and FP8 against a float32
Megatron model, one process)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_alp.cli import EXIT_BAD_INPUT
from megatron_alp.cli import main as cli_main
from megatron_alp.commands.mismatch import format_table
from megatron_alp.diagnostics.mismatch_report import mismatch_report, position_edges

ROOT = Path(__file__).resolve().parents[1]
FP32_TOL = 1e-4  # float32 engine vs float32 Megatron: kernels and reduction orders differ, nothing else


def _check_buckets(report: dict) -> None:
    """Each bucketing partitions the tokens: counts add up, and the per-token means (k1, k3,
    chi-square) recombine, weighted by tokens, into those of all tokens."""
    a = report["all"]
    for key in ("by_probability", "by_position"):
        assert sum(b["tokens"] for b in report[key]) == a["tokens"], key
        for stat in ("kl_k1", "kl_k3", "chi2"):
            total = sum(b["tokens"] * b[stat] for b in report[key] if b["tokens"])
            assert total == pytest.approx(a["tokens"] * a[stat], rel=1e-6, abs=1e-12), (key, stat)


# ------------------------------------------------------------------------------- statistics


def test_report_on_synthetic_logprobs():
    rng = np.random.default_rng(0)
    probs = np.concatenate([rng.uniform(0.001, 1.0, 400), [1.0]])
    rollout = torch.tensor(np.log(probs), dtype=torch.float32)
    shift = torch.tensor(rng.normal(0, 0.05, len(probs)), dtype=torch.float32)
    train = rollout + shift
    positions = torch.tensor(rng.integers(0, 16, len(probs)))
    report = mismatch_report(train, rollout, positions, max_tokens=16)

    d = (train.double() - rollout.double()).numpy()
    a = report["all"]
    assert a["tokens"] == len(probs)
    assert a["kl_k1"] == pytest.approx(np.mean(-d), rel=1e-6)
    assert a["kl_k3"] == pytest.approx(np.mean(np.expm1(d) - d), rel=1e-6)
    assert a["chi2"] == pytest.approx(np.mean(np.expm1(d) ** 2), rel=1e-6)
    assert a["abs_log_ratio"]["max"] == pytest.approx(np.abs(d).max(), rel=1e-6)
    assert a["ratio"]["p50"] == pytest.approx(np.exp(np.median(d)), rel=1e-6)
    assert list(a["log_ratio"].values()) == sorted(a["log_ratio"].values())  # P2 <= P25 <= ... <= P98
    _check_buckets(report)
    by_prob = report["by_probability"]
    assert [b["bin"] for b in by_prob] == ["[0, 0.1)", "[0.1, 0.5)", "[0.5, 0.9)", "[0.9, 0.99)", "[0.99, 1]"]
    # buckets are closed on the left, and the last one on the right too (probability 1: logprob 0)
    p = rollout.double().exp().numpy()
    in_bucket = [((p >= b["low"]) & ((p < b["high"]) | (b["high"] == 1.0))).sum() for b in by_prob]
    assert [b["tokens"] for b in by_prob] == in_bucket
    assert [b["bin"] for b in report["by_position"]] == ["0-3", "4-7", "8-11", "12-15"]
    assert [b["tokens"] for b in report["by_position"]] == [int(((positions >= lo) & (positions < lo + 4)).sum())
                                                            for lo in (0, 4, 8, 12)]
    assert position_edges(2) == [0, 1, 2]  # fewer positions than buckets: one bucket per position

    same = mismatch_report(rollout, rollout, positions[: len(rollout)], max_tokens=16)["all"]
    assert same["kl_k3"] == 0.0 and same["abs_log_ratio"]["max"] == 0.0 and same["ratio"]["max"] == 1.0

    sparse = mismatch_report(train[:3], rollout[:3], torch.tensor([0, 1, 2]), max_tokens=16)
    assert [b["tokens"] for b in sparse["by_position"]] == [3, 0, 0, 0] and sparse["by_position"][1] == {
        "bin": "4-7", "low": 4, "high": 8, "tokens": 0}
    table = format_table(sparse).splitlines()
    assert table[0].split()[:3] == ["bucket", "tokens", "k1"] and table[1].split()[:2] == ["all", "3"]
    assert table[-3].split() == ["pos", "4-7", "0"] + ["-"] * 6


# ------------------------------------------------------------------------------- bad input


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    def fails(argv, *names):
        assert cli_main(argv) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert err.startswith("megatron-alp mismatch: error: ") and "Traceback" not in err, err
        for name in names:
            assert name in err, (name, err)

    fails(["mismatch", str(tmp_path / "none.yaml")], "none.yaml", "does not exist")
    fails(["mismatch", "configs/quickstart_cpu.yaml", "rollout.dtpye=float32"], "rollout.dtpye", "unknown key")
    fails(["mismatch", "configs/quickstart_cpu.yaml", f"trainer.output_dir={tmp_path / 'run'}"],
          "run/base_model has no config.json", "--model")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["mismatch", "configs/quickstart_cpu.yaml", "--prompts", "0"])
    assert exit_.value.code == 2 and "--prompts: expected an integer >= 1, got '0'" in capsys.readouterr().err


def test_help_documents_the_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["mismatch", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in ("KEY=VALUE", "--model", "--prompts", "--n", "--max-tokens", "--seed", "--out", "data.val_files",
                   "mismatch.json"):
        assert option in text, option


# -------------------------------------------------------------------------------- real runs


def _config(tmp_path: Path, model: Path, **model_keys) -> Path:
    path = tmp_path / "mismatch.yaml"
    keys = "".join(f", {k}: {v}" for k, v in model_keys.items())
    path.write_text(
        f"model: {{hf_path: {model}, dtype: float32, layer_spec: local{keys}}}\n"
        "rollout:\n"
        "  sampling: {n: 2, temperature: 1.0, max_prompt_length: 96, max_response_length: 64}\n"
        f"data: {{val_files: [{ROOT / 'data/largest/val.jsonl'}]}}\n"
        f"trainer: {{output_dir: {tmp_path / 'run'}, micro_batch_size: 16}}\n"
    )
    return path


def test_fp32_bf16_fp8_engines_against_fp32_megatron(tmp_path, capfd):
    """The same probe (8 prompts x 2 samples x 16 tokens) under three engine settings: float32
    agrees with Megatron to rounding, bfloat16 less, FP8 weights least. A sharper-than-default
    random model spreads the tokens over several probability buckets."""
    from megatron_alp.models.tiny import make_tiny_model

    model = make_tiny_model("qwen2", tmp_path / "model", seed=0, initializer_range=0.3)
    cfg = _config(tmp_path, model)
    settings = {
        "float32": (["rollout.dtype=float32"], "train-float32_vllm-float32"),
        "bfloat16": (["rollout.dtype=bfloat16"], "train-float32_vllm-bfloat16"),
        "fp8": (["rollout.dtype=bfloat16", "rollout.quantization=fp8_per_channel"],
                "train-float32_vllm-bfloat16-fp8_per_channel"),
    }
    reports = {}
    for name, (overrides, folder) in settings.items():
        assert cli_main(["mismatch", str(cfg), *overrides, "--prompts", "8", "--max-tokens", "16"]) == 0
        out = tmp_path / "run" / "mismatch" / folder
        assert (out / "mismatch.png").stat().st_size > 10_000 and (out / "engine.log").is_file()
        report = reports[name] = json.loads((out / "mismatch.json").read_text())
        assert report["prompts"] == 8 and report["samples"] == 16 and report["sampling"]["max_tokens"] == 16
        assert 16 <= report["all"]["tokens"] <= 8 * 2 * 16
        _check_buckets(report)
        printed = capfd.readouterr().out
        assert f"{report['all']['tokens']} tokens" in printed and "p [0.99, 1]" in printed and "pos 12-15" in printed

    fp32 = reports["float32"]["all"]
    assert fp32["kl_k3"] < 1e-8 and fp32["abs_log_ratio"]["max"] < FP32_TOL, fp32
    assert sum(b["tokens"] > 0 for b in reports["float32"]["by_probability"]) >= 3
    for key in ("kl_k3", "chi2"):
        order = [reports[n]["all"][key] for n in ("fp8", "bfloat16", "float32")]
        assert order[0] > order[1] > order[2], f"{key}: expected FP8 > bf16 > fp32, got {order}"
    assert reports["fp8"]["all"]["abs_log_ratio"]["p98"] > reports["bfloat16"]["all"]["abs_log_ratio"]["p98"]
    # the sigma init_std: auto would choose: its target is the report's own k3 KL (calibration_target 1), met
    # within the search's 2%; a larger mismatch asks for a larger noise scale
    for name in ("bfloat16", "fp8"):
        cal = reports[name]["calibration"]
        assert cal["calibration/target_kl"] == pytest.approx(reports[name]["all"]["kl_k3"], rel=1e-6)
        assert cal["calibration/perturbed_kl"] == pytest.approx(cal["calibration/target_kl"], rel=0.021)
        assert len(cal["sigma"]) == 4 and all(v > 0 for v in cal["sigma"].values())
    assert reports["fp8"]["calibration"]["calibration/scale"] > reports["bfloat16"]["calibration"]["calibration/scale"]
    assert all(math.isfinite(reports[n]["all"]["pearson_r"]) for n in reports)


def test_model_load_weights_reach_the_engine(tmp_path):
    """With model.load the Megatron checkpoint is scored and synced into the engine, which started
    on model.hf_path: float32 on both sides agrees to rounding only if the sync took place. Run as
    the user runs it, to see that the terminal gets only the command's own lines."""
    from megatron_alp.config import ModelConfig, ParallelConfig
    from megatron_alp.models.families import hf_to_megatron, load_hf_config
    from megatron_alp.models.hf_weights import load_hf_weights
    from megatron_alp.models.tiny import make_tiny_model
    from megatron_alp.runtime.parallel import destroy_distributed, init_distributed
    from megatron_alp.training.builder import build_gpt_model
    from megatron_alp.training.dist_checkpoint import save_checkpoint

    base = make_tiny_model("qwen2", tmp_path / "base", seed=0)
    trained = make_tiny_model("qwen2", tmp_path / "trained", seed=1)
    init_distributed(ParallelConfig())
    try:
        model_cfg = ModelConfig(hf_path=str(trained), dtype="float32", layer_spec="local")
        model = build_gpt_model(hf_to_megatron(load_hf_config(trained)), model_cfg, ParallelConfig())
        load_hf_weights(model, trained)
        save_checkpoint(tmp_path / "ckpt", model, hf_dir=trained)
    finally:
        destroy_distributed()
    cfg = _config(tmp_path, base, load=tmp_path / "ckpt")
    out = tmp_path / "out"
    # without the rendezvous variables this process's own init_distributed left behind
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    env = {**{k: v for k, v in os.environ.items() if k not in rendezvous}, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "megatron_alp.cli", "mismatch", str(cfg), "rollout.dtype=float32",
                           "--prompts", "4", "--max-tokens", "8", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "mismatch.json").read_text())
    assert report["checkpoint"] == str(tmp_path / "ckpt")
    assert report["all"]["abs_log_ratio"]["max"] < FP32_TOL, report["all"]
    lines = proc.stdout.splitlines()
    ours = ("megatron-alp mismatch: ", "vllm float32 vs Megatron float32: ", "bucket ", "all ", "p [", "pos ",
            "perturbation.init_std: auto would set sigma = ", "written: ")
    assert len(lines) == 15 and all(line.startswith(ours) for line in lines), proc.stdout
    assert not proc.stderr, proc.stderr
    assert "vllm" in (out / "engine.log").read_text().lower()  # the engine's chatter went to the log
