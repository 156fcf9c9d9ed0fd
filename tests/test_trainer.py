"""The RL trainer end to end on the CPU (real vLLM, Megatron, math-verify)."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (LOSS_KEYS, PP2, QUICKSTART, QUICKSTART_LORA, QUICKSTART_TIR, ROLLOUT_KEYS, SEPARATE, SMALL, SYNC_RUN,
                     TP2_SP, UNPERTURBED_KEYS, copy_run, metrics, train)

from megatron_alp.cli import main
from megatron_alp.config import InputError
from megatron_alp.runtime.parallel import free_port
from megatron_alp.training.dist_checkpoint import read_metadata

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_ci_sized_run_trains_logs_and_saves(sync_run):
    """The main job end to end at CI size (the shared run, tests/conftest.py). Learning itself is
    checked deterministically in test_policy_update.py (a short reward curve of a tiny model is noise
    across machines); the reward rise over several seeds is a slow test."""
    run = sync_run
    m = metrics(run)
    assert [r["iteration"] for r in m] == list(range(3))
    reward = [r["reward/mean"] for r in m]
    assert all(0 <= r <= 1 for r in reward), reward
    kl = [r["kl_ref/mean"] for r in m]
    assert all(k > 1e-3 for k in kl), kl  # the updates moved the policy (ALP noise alone: ~1e-8)
    for key in ("ratio/p2", "ratio/p98", "mismatch/kl_k3", "sigma/mean", "grad_norm", "throughput/tokens_per_s"):
        assert key in m[-1], key
    assert (run / "plots").is_dir() and any((run / "plots").glob("*.png"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_0000002", "iter_0000003"]
    # every sync was verified: the engine's probe logprobs match the trainer's
    assert all(r["sync/verify_mean_abs_diff"] < 2e-2 for r in m), [r["sync/verify_mean_abs_diff"] for r in m]


def test_the_terminal_shows_only_our_lines(sync_run):
    """Engine and library chatter (vLLM INFO/WARNING, dtype warnings, Python warnings, C++ logs) goes
    to RUN_DIR/logs/engine.log; the terminal keeps the project's own lines (the bar is off here)."""
    terminal = (sync_run / "terminal.txt").read_text().splitlines()
    ours = ("megatron-alp: ", "warm start: ", "rollout engine: ", "iteration ", "run finished in ", "wrote ")
    assert terminal and all(line.startswith(ours) for line in terminal), terminal
    assert sum(line.startswith("iteration ") for line in terminal) == 3
    assert terminal[-2].startswith("run finished in ") and " iterations; reward " in terminal[-2]
    assert terminal[-1].startswith("wrote checkpoints ") and "metrics.jsonl" in terminal[-1]
    log = (sync_run / "logs" / "engine.log").read_text()
    assert "Attempted to load weight" in log and "vllm" in log.lower() and "UserWarning" in log


@pytest.mark.slow  # a kill/crash soak (minutes on 2 cores): pytest -m slow
def test_tir_sync_runs_the_models_code(tmp_path):
    """A few iterations of the multi-turn quickstart (real vLLM, the sandbox, Seq-ALP), trained
    asynchronously (max_staleness=1): the replica leader runs its share's whole episodes (engine
    turns and its own sandbox) in the background. The warm-started model writes code, the sandbox runs
    it, and some episodes end with the right answer; each batch after the first is one version old."""
    run = tmp_path / "tir"
    # a shorter warm start: the episode format is learnt, copying the problem into the code not yet
    rc, out = train(run, "trainer.iterations=3", "trainer.prompts_per_iteration=8", "trainer.save_interval=3",
                    "trainer.sft_warmup_steps=100", "rollout.placement=separate", "trainer.max_staleness=1",
                    config=QUICKSTART_TIR)
    assert rc == 0, out[-6000:]
    m = metrics(run)
    assert [r["iteration"] for r in m] == [0, 1, 2]
    assert [r["staleness/max"] for r in m] == [0, 1, 1]
    for r in m:
        assert r["tir/executions_mean"] > 0.25 and r["tir/status_frac/ok"] > 0.5, r  # its code ran and printed
        assert 1 <= r["tir/turns_mean"] <= 3 and 0 <= r["tir/void_turn_frac"] < 0.5, r  # max_turns: 2
        assert "loss/policy" in r and "ratio/p98" in r, r  # Seq-ALP updates ran (finite values only are logged)
    assert max(r["reward/mean"] for r in m) > 0, [r["reward/mean"] for r in m]


def _same_metrics(a: dict, b: dict) -> None:
    for key in ("reward/mean", "loss/policy", "ratio/p50", "mismatch/kl_k3", "grad_norm", "sigma/mean", "step"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a[key], b[key])


@pytest.mark.slow  # a kill/crash soak (minutes on 2 cores): pytest -m slow
def test_sigkill_during_save_resumes_to_the_same_metrics(sync_run, tmp_path):
    """Killed while writing the last checkpoint (iteration 3): the partial checkpoint never
    appears, and the run resumes from iteration 2 to the metrics of the run never killed."""
    common = SYNC_RUN
    straight = metrics(sync_run)
    run = tmp_path / "killed_in_save"
    copy_run(sync_run, run, base_model_only=True)  # the same warm start, not run again
    rc, out = train(run, *common, env={"MEGATRON_ALP_KILL_DURING_SAVE": "3"})
    assert rc != 0
    assert not (run / "checkpoints" / "iter_0000003").exists()
    rc, out = train(run, *common)
    assert rc == 0 and "resumed from" in out, out[-6000:]
    resumed = metrics(run)
    assert [r["iteration"] for r in resumed] == [0, 1, 2]
    for a, b in zip(straight, resumed):
        _same_metrics(a, b)


