"""benchmarks/bench_kill_soak.py: an asynchronous 2-replica run SIGKILLed 3 times (the third in the
weight sync) resumes each time and leaves no process or shared-memory segment behind; then each run
kind added since, killed twice (the second at its own phase: the sync, the layer probe, a dynamic
sampling round, TIR episodes with code executing), leaves no process, segment or sandbox directory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_kill_soak_resumes_every_time_and_leaves_nothing_behind(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kill_soak.py"), "--quick",
                           "--out", str(tmp_path / "soak")], capture_output=True, text=True, timeout=3600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "soak" / "report.json").read_text())
    assert report["kills"] == 3 and report["resumes_trained_on"] == 3 and len(report["rows"]) == 3, report
    assert report["orphans"] == 0 and report["finished"], report
    assert report["shm_segments"] > 0 and report["leftover_shm"] == [], report  # what the job's processes mapped
    assert "resumes that trained on: 3/3" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["async_deterministic", "lora_merged", "lora_adapter", "per_layer_calibration",
                                  "dynamic_sampling", "tir_async"])
def test_each_newer_run_kind_survives_kills(tmp_path, kind):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kill_soak.py"), "--kind", kind,
                           "--kills", "2", "--out", str(tmp_path / "soak")],
                          capture_output=True, text=True, timeout=3600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "soak" / "report.json").read_text())
    assert report["kind"] == kind and report["kills"] == 2 and report["resumes_trained_on"] == 2, report
    assert report["orphans"] == 0 and report["finished"], report
    assert report["leftover_shm"] == [] and report["leftover_sandbox"] == [], report
