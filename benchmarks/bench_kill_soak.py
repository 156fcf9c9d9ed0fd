"""Kill soak: SIGKILL an asynchronous 2-replica training run at random moments, resume it each time.

A CPU quickstart on 2 torchrun ranks, one vLLM replica per rank (each on its own core), a checkpoint
every iteration, in one of the run kinds of ``KINDS`` (``--kind``): by default
``trainer.max_staleness=1`` with partial rollouts; also the deterministic schedule at staleness 2,
LoRA with merged and adapter sync, per-layer sigma calibration due at every iteration, dynamic
sampling with its extra rounds, and multi-turn TIR generating ahead (code executing in the
sandbox). Once a (re)started run has
trained an iteration, every process of the job (launcher, ranks, engine cores) is SIGKILLed at a
seeded uniform moment of the next iteration (its length, checkpoint included, measured between
the first job's first two iterations), so kills land in rollout waits, updates and checkpoint
saves while the next batch generates in the background; every third kill (the second of two) waits until rank 0
enters the kind's target phase (the weight sync: a fraction of a second per iteration, which pauses
the partial rollouts in flight; the layer probe for calibration; the rollout for dynamic sampling's
rounds), so those are hit too. The phase hit is read from the ranks' heartbeats
(``trainer.hang_deadline_s``). The run is resumed with ``trainer.resume=true`` until it finishes.
A kill+resume is sound when the resumed run trains on from its last checkpoint, nothing of the
killed job survives it (every process carries a marker in its environment, and its run directory
in its command line), none of the /dev/shm segments its processes mapped is left, and no sandbox
directory (``alp-sandbox-<pid>-*``, cgroups and scratch) of a process of the job remains.

    python benchmarks/bench_kill_soak.py            # 10 kills (15-25 minutes on 2 cores)
    python benchmarks/bench_kill_soak.py --quick    # 3 kills
    python benchmarks/bench_kill_soak.py --kind tir_async --kills 2

Prints a table (kill #, phase hit, iteration reached, resumed from, lost, trained on) and totals,
writes ``OUT/report.json`` and exits 1 when a resume failed or anything of a killed job remained.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from megatron_alp.runtime.shm_janitor import mapped

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
MARKER = "MEGATRON_ALP_KILL_SOAK"  # in the environment of every process of the soaked job
OVERRIDES = [
    "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.validate_base=false",
    "trainer.prompts_per_iteration=16", "trainer.updates_per_iteration=2", "trainer.eval_interval=0",
    "trainer.save_interval=1", "trainer.sft_warmup_steps=30", "trainer.resume=true",
    "trainer.hang_deadline_s=3600",  # only for the heartbeats: which phase each kill hit
    # two replicas on 2 cores: one core each, the trainer ranks beside them
    "rollout.placement=separate", "rollout.replicas=2", "rollout.cpu_cores=[0,1]",
]
# kind -> (config, overrides, the phase every third kill waits for)
KINDS = {
    "async_partial": ("quickstart_cpu.yaml", ["trainer.max_staleness=1", "trainer.async_schedule=free",
                                              "rollout.partial_rollout=true"], "weight_sync"),
    "async_deterministic": ("quickstart_cpu.yaml", ["trainer.max_staleness=2", "rollout.partial_rollout=true"],
                            "weight_sync"),
    "lora_merged": ("quickstart_lora_cpu.yaml", ["trainer.max_staleness=1", "lora.sync=merged"], "weight_sync"),
    "lora_adapter": ("quickstart_lora_cpu.yaml", ["trainer.max_staleness=1", "lora.sync=adapter"], "weight_sync"),
    "per_layer_calibration": ("quickstart_cpu.yaml", ["perturbation.init_std=auto",
                                                      "perturbation.calibration_mode=per_layer",
                                                      "perturbation.calibrate_every=1"], "layer_probe"),
    "dynamic_sampling": ("quickstart_cpu.yaml", ["trainer.max_staleness=1", "trainer.dynamic_sampling=true",
                                                 "trainer.dynamic_sampling_max_rounds=4"], "rollout"),
    "tir_async": ("quickstart_tir_cpu.yaml", ["trainer.max_staleness=1", "trainer.prompts_per_iteration=8"],
                  "rollout"),
}
RUN_TIMEOUT_S = 900  # one (re)started job, from start to its kill or end


def start(run: Path, iterations: int, token: str, log, kind: str) -> subprocess.Popen:
    from megatron_alp.runtime.parallel import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
           "-m", "megatron_alp.cli", "train", str(CONFIGS / KINDS[kind][0]), f"trainer.output_dir={run}",
           f"trainer.iterations={iterations}", *OVERRIDES, *KINDS[kind][1]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), MARKER: token}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def logged(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def completed(run: Path) -> int:
    """Iterations the run has logged (the highest logged iteration + 1)."""
    return max((r["iteration"] for r in logged(run)), default=-1) + 1


def heartbeats(run: Path) -> dict[int, dict]:
    beats = {}
    for path in sorted((run / "heartbeat").glob("rank_*.json")):
        try:
            beats[int(path.stem.split("_")[1])] = json.loads(path.read_text())
        except (ValueError, OSError):  # replaced while read
            pass
    return beats


def ours(token: str, run: Path) -> list[psutil.Process]:
    """Live processes of the soaked job: its marker in their environment or its run dir in their command line."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(MARKER) == token or str(run) in " ".join(p.cmdline()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def kill_job(proc: subprocess.Popen, token: str, run: Path) -> None:
    """SIGKILL the launcher and every process of the job at once (torchrun puts its ranks in
    sessions of their own, so a process-group kill would miss them)."""
    for p in [psutil.Process(proc.pid), *ours(token, run)]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def orphans_after(token: str, run: Path, settle_s: float = 30.0) -> list[str]:
    """What of a killed or finished job is still alive once ``settle_s`` have passed."""
    deadline = time.time() + settle_s
    while True:
        left = ours(token, run)
        if not left or time.time() > deadline:
            break
        time.sleep(0.5)
    out = []
    for p in left:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            pass
    return out