def test_a_delta_synced_run_trains_as_the_full_sync_run(sync_run, tmp_path):
    """rollout.sync_delta: the shared run again, each sync after the first sending only the elements
    that changed: the engine generates from the same weights (its verification probe agrees after
    every sync), so the run trains to the same metrics, iteration by iteration. At the quickstart's
    learning rate (1e-4) about two thirds of the bf16 elements change per iteration, so shards go whole
    and the payload stays about the dense size (never more: benchmarks/bench_sync.py shows the savings
    at RL learning rates)."""
    run = copy_run(sync_run, tmp_path / "delta", base_model_only=True)
    rc, out = train(run, *SYNC_RUN, "trainer.save_interval=3", "rollout.sync_delta=true")
    assert rc == 0, out[-6000:]
    delta = metrics(run)
    assert [r["iteration"] for r in delta] == [0, 1, 2]
    for a, b in zip(metrics(sync_run), delta):
        _same_metrics(a, b)
        assert a["reward/mean"] == b["reward/mean"] and a["response_length/mean"] == b["response_length/mean"]
    assert [r["sync/anchor"] for r in delta] == [1.0, 0.0, 0.0]
    for r in delta[1:]:
        assert 0 < r["sync/changed_frac"] < 1 and r["sync/delta_bytes"] < 1.01 * r["sync/bytes"], r
        assert r["sync/verify_mean_abs_diff"] < 2e-2, r


def test_a_damaged_newest_checkpoint_resumes_from_the_one_before(sync_run, tmp_path):
    """The newest checkpoint's largest shard cut short after the save (a failing file system, a bad
    copy): the resume says so in one line, takes the checkpoint before it, and trains to the metrics
    of the run never damaged; the damaged checkpoint is replaced by an intact one."""
    run = copy_run(sync_run, tmp_path / "damaged")
    newest = run / "checkpoints" / "iter_0000003"
    shard = max((p for p in newest.rglob("*.distcp")), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    rc, out = train(run, *SYNC_RUN)
    assert rc == 0, out[-6000:]
    line = f"checkpoint {newest} is damaged ({shard.relative_to(newest)} has {size // 2} bytes, {size} were written): " \
           "resuming from iter_0000002"
    assert line in out and f"resumed from {run / 'checkpoints' / 'iter_0000002'}" in out, out[-6000:]
    resumed = metrics(run)
    assert [r["iteration"] for r in resumed] == [0, 1, 2]
    for a, b in zip(metrics(sync_run), resumed):
        _same_metrics(a, b)
    manifest = json.loads((newest / "checksums.json").read_text())["blake2b-128"]
    assert all((newest / name).stat().st_size == entry[0] for name, entry in manifest.items())


@pytest.mark.slow  # a kill/crash soak (minutes on 2 cores): pytest -m slow
def test_a_preemption_notice_saves_and_the_requeued_run_resumes(sync_run, tmp_path):
    """SIGUSR1 to launch/torchrun_multinode.sh (as SLURM's --signal sends it): the ranks finish the
    iteration they are in, save, and the script exits 75 (requeue); the same command resumes from that
    checkpoint to the metrics of the run never stopped."""
    run = tmp_path / "preempted"
    copy_run(sync_run, run, base_model_only=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, "NNODES": "1",
           "GPUS_PER_NODE": "1", "NPROC_PER_NODE": "1", "MASTER_PORT": str(free_port())}
    cmd = ["bash", str(ROOT / "launch" / "torchrun_multinode.sh"), str(QUICKSTART), f"trainer.output_dir={run}",
           *SMALL, *SYNC_RUN]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("iteration 0 of 3"):
            proc.send_signal(signal.SIGUSR1)  # to the script only: it passes the notice to the ranks
            break
    out = "".join(lines) + proc.communicate(timeout=600)[0]
    assert proc.returncode == 75, out[-4000:]
    stopped = re.search(r"preempted \(SIGUSR1: stopped after iteration (\d) with checkpoint (\S+); ", out)
    assert stopped, out[-4000:]
    saved = Path(stopped.group(2))
    assert saved == run / "checkpoints" / f"iter_{int(stopped.group(1)) + 1:07d}" and saved.is_dir()
    rc, out = train(run, *SYNC_RUN)
    assert rc == 0 and f"resumed from {saved}" in out, out[-6000:]
    resumed = metrics(run)
    assert [r["iteration"] for r in resumed] == [0, 1, 2]
    for a, b in zip(metrics(sync_run), resumed):
        _same_metrics(a, b)


@pytest.mark.slow  # the default tier resumes DP=2 on one rank in the asynchronous two-rank test
@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_a_run_saved_on_two_ranks_resumes_on_one(sync_run, tmp_path, layout, request):
    """Saved after iteration 0 at DP=2 (TP=2, PP=2) and resumed on one rank: one line says what
    carries over and what cannot, and the run goes on as the one-rank run would have (the same
    prompts, rollouts, step and LR; losses within the ALP noise of another layout; that every
    tensor carries over exactly is tests/test_dist_checkpoint.py). DP=2 resumes a copy of the shared
    two-rank run cut back to its first checkpoint."""
    if layout == "dp2":
        run = copy_run(request.getfixturevalue("dp2_run"), tmp_path / layout)
        shutil.rmtree(run / "checkpoints" / "iter_0000002")
    else:
        run = copy_run(sync_run, tmp_path / layout, base_model_only=True)
        rc, out = train(run, *SYNC_RUN, "trainer.iterations=1", *{"tp2": TP2_SP, "pp2": PP2}[layout], nproc=2)
        assert rc == 0, out[-6000:]
    rc, out = train(run, *SYNC_RUN, "trainer.iterations=2")  # the first iteration after the resume
    assert rc == 0, out[-6000:]
    change = {"dp2": "DP 2 -> 1", "tp2": "TP 2 -> 1", "pp2": "PP 2 -> 1"}[layout]
    assert f"resuming iter_0000001 at another layout ({change}): weights, optimizer state, ALP sigmas" in out, out
    assert f"resumed from {run / 'checkpoints' / 'iter_0000001'} at iteration 1, step 2" in out, out
    resumed, straight = metrics(run), metrics(sync_run)
    assert [r["iteration"] for r in resumed] == [0, 1]
    for a, b in zip(resumed[1:], straight[1:]):
        for key in ("data/epoch", "step", "lr", "lr/sigma"):  # the sampler position, the LR schedule
            assert a[key] == b[key], (layout, a["iteration"], key, a[key], b[key])
        # weights one update apart by the noise of another layout: a token here and there samples otherwise
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1 / 16), (layout, a, b)
        assert a["response_length/mean"] == pytest.approx(b["response_length/mean"], rel=0.05), (layout, a, b)
        for key in LOSS_KEYS:
            assert a[key] == pytest.approx(b[key], rel=0.1, abs=1e-5), (layout, a["iteration"], key, a[key], b[key])


