"""Hangs end: a rank that stops answering ends both ranks within the deadline (torchrun, gloo)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_alp.runtime.parallel import free_port
from megatron_alp.runtime.preemption import EXIT_FILE_ENV, EXIT_HANG

ROOT = Path(__file__).resolve().parents[1]


def test_a_rank_that_stops_answering_ends_every_rank_with_the_hang_code(tmp_path):
    deadline = 4.0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MEGATRON_ALP_HANG_AT": "logprob:1:1",
           EXIT_FILE_ENV: str(tmp_path / "exit")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
           str(ROOT / "tests" / "dist" / "check_hang.py"), str(tmp_path / "run"), str(deadline)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "not reached" not in out, out[-4000:]
    assert (tmp_path / "exit").read_text().strip() == str(EXIT_HANG)
    reports = {r: json.loads((tmp_path / "run" / "hang" / f"rank_{r}.json").read_text()) for r in (0, 1)}
    # rank 0 waited in the update of iteration 1 for rank 1, which stopped entering the logprob phase
    assert (reports[0]["phase"], reports[0]["iteration"], reports[0]["ranks_behind"]) == ("policy_update", 1, [1])
    assert (reports[1]["phase"], reports[1]["iteration"], reports[1]["ranks_behind"]) == ("logprob", 1, [])
    for r in (0, 1):
        assert deadline < reports[r]["seconds"] < deadline + 2, reports[r]
        assert "hang_for_test" in (tmp_path / "run" / "hang" / f"rank_{r}.stacks.txt").read_text() or r == 0
    assert "rank 0: phase policy_update of iteration 1 ran" in out and "ranks [1] did not arrive (rank 1 in logprob" in out
    assert time.monotonic() - t0 < 120
