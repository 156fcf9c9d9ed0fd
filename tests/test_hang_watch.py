"""Hangs end: a rank that stops answering ends both ranks within the deadline (torchrun, gloo)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_alp.runtime.parallel import free_port
from megatron_alp.runtime.preemption import EXIT_FILE_ENV, EXIT_HANG
from megatron_alp.trainer.hang_watch import read_counter
from megatron_alp.training.dist_checkpoint import save_progress

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


SAVE = """
import sys, time
from pathlib import Path
from megatron_alp.trainer.hang_watch import HangWatch, watching

run, deadline, moving = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "moving"
watch = HangWatch(deadline, run, 0, ["checkpoint_save"])
watch.beat("checkpoint_save", 9)
tmp = run / "checkpoints" / "iter_0000009.tmp-ab12"  # the save's temporary folder
tmp.mkdir(parents=True)
with watching(watch, saving=run / "checkpoints" / "iter_0000009"):
    for i in range(40):  # a save four deadlines long
        time.sleep(deadline / 10)
        if moving:
            (tmp / f"part_{i}").write_bytes(b"x" * 100)
watch.stop()
print("saved", flush=True)
"""


def _save(tmp_path: Path, moving: bool) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), EXIT_FILE_ENV: str(tmp_path / "exit")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SAVE, str(tmp_path / "run"), "1.0", "moving" if moving else "stalled"],
                          env=env, capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - t0


def test_a_save_that_keeps_moving_data_outlasts_the_deadline_and_one_that_stalls_does_not(tmp_path):
    """Inside a save the deadline counts the time without progress, not the phase's: one that keeps writing
    runs four deadlines long, one that writes (and reads) nothing stops at the deadline."""
    proc, _ = _save(tmp_path / "moving", moving=True)
    assert proc.returncode == 0 and "saved" in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "moving" / "run" / "hang").exists()
    proc, _ = _save(tmp_path / "stalled", moving=False)
    assert proc.returncode == EXIT_HANG and "saved" not in proc.stdout, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "stalled" / "run" / "hang" / "rank_0.json").read_text())
    assert (report["phase"], report["iteration"]) == ("checkpoint_save", 9)
    assert 1.0 < report["seconds"] < 2.0, report


def test_what_a_save_and_a_load_count_as_progress(tmp_path):
    """A save: the bytes in its temporary folders (every rank's files); a load: the bytes this process reads,
    not counting the counter's own reads of /proc/self/io (or every poll would look like progress)."""
    ckpt = tmp_path / "checkpoints" / "iter_0000010"
    (tmp_path / "checkpoints").mkdir()
    assert save_progress(ckpt) == 0
    tmp = tmp_path / "checkpoints" / "iter_0000010.tmp-ab12"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(b"x" * 1000)
    (tmp / "sub" / "common.pt").write_bytes(b"y" * 24)
    (tmp_path / "checkpoints" / "iter_0000011.tmp-cd34").mkdir()
    (tmp_path / "checkpoints" / "iter_0000011.tmp-cd34" / "other").write_bytes(b"z" * 500)  # another save's
    assert save_progress(ckpt) == 1024
    if not Path("/proc/self/io").exists():
        return
    reads = read_counter()
    first = reads()
    assert [reads() for _ in range(5)] == [first] * 5
    (tmp / "__0_0.distcp").read_bytes()
    assert reads() >= first + 1000