@pytest.mark.slow
def test_sigkill_mid_training_resumes_to_the_same_metrics(sync_run, tmp_path):
    """Killed in the middle of training: resumes to the metrics of the run never killed."""
    common = SYNC_RUN
    straight = metrics(sync_run)
    run = tmp_path / "killed_in_training"
    copy_run(sync_run, run, base_model_only=True)
    kill_after_two_iterations(run, *common)
    rc, out = train(run, *common)
    assert rc == 0 and "resumed from" in out, out[-6000:]
    resumed = metrics(run)
    assert [r["iteration"] for r in resumed] == [0, 1, 2]
    for a, b in zip(straight, resumed):
        _same_metrics(a, b)


def test_the_run_lock_and_forked_children_die_with_the_trainer(tmp_path):
    """A trainer killed while a child it forked (a checkpoint writer) still runs: the child dies with
    it, and even a child that survived would not hold the run directory's lock."""
    import psutil

    from megatron_alp.trainer.run_dir import lock_run_dir

    code = ("import os, sys, time; from pathlib import Path; "
            "from megatron_alp.runtime.process import forks_die_with_their_parent; from megatron_alp.trainer.run_dir import lock_run_dir; "
            "forks_die_with_their_parent(); lock = lock_run_dir(Path(sys.argv[1])); "
            "pid = os.fork()\n"
            "if pid == 0: time.sleep(600)\n"
            "print(pid, flush=True); time.sleep(600)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    trainer = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    child = psutil.Process(int(trainer.stdout.readline()))
    with pytest.raises(InputError, match=f"in use by another training process \\(pid {trainer.pid}\\)"):
        lock_run_dir(tmp_path)
    trainer.kill()
    trainer.wait()
    child.wait(timeout=10)  # killed with its parent
    lock_run_dir(tmp_path).close()

    # a forked child that outlives the lock holder does not keep the lock
    code = ("import os, sys, time; from pathlib import Path; from megatron_alp.trainer.run_dir import lock_run_dir; "
            "lock = lock_run_dir(Path(sys.argv[1])); pid = os.fork()\n"
            "if pid == 0: time.sleep(600)\n"
            "print(pid, flush=True)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    orphan = psutil.Process(int(holder.stdout.readline()))
    holder.wait(timeout=60)  # the lock holder exits; its child lives on
    try:
        assert orphan.is_running()
        lock_run_dir(tmp_path).close()
    finally:
        orphan.kill()


def kill_after_two_iterations(run: Path, *overrides: str) -> None:
    """Start a run and SIGKILL every process of it once it has logged two iterations."""
    proc = train(run, *overrides, wait=False)
    deadline = time.time() + 600
    while len(metrics(run)) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed"
    kill_tree(proc)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it. torchrun starts each worker in a session
    of its own, so killing the launcher's process group would leave the trainer running."""
    import psutil

    procs = [psutil.Process(proc.pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(procs[1:], timeout=30)


DAPO = ("trainer.iterations=2", "trainer.prompts_per_iteration=8", "trainer.save_interval=2", "trainer.eval_interval=0")


@pytest.fixture(scope="module")
def dynamic_sampling_run(tmp_path_factory) -> Path:
    """The warm-started quickstart model scores ~0.1, so most groups of 8 are all 0: dynamic
    sampling needs extra rounds to fill each batch."""
    run = tmp_path_factory.mktemp("dapo") / "dynamic"
    rc, out = train(run, *DAPO, "trainer.dynamic_sampling=true", "trainer.dynamic_sampling_max_rounds=8",
                    "loss.mask_truncated=true")
    assert rc == 0, out[-6000:]
    return run


@pytest.mark.slow
def test_dynamic_sampling_trains_full_batches_of_groups_whose_rewards_differ(dynamic_sampling_run):
    m = metrics(dynamic_sampling_run)
    assert [r["iteration"] for r in m] == [0, 1]
    for r in m:
        assert r["batch/groups"] == 8 and r["batch/zero_variance_groups"] == 0, r
        assert r["dynamic_sampling/filled_groups"] == 0 and r["dynamic_sampling/generated_groups"] >= 8, r
        # binary rewards, every group mixed: between 1 and 7 of its 8 responses are right
        assert 1 / 8 <= r["reward/mean"] <= 7 / 8, r
        kept = r["dynamic_sampling/kept_frac"] * r["dynamic_sampling/generated_groups"]
        assert kept == pytest.approx(round(kept)) and 8 <= round(kept), r
        assert r["response/masked_truncated_frac"] == r["response/truncated_frac"], r
    assert max(r["dynamic_sampling/rounds"] for r in m) >= 1, m  # the first round alone was not enough
    assert min(r["dynamic_sampling/kept_frac"] for r in m) < 1


@pytest.mark.slow
def test_overlong_punishment_enters_the_reward(dynamic_sampling_run, tmp_path):
    """With the buffer as long as the budget every response is punished in proportion to its
    length, so the mean punishment is known from the mean length."""
    run = tmp_path / "overlong"
    copy_run(dynamic_sampling_run, run, base_model_only=True)  # no second warm start
    rc, out = train(run, *DAPO, "trainer.iterations=1", "rollout.sampling.max_response_length=8",
                    "reward.overlong_buffer=8", "reward.overlong_penalty=10.0", "loss.mask_truncated=true")
    assert rc == 0, out[-6000:]
    (r,) = metrics(run)
    assert r["reward/overlong_penalty_mean"] == pytest.approx(-10.0 * r["response_length/mean"] / 8)
    task = r["reward/mean"] - r["reward/overlong_penalty_mean"]  # math_verify's 0/1 part
    assert -1e-5 <= task <= 1 + 1e-5, r
    assert r["response/masked_truncated_frac"] == r["response/truncated_frac"] > 0, r
    assert "dynamic_sampling/rounds" not in r


@pytest.mark.slow  # a kill/crash soak (minutes on 2 cores): pytest -m slow
def test_ctrl_c_is_one_line_and_a_finished_run_says_so(tmp_path):
    """Ctrl-C (SIGINT) during training: one line saying where the rerun resumes, no traceback, exit
    130. Rerunning a finished run says it has nothing left to train. The validation curve starts at
    the base model (iteration -1, drawn at 0), and a non-terminal gets one plain line per iteration."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_alp.cli", "train", str(QUICKSTART), f"trainer.output_dir={run}",
           *[o for o in SMALL if "validate_base" not in o], "trainer.progress_bar=true", "trainer.iterations=4",
           "trainer.save_interval=1", "trainer.sft_warmup_steps=20", "trainer.eval_interval=1", "eval.k=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    for line in proc.stdout:  # a pipe, not a terminal: plain lines instead of a redrawn bar
        lines.append(line)
        if line.startswith("iteration 1 of 4"):
            os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C does: the whole foreground process group
            break
    out = "".join(lines) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert re.fullmatch(r"interrupted at iteration 2; rerun the same command to resume from iter_000000[12]",
                        out.strip().splitlines()[-1]), out[-3000:]
    m = metrics(run)
    assert m[0]["iteration"] == -1 and "val/reward_mean" in m[0] and "reward/mean" not in m[0]  # the base model
    # the newest checkpoint holds at least one iteration, so a run of one is finished
    done = subprocess.run([*cmd, "trainer.iterations=1"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "has finished its trainer.iterations=1: nothing to train" in done.stdout, \
        done.stdout


def refused(capsys, run_dir: Path, *overrides: str, lines: int = 1) -> str:
    """``megatron-alp train`` refusing its inputs, run in this process (the refusal comes before
    anything is imported, locked or created; test_cli.py runs refusals as a real process): exit 2
    and one line, or a configuration error's header and one line per problem, and nothing else."""
    capsys.readouterr()
    rc = main(["train", str(QUICKSTART), f"trainer.output_dir={run_dir}", *SMALL, *overrides])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert rc == 2 and len(out.strip().splitlines()) == lines, out[-3000:]
    assert out.startswith("megatron-alp train: error: ") and "Traceback" not in out, out
    return out.strip()


def test_bad_inputs_fail_early_with_clear_errors(tmp_path, capsys):
    """Every input is checked before anything is created: one error line naming the key or the
    file (file:line for a bad row), no traceback, and no run directory, lock, config or base model."""
    line = refused(capsys, tmp_path / "r1", "data.train_files=[data/does_not_exist.jsonl]")
    assert "does_not_exist.jsonl does not exist" in line and not (tmp_path / "r1").exists()
    broken = tmp_path / "broken.jsonl"
    lines = (ROOT / "data" / "largest" / "train.jsonl").read_text().splitlines()[:20]
    broken.write_text("\n".join(lines[:6] + ['{"prompt": "cut sho'] + lines[6:]) + "\n")
    line = refused(capsys, tmp_path / "r2", f"data.train_files=[{broken}]")
    assert f"{broken}:7: bad row: expected one JSON object per line" in line and "data.skip_bad_rows" in line
    assert not (tmp_path / "r2").exists()
    (tmp_path / "file").write_text("not a directory")
    line = refused(capsys, tmp_path / "file")
    assert "trainer.output_dir" in line and "is a file" in line
    line = refused(capsys, tmp_path / "r3", "loss.nmae=grpo", lines=2)
    assert "loss.nmae (command-line override): unknown key; did you mean loss.name?" in line
    line = refused(capsys, tmp_path / "r4", "trainer.prompts_per_iteration=3", "trainer.updates_per_iteration=5")
    assert "must split evenly" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.jsonl", "file"]


def test_a_run_directory_in_use_is_refused_and_left_untouched(tmp_path):
    """A run directory held by a live trainer (here: this process holds its lock) is refused by a
    real ``megatron-alp train`` process, whose terminal shows the one line, and the refused run writes
    nothing into it, not even a line of the running run's log."""
    import fcntl

    busy = tmp_path / "r5"
    busy.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(busy / ".lock", "w") as lock:
        lock.write(str(os.getpid()))
        lock.flush()
        fcntl.lockf(lock, fcntl.LOCK_EX)
        proc = subprocess.run([sys.executable, "-m", "megatron_alp.cli", "train", str(QUICKSTART),
                               f"trainer.output_dir={busy}", *SMALL], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and len(out.strip().splitlines()) == 1, out[-3000:]
    assert out.startswith("megatron-alp train: error: ") and "Traceback" not in out, out
    assert f"is in use by another training process (pid {os.getpid()})" in out
    assert sorted(p.name for p in busy.iterdir()) == [".lock"]


def test_a_fresh_start_never_mixes_with_an_earlier_run(tmp_path, capsys):
    """``trainer.resume=false`` in a directory an earlier run left checkpoints and metrics in is
    refused (they would mix: before, the old metrics were cut and the new run's checkpoint pruned
    by the old run's later ones); ``trainer.archive_previous=true`` moves them aside first."""
    run = tmp_path / "run"
    for i in (4, 6):
        (run / "checkpoints" / f"iter_{i:07d}").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"iteration": 5, "reward/mean": 0.5}\n')
    line = refused(capsys, run, "trainer.resume=false", "trainer.iterations=1")
    assert "holds an earlier run" in line and "trainer.archive_previous=true" in line, line
    assert (run / "metrics.jsonl").read_text() == '{"iteration": 5, "reward/mean": 0.5}\n'
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_0000004", "iter_0000006"]


RECOMPUTE = ("model.recompute=full",)  # the CPU shims must hold inside autograd's recomputation too
PACKED = ("trainer.max_tokens_per_micro_batch=1024", "trainer.sequence_packing=true")


def _train_two_ranks(run: Path, reference: Path, *overrides: str) -> str:
    if not (run / "base_model").exists():
        copy_run(reference, run, base_model_only=True)  # the same model, no second warm start
    rc, out = train(run, *overrides, nproc=2)
    assert rc == 0, out[-6000:]
    return out


def _check_matches_one_rank(layout: str, got: list[dict], reference: list[dict]) -> None:
    base = reference[: len(got)]
    assert [r["iteration"] for r in got] == [r["iteration"] for r in base] == [0, 1], layout
    sigma_keys = sorted(k for k in base[0] if k.startswith("sigma/layer_"))
    assert len(sigma_keys) == 3 * 4  # mean, min, max of the 4 layers
    for r in got:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), (layout, r)
        assert 0 < r["ratio/p2"] <= r["ratio/p50"] <= r["ratio/p98"] < 2, (layout, r)
        assert 0 < r["reward/mean"] < 1 and r["update/skipped"] == 0, (layout, r)
        # sigma of every layer, gathered from every pipeline stage, near its 1e-4 init
        assert sorted(k for k in r if k.startswith("sigma/layer_")) == sigma_keys, layout
        assert all(5e-5 < r[k] < 2e-4 for k in sigma_keys), (layout, r)
    for a, b in zip(got, base):
        for key in ROLLOUT_KEYS:
            assert a[key] == b[key], (layout, a["iteration"], key, a[key], b[key])
    for key in UNPERTURBED_KEYS:
        assert got[0][key] == pytest.approx(base[0][key], rel=1e-3, abs=1e-8), (layout, key, got[0][key], base[0][key])
    for key in LOSS_KEYS:
        assert got[0][key] == pytest.approx(base[0][key], rel=2e-2), (layout, key, got[0][key], base[0][key])


@pytest.mark.slow
def test_tensor_parallel_training_reproduces_the_one_rank_run(sync_run, tmp_path):
    """`megatron-alp train` on 2 gloo ranks with TP2+SP, vLLM in its engine-core subprocess on rank 0
    (the default suite checks the parallel layouts at the update: tests/test_policy_update.py)."""
    _train_two_ranks(tmp_path / "tp2_sp", sync_run, "trainer.iterations=2", *TP2_SP)
    _check_matches_one_rank("tp2_sp", metrics(tmp_path / "tp2_sp"), metrics(sync_run))


@pytest.mark.slow
def test_pipeline_parallel_and_packed_data_parallel_training_reproduce_the_one_rank_run(sync_run, tmp_path):
    """PP2, and DP2 with full activation recomputation and packed, cost-balanced micro-batches."""
    reference = metrics(sync_run)
    layouts = {"pp2": PP2, "dp2_recompute_packed": RECOMPUTE + PACKED}
    for layout, overrides in layouts.items():
        _train_two_ranks(tmp_path / layout, sync_run, "trainer.iterations=2", *overrides)
        _check_matches_one_rank(layout, metrics(tmp_path / layout), reference)
    for packed, padded in zip(metrics(tmp_path / "dp2_recompute_packed"), metrics(tmp_path / "pp2")):
        # the same rollouts: short sequences sharing masked rows leave less padding than 64 padded rows
        assert 0.0 <= packed["batch/padding_frac"] < padded["batch/padding_frac"], (packed, padded)
        # LPT: the fullest rank holds at most the mean plus one sequence (~1/64 of a rank's load here)
        assert 1.0 <= packed["batch/dp_imbalance"] <= 1.05 and packed["batch/dp_imbalance_unbalanced"] >= 1.0, packed


def test_data_parallel_training_reproduces_the_one_rank_run(sync_run, dp2_run):
    """The shared run's first 2 iterations on 2 data-parallel ranks (tests/conftest.py: dp2_run);
    every rank takes part in the validation after the last iteration (the rollout API is
    collective) and rank 0 scores and logs it."""
    two_ranks = metrics(dp2_run)
    _check_matches_one_rank("dp2", two_ranks, metrics(sync_run))
    assert ["val/reward_mean" in r for r in two_ranks] == [False, True]
    r = two_ranks[-1]
    assert r["val/pass@1"] == pytest.approx(r["val/reward_mean"]), r  # rewards are 0 or 1
    assert 0 <= r["val/pass@1"] <= r["val/pass@2"] <= 1 and r["timing/val_s"] > 0, r


@pytest.mark.slow
def test_a_resumed_pipeline_parallel_run_reproduces_the_one_rank_run(sync_run, tmp_path):
    """The checkpoint a PP=2 run saved after iteration 0 is loaded by the next PP=2 run."""
    run = tmp_path / "pp2_resumed"
    _train_two_ranks(run, sync_run, "trainer.iterations=1", *PP2)
    out = _train_two_ranks(run, sync_run, "trainer.iterations=2", *PP2)
    assert "resumed from" in out and "iter_0000001" in out, out[-6000:]
    _check_matches_one_rank("pp2 resumed", metrics(run), metrics(sync_run))


# Asynchronous training (helpers.SEPARATE): engines on their own CPU cores (here: the engine on one
# core, the trainer ranks on the other), generating ahead of the trainer.


def test_async_training_on_two_ranks_bounds_staleness_exactly(sync_run, tmp_path):
    """trainer.max_staleness=2 on 2 data-parallel ranks sharing one core while the engine has the
    other: under the deterministic schedule batch b comes from the weights of iteration max(0, b - 2),
    never older or newer. Batch 0 comes from the initial weights with the same per-sample seeds as
    the synchronous one-rank run: the same rollouts. The checkpoint after iteration 2 holds batches 2
    and 3 (generated by versions 0 and 1); resumed from it on one rank, the run trains on exactly those
    groups (the same rollouts, re-split over one rank), not on regenerated ones."""
    reference = metrics(sync_run)
    run = tmp_path / "async_k2"
    out = _train_two_ranks(run, sync_run, "trainer.iterations=4", "trainer.save_interval=2", *SEPARATE,
                           "trainer.max_staleness=2")
    m = metrics(run)
    assert [r["iteration"] for r in m] == [0, 1, 2, 3]
    assert [r["staleness/mean"] for r in m] == [0, 1, 2, 2]
    assert [r["staleness/max"] for r in m] == [0, 1, 2, 2]
    assert all(r["staleness/regenerated_groups"] == 0 and r["update/skipped"] == 0 for r in m), m
    for key in ROLLOUT_KEYS:
        assert m[0][key] == reference[0][key], (key, m[0][key], reference[0][key])
    for r in m:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert 0 < r["ratio/p2"] <= r["ratio/p50"] <= r["ratio/p98"] < 10, r
    # after the first iteration the trainer finds its batch generated already
    assert all(r["timing/rollout_wait_s"] < r["timing/update_s"] for r in m[1:]), m
    held = read_metadata(run / "checkpoints" / "iter_0000002")["extra"]
    assert held["ahead_groups"] == 2 * 16 and held["ahead_versions"] == [0, 1], held
    assert "checkpoints held up to 32 groups generated ahead (weight versions 0, 1: " in out, out[-3000:]

    resumed = copy_run(run, tmp_path / "resumed_on_one_rank")
    shutil.rmtree(resumed / "checkpoints" / "iter_0000004")
    rc, out = train(resumed, "trainer.iterations=4", "trainer.save_interval=2", *SEPARATE, "trainer.max_staleness=2")
    assert rc == 0, out[-6000:]
    assert "resuming iter_0000002 at another layout (DP 2 -> 1): weights, optimizer state, ALP sigmas" in out, out
    assert f"resumed from {resumed / 'checkpoints' / 'iter_0000002'} at iteration 2, step 4" in out, out
    again = metrics(resumed)
    assert [r["iteration"] for r in again] == [0, 1, 2, 3]
    for a, b in zip(m[2:], again[2:]):
        for key in (*ROLLOUT_KEYS, "staleness/mean", "staleness/max", "data/epoch", "step", "lr", "lr/sigma"):
            assert a[key] == b[key], (a["iteration"], key, a[key], b[key])
        for key in LOSS_KEYS:  # the same batch, within the ALP noise of another layout
            assert a[key] == pytest.approx(b[key], rel=0.1, abs=1e-5), (a["iteration"], key, a[key], b[key])


@pytest.mark.slow
def test_dynamic_sampling_fills_asynchronous_batches(dynamic_sampling_run, tmp_path):
    """Dynamic sampling on top of max_staleness=1: the batch generated ahead is filtered like a
    synchronous one, and its extra rounds are generated with the current weights (staleness 0), so
    the trained batch is full, every group has signal, and no group is older than 1."""
    run = tmp_path / "async_dapo"
    copy_run(dynamic_sampling_run, run, base_model_only=True)  # no second warm start
    rc, out = train(run, *DAPO, "trainer.dynamic_sampling=true", "trainer.dynamic_sampling_max_rounds=8",
                    *SEPARATE, "trainer.max_staleness=1")
    assert rc == 0, out[-6000:]
    m = metrics(run)
    assert [r["iteration"] for r in m] == [0, 1]
    for r in m:
        assert r["batch/groups"] == 8 and r["batch/zero_variance_groups"] == 0, r
        assert r["dynamic_sampling/filled_groups"] == 0 and r["staleness/max"] == r["iteration"], r
    # iteration 1 trains on the groups generated ahead (staleness 1) that had signal, topped up by
    # extra rounds generated now (staleness 0)
    r = m[1]
    assert 0 < r["staleness/mean"] <= 1 and (r["staleness/mean"] == 1 or r["dynamic_sampling/rounds"] > 0), r


@pytest.mark.slow
def test_sigkill_mid_async_iteration_resumes_to_the_same_metrics(sync_run, tmp_path):
    """max_staleness=1 (deterministic schedule): a SIGKILL while the next batch is generating loses
    nothing. The checkpoint holds the batch generated ahead, and the resumed run trains on it: every
    iteration's metrics equal those of the run never killed (benchmarks/bench_async_replay.py kills at
    eight moments)."""
    common = ["trainer.iterations=4", "trainer.save_interval=1", *SEPARATE, "trainer.max_staleness=1"]
    straight = copy_run(sync_run, tmp_path / "straight", base_model_only=True)
    rc, out = train(straight, *common)
    assert rc == 0, out[-6000:]
    run = copy_run(sync_run, tmp_path / "killed", base_model_only=True)
    kill_after_two_iterations(run, *common)
    saved = sorted((run / "checkpoints").glob("iter_???????"))
    assert saved, "no checkpoint before the kill"
    extra = torch.load(saved[-1] / "extra.pt", weights_only=False)
    # trained on `iteration` batches of 16 prompts; the next one is in the checkpoint, drawn and generated
    assert extra["sampler"]["position"] == 16 * extra["iteration"] and extra["policy_version"] == extra["iteration"]
    assert extra["ahead"]["sampler"]["position"] == 16 * (extra["iteration"] + 1)
    assert extra["ahead_groups"] == 16 and extra["ahead_versions"] == [extra["iteration"] - 1]
    rc, out = train(run, *common)
    assert rc == 0 and "resumed from" in out, out[-6000:]
    resumed, reference = metrics(run), metrics(straight)
    assert [r["iteration"] for r in resumed] == [0, 1, 2, 3]
    assert [r["staleness/max"] for r in resumed] == [0.0, 1.0, 1.0, 1.0]
    for a, b in zip(reference, resumed):
        _same_metrics(a, b)
        for key in ROLLOUT_KEYS:
            assert a[key] == b[key], (a["iteration"], key)


def test_validation_after_the_last_iteration(sync_run):
    """`trainer.eval_interval`: val/* (average@k, pass@j) of data.val_files after every interval
    (10 in the quickstart) and after the last iteration, from the run's engine; the reward figure
    draws them."""
    one_rank = metrics(sync_run)
    assert ["val/reward_mean" in r for r in one_rank] == [False] * 2 + [True]
    r = one_rank[-1]
    assert r["val/pass@1"] == pytest.approx(r["val/reward_mean"]), r  # rewards are 0 or 1
    assert 0 <= r["val/pass@1"] <= r["val/pass@2"] <= 1 and r["timing/val_s"] > 0, r
    assert (sync_run / "plots" / "reward.png").is_file()


@pytest.mark.slow
def test_validation_every_eval_interval_on_two_ranks(sync_run, tmp_path):
    """On 2 ranks every rank takes part in validation sampling (the rollout API is collective) and
    rank 0 scores and logs."""
    one_rank = metrics(sync_run)
    run = tmp_path / "dp2"
    _train_two_ranks(run, sync_run, "trainer.iterations=3", "trainer.eval_interval=2", "eval.k=2")
    two_ranks = metrics(run)
    assert ["val/reward_mean" in r for r in two_ranks] == [False, True, True]
    for r in one_rank[-1:] + two_ranks[1:]:
        assert r["val/pass@1"] == pytest.approx(r["val/reward_mean"]), r  # rewards are 0 or 1
        assert 0 <= r["val/pass@1"] <= r["val/pass@2"] <= 1 and r["timing/val_s"] > 0, r
    assert (run / "plots" / "reward.png").is_file()


def _check_calibrated(m: list[dict], calibrating: list[bool], target: float) -> None:
    """The calibration/* metrics on exactly the calibrating iterations, each meeting its target, and
    per-layer sigmas sized by the layers' input divergence: bf16 rounding compounds layer by layer,
    so the last layer's input diverges, and is perturbed, more than the first's."""
    assert ["calibration/scale" in r for r in m] == calibrating
    assert ["timing/layer_probe_s" in r for r in m] == calibrating
    for r in (r for r, due in zip(m, calibrating) if due):
        assert r["calibration/per_layer"] == 1.0 and r["calibration/train_engine_kl"] > 0
        assert r["calibration/target_kl"] == pytest.approx(target * r["calibration/train_engine_kl"])
        assert r["calibration/perturbed_kl"] == pytest.approx(r["calibration/target_kl"], rel=0.021)
        assert r["sigma/layer_03/mean"] > 2 * r["sigma/layer_00/mean"], r
    assert abs(math.log(m[0]["sigma/mean"] / 1e-4)) > 1, m[0]["sigma/mean"]


def test_auto_sigma_is_calibrated_per_layer_before_the_first_update_and_every_k(sync_run, tmp_path):
    """perturbation.init_std: auto, calibration_mode: per_layer on the quickstart (bf16 engine, fp32
    trainer), calibrate_every 2, target 2: iterations 0 and 2 probe the layers (engine awake) and
    calibrate on their own rollouts before their updates (one terminal line each), the perturbed KL
    lands within the search's 2% of 2x the measured engine-training KL, and the sigmas trained from
    there are the calibrated ones, not the 1e-4 placeholder (tests/test_calibration.py checks the
    target with fresh noise, and the global mode on every layout)."""
    run = tmp_path / "auto"
    copy_run(sync_run, run, base_model_only=True)
    rc, out = train(run, "trainer.iterations=3", "trainer.eval_interval=0", "trainer.save_interval=16",
                    "perturbation.init_std=auto", "perturbation.calibrate_every=2",
                    "perturbation.calibration_target=2", "perturbation.calibration_mode=per_layer")
    assert rc == 0, out[-6000:]
    _check_calibrated(metrics(run), [True, False, True], 2.0)
    assert out.count("sigma calibrated at iteration") == 2 and "x layer-input divergence engine-train" in out


@pytest.mark.slow
def test_per_layer_calibration_on_two_tensor_parallel_ranks_with_sequence_parallelism(sync_run, tmp_path):
    """The layer probe under TP=2 with sequence parallelism: both ranks run the probe's forwards,
    the layer inputs are gathered from their sequence shards, rank 0 compares them with the engine's
    and every rank sets the same sigmas."""
    run = tmp_path / "tp2_sp"
    out = _train_two_ranks(run, sync_run, "trainer.iterations=1", "trainer.eval_interval=0",
                           "trainer.save_interval=16", "parallel.tensor_model_parallel_size=2",
                           "parallel.sequence_parallel=true", "perturbation.init_std=auto",
                           "perturbation.calibration_mode=per_layer")
    _check_calibrated(metrics(run), [True], 1.0)
    assert "x layer-input divergence engine-train" in out


def test_warm_start_leaves_out_the_box_on_a_fraction_of_prompts(tmp_path):
    """trainer.sft_warmup_unboxed: that fraction of the prompts (drawn with the seed) gets "The answer
    is 7." as its warm-start target, the others "The answer is \\boxed{7}."; the TIR format refuses it."""
    from megatron_alp.data.prompts import PromptDataset, load_tokenizer
    from megatron_alp.models.tiny import save_tokenizer
    from megatron_alp.trainer.warm_start import warmup_examples

    tok = load_tokenizer(save_tokenizer(tmp_path))
    prompts = PromptDataset.from_files([str(ROOT / "data" / "largest" / "train.jsonl")], tok, 96).head(400)
    examples = warmup_examples(prompts, tok, "answer", unboxed=0.5, seed=3)
    texts = [tok.decode(ids, skip_special_tokens=True) for _, ids, _ in examples]
    boxed = [t == f"The answer is \\boxed{{{p.ground_truth}}}." for t, p in zip(texts, prompts)]
    plain = [t == f"The answer is {p.ground_truth}." for t, p in zip(texts, prompts)]
    assert all(b != u for b, u in zip(boxed, plain)) and 160 < sum(plain) < 240
    assert examples == warmup_examples(prompts, tok, "answer", unboxed=0.5, seed=3)
    assert all(t.endswith("}.") for t in [tok.decode(ids, skip_special_tokens=True)
                                          for _, ids, _ in warmup_examples(prompts, tok, "answer")])
    with pytest.raises(ValueError, match="unboxed warm-start answers are for the answer format"):
        warmup_examples(prompts, tok, "tir", unboxed=0.5)


@pytest.mark.slow
def test_async_quickstart_reward_rises(sync_run, tmp_path):
    """The quickstart task trained asynchronously (max_staleness=1, the engine on its own core) for
    12 iterations: the reward of the last 5 is at least 1.5x that of the first 5 (seed 1: 0.078 ->
    0.18; the full 40-iteration runs for several seeds are the slow test below)."""
    run = tmp_path / "async"
    copy_run(sync_run, run, base_model_only=True)  # the same warm start, not run again
    rc, out = train(run, "trainer.iterations=12", "trainer.prompts_per_iteration=32", "trainer.updates_per_iteration=4",
                    "trainer.eval_interval=0", "trainer.save_interval=16", *SEPARATE, "trainer.max_staleness=1")
    assert rc == 0, out[-6000:]
    m = metrics(run)
    reward = [r["reward/mean"] for r in m]
    assert [r["staleness/max"] for r in m] == [0] + [1] * 11
    assert sum(reward[-5:]) >= 1.5 * sum(reward[:5]), reward


@pytest.mark.slow
@pytest.mark.parametrize("config,mode", [(QUICKSTART, ()), (QUICKSTART, (*SEPARATE, "trainer.max_staleness=1")),
                                         (QUICKSTART_LORA, ())], ids=["sync", "async", "lora"])
def test_quickstart_reward_rises_and_generalizes_for_several_seeds(tmp_path, config, mode):
    """The whole CPU quickstart, as the README runs it (and asynchronously, and its LoRA variant), for
    seeds 1-3: the last-10 mean reward is at least 1.5x the first-10 mean, and the validation average@k
    on held-out problems after RL beats the warm-started base model's (scored by `megatron-alp eval`
    on RUN_DIR/base_model) by 0.1."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for seed in (1, 2, 3):
        run = tmp_path / f"seed{seed}"
        common = [str(config), f"trainer.output_dir={run}", f"trainer.seed={seed}"]
        for cmd in (["train", *common, "trainer.progress_bar=false", *mode],
                    ["eval", *common, "--out", str(run / "base.json")]):
            proc = subprocess.run([sys.executable, "-m", "megatron_alp.cli", *cmd], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=1800)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        m = [r for r in metrics(run) if r["iteration"] >= 0]  # iteration -1: the base model's validation
        reward = [r["reward/mean"] for r in m]
        first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
        assert last >= 1.5 * first, (seed, first, last, reward)
        base = json.loads((run / "base.json").read_text())["average"]["average@4"]
        assert m[-1]["val/reward_mean"] >= base + 0.1, (seed, base, m[-1]["val/reward_mean"])


@pytest.mark.slow
def test_moe_routing_replay_trains_and_logs_routing_metrics(tmp_path):
    """A tiny Qwen3-MoE on 2 ranks with expert parallelism (EP=2 x DP=2) and R2: the old-policy pass
    records its routing, the reference and update passes replay it (token-budget micro-batches, so
    the ranks' micro-batch counts are evened out for the all-to-all), and every iteration logs the
    moe/* metrics (the default suite runs this layout under the collective checker, test_comm.py). Under `fixed` (R2's default) the experts used never flip; the noise still moves
    the router's own choice now and then. vLLM on the CPU returns no routing: no rollout agreement."""
    run = tmp_path / "moe_r2"
    rc, out = train(run, "model.tiny=qwen3_moe", "parallel.expert_model_parallel_size=2", "moe.routing_replay=r2",
                    "trainer.sft_warmup_steps=0", "trainer.iterations=1", "trainer.prompts_per_iteration=8",
                    "trainer.max_tokens_per_micro_batch=120", "trainer.eval_interval=0", nproc=2)
    assert rc == 0, out[-6000:]
    (m,) = metrics(run)
    assert m["update/skipped"] == 0 and math.isfinite(m["loss/total"]), m
    assert m["moe/update_flip_frac"] == 0.0 and m["moe/replayed_frac"] == 1.0, m
    assert 0.0 <= m["moe/noise_flip_frac"] < 0.5, m
    assert m["moe/expert_load_worst_layer"] >= m["moe/expert_load"] >= 1.0, m
    assert 0.5 < m["moe/aux_loss"] < 2.0, m  # 1 at perfect balance (4 experts, top-2: at most 2)
    assert "moe/rollout_agreement" not in m


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 NVIDIA GPUs (vLLM returns routing only from its "
                    "Model Runner V2, on a GPU; one training rank per GPU)")
def test_r3_on_two_ranks_trains_on_the_routing_each_rank_fetched(tmp_path):
    """A tiny Qwen3-MoE on 2 ranks (EP=2 x DP=2) with R3 and one replica: rank 0 keeps its responses'
    routing and each rank fetches the rows it trains (review finding R5); the update replays it on
    both, and the trainer's own router agrees with the engine's on most (token, layer) pairs."""
    run = tmp_path / "moe_r3"
    rc, out = train(run, "model.tiny=qwen3_moe", "parallel.expert_model_parallel_size=2", "moe.routing_replay=r3",
                    "rollout.replicas=1", "trainer.sft_warmup_steps=0", "trainer.iterations=1",
                    "trainer.prompts_per_iteration=8", "trainer.max_tokens_per_micro_batch=120",
                    "trainer.eval_interval=0", nproc=2)
    assert rc == 0, out[-6000:]
    (m,) = metrics(run)
    assert m["moe/replayed_frac"] == 1.0 and m["moe/rollout_agreement"] > 0.9, m