def mapped_shm(token: str, run: Path) -> set[str]:
    """The /dev/shm segments the job's live processes map now."""
    return {name for p in ours(token, run) for name in mapped(str(p.pid))}


def sandbox_dirs(pids: set[int]) -> list[str]:
    """Sandbox directories (``alp-sandbox-<pid>-*``: cgroups under /sys/fs/cgroup, the unsafe mode's
    scratch in the temp folder) made by one of ``pids``."""
    found = []
    roots = [("/sys/fs/cgroup", 6), (tempfile.gettempdir(), 0)]
    for root, depth in roots:
        for here, dirs, _ in os.walk(root):
            if here[len(root):].count(os.sep) >= depth:
                dirs[:] = []
            for name in list(dirs):
                parts = name.split("-")
                if name.startswith("alp-sandbox-") and len(parts) > 2 and parts[2].isdigit():
                    dirs.remove(name)
                    if int(parts[2]) in pids:
                        found.append(os.path.join(here, name))
    return found


def left_in_shm(names: set[str]) -> list[str]:
    return sorted(name for name in names if os.path.exists(f"/dev/shm/{name}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 kills on a shorter run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kind", choices=sorted(KINDS), default="async_partial", help="the run kind soaked")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_kill_soak")
    args = parser.parse_args()
    kills = 3 if args.quick else args.kills
    iterations = kills + 4  # each start trains an iteration before its kill (the first two), then some to finish
    rng = random.Random(args.seed)
    out = args.out.resolve()
    run = out / "run"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    token = uuid.uuid4().hex
    segments: set[str] = set()  # every /dev/shm segment a process of the job mapped
    pids: set[int] = set()  # every process of the job seen
    t_start = time.time()
    print(f"kill soak: {kills} kills of a {iterations}-iteration {args.kind} 2-replica run in {run}", flush=True)

    rows, failures = [], []
    cycle_s = None  # one iteration, checkpoint included: the time between two logged iterations
    attempt = 0
    resumed_from = None
    while True:
        attempt += 1
        log_path = out / f"job_{attempt}.log"
        with open(log_path, "w") as log:
            proc = start(run, iterations, token, log, args.kind)
        t0 = time.time()
        base = completed(run)
        seen, seen_at = base, None
        deadline = t0 + RUN_TIMEOUT_S
        killing = len(rows) < kills
        # every third kill (the last of fewer) waits for the kind's phase
        target = KINDS[args.kind][2] if (len(rows) + 1) % min(3, kills) == 0 else None
        kill_at = None
        sampled = 0.0
        while proc.poll() is None and time.time() < deadline:
            if time.time() - sampled > 2.0:
                segments |= mapped_shm(token, run)
                pids |= {p.pid for p in ours(token, run)}
                sampled = time.time()
            now_done = completed(run)
            if now_done > seen:
                if seen_at is not None and cycle_s is None:
                    cycle_s = (time.time() - seen_at) / (now_done - seen)
                seen, seen_at = now_done, time.time()
                if killing and kill_at is None and cycle_s is not None:  # trained on: kill in the next iteration
                    kill_at = time.time() + rng.uniform(0, cycle_s)
            if kill_at is not None and time.time() >= kill_at:
                if target is None or heartbeats(run).get(0, {}).get("phase") == target:
                    break
            time.sleep(0.2 if target is None or kill_at is None else 0.01)
        text = log_path.read_text()
        if attempt > 1:
            match = re.search(r"resumed from \S+ at iteration (\d+)", text)
            resumed_from = int(match.group(1)) if match else 0
            rows[-1].update(resumed_from=resumed_from, lost=rows[-1]["reached"] - resumed_from,
                            trained_on=completed(run) > resumed_from)
            print(f"  resumed from iteration {resumed_from}, trained on to {completed(run)}", flush=True)
        if proc.poll() is not None:  # finished (or failed) without a kill
            ok = proc.returncode == 0 and completed(run) == iterations
            if not ok:
                failures.append(f"job {attempt} exited {proc.returncode} at iteration {completed(run)} (log {log_path})")
                print(f"  job {attempt} failed (exit {proc.returncode}); log: {log_path}", flush=True)
            if rows and "trained_on" in rows[-1] and not ok:
                rows[-1]["trained_on"] = False
            break
        if kill_at is None:
            failures.append(f"job {attempt} made no progress in {RUN_TIMEOUT_S} s (log {log_path})")
            kill_job(proc, token, run)
            break
        beats = heartbeats(run)
        reached = completed(run)
        kill_job(proc, token, run)
        left = orphans_after(token, run)
        row = {"kill": len(rows) + 1, "phase": beats.get(0, {}).get("phase", "?"),
               "phases": {r: b.get("phase") for r, b in beats.items()},
               "in_iteration": beats.get(0, {}).get("iteration"), "reached": reached,
               "seconds_into_run": round(time.time() - t_start, 1), "orphans": left}
        rows.append(row)
        print(f"kill {row['kill']}/{kills} at {row['seconds_into_run']:.0f} s: phase {row['phase']} "
              f"(rank 1: {row['phases'].get(1, '?')}), {reached} iterations done, "
              f"{len(left)} processes left", flush=True)
        if left:
            failures.append(f"kill {row['kill']}: {len(left)} processes of the killed job alive: {left}")
            for p in left:
                os.kill(int(p.split()[0]), signal.SIGKILL)

    final_orphans = orphans_after(token, run)
    time.sleep(5)  # the janitors' last round
    leftover_shm = left_in_shm(segments)
    leftover_sandbox = sandbox_dirs(pids)
    trained_on = sum(bool(r.get("trained_on")) for r in rows)
    lost = [r["lost"] for r in rows if "lost" in r]
    orphan_count = sum(len(r["orphans"]) for r in rows) + len(final_orphans)
    if trained_on < len(rows) or len(rows) < kills:
        failures.append(f"{trained_on} of {kills} resumes trained on")
    if orphan_count:
        failures.append(f"{orphan_count} orphaned processes")
    if final_orphans:
        failures.append(f"alive after the end: {final_orphans}")
    if leftover_shm:
        failures.append(f"{len(leftover_shm)} /dev/shm segments of the job left: {leftover_shm}")
    if leftover_sandbox:
        failures.append(f"{len(leftover_sandbox)} sandbox directories of the job left: {leftover_sandbox}")

    print(f"\n{'kill':>4}  {'phase hit (rank 0)':<22}{'reached':>8}{'resumed':>8}{'lost':>6}  trained on")
    for r in rows:
        print(f"{r['kill']:>4}  {r['phase']:<22}{r['reached']:>8}{r.get('resumed_from', '-'):>8}"
              f"{r.get('lost', '-'):>6}  {'yes' if r.get('trained_on') else 'NO'}")
    print(f"resumes that trained on: {trained_on}/{kills}")
    if lost:
        print(f"iterations lost: mean {sum(lost) / len(lost):.2f}, max {max(lost)}")
    print(f"orphaned processes after the kills and the end: {orphan_count}")
    print(f"/dev/shm segments the job's processes mapped: {len(segments)}, left after the kills and the end: "
          f"{len(leftover_shm)}{' ' + str(leftover_shm) if leftover_shm else ''}")
    print(f"sandbox directories of the job's processes left: {len(leftover_sandbox)}")
    print(f"run {'finished' if completed(run) == iterations else 'did not finish'}: {completed(run)} of "
          f"{iterations} iterations in {time.time() - t_start:.0f} s")
    report = {"kills": kills, "shm_segments": len(segments), "iterations": iterations, "seed": args.seed, "rows": rows,
              "resumes_trained_on": trained_on, "lost_mean": sum(lost) / len(lost) if lost else None,
              "lost_max": max(lost, default=None), "orphans": orphan_count, "final_orphans": final_orphans,
              "leftover_shm": leftover_shm, "leftover_sandbox": leftover_sandbox, "kind": args.kind,
              "finished": completed(run) == iterations,
              "seconds": time.time() - t_start, "failures": failures}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    for failure in failures:
        print(f"FAILED: {failure}")
    print(f"wrote {out / 'report.json'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
