"""Asynchronous runs replay: two seeded runs agree iteration by iteration, and a run SIGKILLed at any
moment resumes to the uninterrupted run's metrics.

The CPU quickstart at CI size on one rank, ``rollout.placement: separate`` (the engine on its own
core, generating ahead), ``trainer.async_schedule: deterministic``, a checkpoint every iteration.
Every run starts from the same warm-started base model (the first run's, copied in).

- replay: ``max_staleness`` 1 and 2, and 2 with partial rollouts (cut at a fixed point), each run
  twice; every deterministic metric of every iteration compared (``KEYS``). With ``--free`` the same
  pair under ``async_schedule: free`` shows what the deterministic schedule removes (which weights
  generated which batch varies with timing).
- kills (``max_staleness`` 2): for each of ``MOMENTS`` a run is SIGKILLed (launcher, trainer and
  engine at once) when rank 0's heartbeat (``trainer.hang_deadline_s``) shows that phase of that
  iteration, or just after a checkpoint landed, then resumed (``trainer.resume``) to the end; its
  metrics are compared with the uninterrupted k = 2 run's. ``--partial``: the kills again with
  partial rollouts, against the uninterrupted partial run.

    python benchmarks/bench_async_replay.py                   # 5 iterations, 8 kills (~30 min on 2 cores)
    python benchmarks/bench_async_replay.py --kills 3 --free --partial

Prints one line per comparison (iterations equal / differing, the largest relative difference and
its key) and exits 1 when a deterministic comparison differs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kill_soak import MARKER, kill_job  # noqa: E402  (benchmarks/ is not a package)

TOKEN = uuid.uuid4().hex  # in the environment of every process this benchmark starts: what a kill takes down
QUICKSTART = ROOT / "configs" / "quickstart_cpu.yaml"
COMMON = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.validate_base=false",
          "trainer.prompts_per_iteration=16", "trainer.updates_per_iteration=2", "trainer.eval_interval=0",
          "trainer.save_interval=1", "trainer.resume=true", "trainer.hang_deadline_s=3600",
          "rollout.placement=separate"]
# What a replayed or resumed iteration must reproduce: rollouts (prompts, samples, rewards), the
# weights that generated them, the update and the policy it left.
KEYS = ("reward/mean", "reward/std", "response_length/mean", "response_length/max", "staleness/mean",
        "staleness/max", "staleness/regenerated_groups", "loss/policy", "ratio/p2", "ratio/p50", "ratio/p98",
        "mismatch/kl_k3", "kl_ref/mean", "entropy/mean", "grad_norm", "sigma/mean", "step", "data/epoch")
REL, ABS = 1e-5, 1e-7  # as the synchronous kill tests: the same computation, reloaded from a checkpoint
# (iteration, phase of rank 0) to kill at; "saved" = just after that iteration's checkpoint landed
MOMENTS = [(1, "rollout"), (1, "logprob"), (1, "policy_update"), (1, "weight_sync"), (1, "checkpoint_save"),
           (2, "policy_update"), (2, "weight_sync"), (3, "saved")]


def start(run: Path, overrides: list[str], log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_alp.cli", "train", str(QUICKSTART), f"trainer.output_dir={run}",
           *COMMON, *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", MARKER: TOKEN}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_to_end(run: Path, overrides: list[str], name: str) -> None:
    with open(run / f"{name}.log", "w") as log:
        proc = start(run, overrides, log)
        if proc.wait() != 0:
            raise SystemExit(f"{run.name} failed (exit {proc.returncode}): see {run / f'{name}.log'}")


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r["iteration"] >= 0]


def fresh(run: Path, base: Path) -> Path:
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(base, run / "base_model")  # the trainer finds its warm-started base: no second warm start
    return run


def compare(a: list[dict], b: list[dict]) -> tuple[int, list[int], float, str]:
    """(iterations compared, those that differ, largest relative difference, its key)."""
    differ, worst, worst_key = [], 0.0, "-"
    for ra, rb in zip(a, b):
        bad = False
        for key in KEYS:
            x, y = ra.get(key), rb.get(key)
            if x is None and y is None:
                continue
            if x is None or y is None:
                bad, worst_key = True, f"{key} (missing)"
                continue
            rel = abs(x - y) / max(abs(x), abs(y), 1e-30)
            if rel > worst:
                worst, worst_key = rel, key
            bad |= abs(x - y) > max(REL * max(abs(x), abs(y)), ABS)
        if bad:
            differ.append(ra["iteration"])
    if len(a) != len(b):
        differ.append(-1)
    return len(a), differ, worst, worst_key


def heartbeat(run: Path) -> dict:
    try:
        return json.loads((run / "heartbeat" / "rank_0.json").read_text())
    except (OSError, ValueError):  # not written yet, or replaced while read
        return {}


def kill_at(run: Path, overrides: list[str], iteration: int, phase: str, timeout_s: float = 900) -> str:
    """Start ``run``, SIGKILL it at the moment; what rank 0 was doing then."""
    with open(run / "killed.log", "w") as log:
        proc = start(run, overrides, log)
        deadline = time.time() + timeout_s
        while proc.poll() is None and time.time() < deadline:
            if phase == "saved":
                if (run / "checkpoints" / f"iter_{iteration + 1:07d}").is_dir():
                    break
            else:
                beat = heartbeat(run)
                if beat.get("iteration") == iteration and beat.get("phase") == phase:
                    break
            time.sleep(0.01)
        if proc.poll() is not None:
            raise SystemExit(f"{run.name} ended before its kill (exit {proc.returncode}): see {run / 'killed.log'}")
        beat = heartbeat(run)
        kill_job(proc, TOKEN, run)  # the trainer and its engine at once
    return f"{beat.get('phase', '?')} of iteration {beat.get('iteration', '?')}"


def line(name: str, result: tuple[int, list[int], float, str]) -> str:
    n, differ, worst, key = result
    verdict = "EQUAL" if not differ else f"DIFFER at iterations {differ}"
    return f"{name:<44}{n:>4} iterations  {verdict:<28} largest rel. difference {worst:.1e} ({key})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--kills", type=int, default=len(MOMENTS), help=f"the first N of the {len(MOMENTS)} moments")
    parser.add_argument("--free", action="store_true", help="also replay under async_schedule: free, for contrast")
    parser.add_argument("--partial", action="store_true", help="the kills again with partial rollouts")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_async_replay")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    iters = [f"trainer.iterations={args.iterations}"]
    lines, failed = [], False

    def staleness(k, schedule="deterministic", partial=False):
        return [*iters, f"trainer.max_staleness={k}", f"trainer.async_schedule={schedule}",
                f"rollout.partial_rollout={str(partial).lower()}"]

    t0 = time.time()
    reference = out / "k2_a"
    shutil.rmtree(reference, ignore_errors=True)
    reference.mkdir(parents=True)
    print(f"reference: max_staleness 2, {args.iterations} iterations (warm start included) in {reference}", flush=True)
    run_to_end(reference, staleness(2), "train")
    base = reference / "base_model"
    straight = metrics(reference)
    per_iteration = {"deterministic k=2": [r["timing/total_s"] for r in straight[1:]]}

    arms = [("k2_b", staleness(2), "k2_a"), ("k1_a", staleness(1), None), ("k1_b", staleness(1), "k1_a"),
            ("k2_partial_a", staleness(2, partial=True), None), ("k2_partial_b", staleness(2, partial=True), "k2_partial_a")]
    if args.free:
        arms += [("free_k2_a", staleness(2, "free"), None), ("free_k2_b", staleness(2, "free"), "free_k2_a")]
    for name, overrides, against in arms:
        print(f"replay: {name}", flush=True)
        run_to_end(fresh(out / name, base), overrides, "train")
        if against is not None:
            result = compare(metrics(out / against), metrics(out / name))
            lines.append(line(f"{against} vs {name} (uninterrupted)", result))
            failed |= bool(result[1]) and not name.startswith("free")
            print("  " + lines[-1], flush=True)
    if args.free:
        per_iteration["free k=2"] = [r["timing/total_s"] for r in metrics(out / "free_k2_a")[1:]]
        for name in ("free_k2_a", "free_k2_b"):
            lines.append(f"{name} staleness/mean by iteration: {[r['staleness/mean'] for r in metrics(out / name)]}")

    kinds = [(False, straight)] + ([(True, metrics(out / "k2_partial_a"))] if args.partial else [])
    for partial, uninterrupted in kinds:
        for n, (iteration, phase) in enumerate(MOMENTS[:args.kills]):
            run = fresh(out / f"kill_{'partial_' if partial else ''}{n}", base)
            hit = kill_at(run, staleness(2, partial=partial), iteration, phase)
            run_to_end(run, staleness(2, partial=partial), "resumed")
            result = compare(uninterrupted, metrics(run))
            moment = f"just after checkpoint {iteration + 1}" if phase == "saved" else f"{phase} of iteration {iteration}"
            lines.append(line(f"{'partial: ' if partial else ''}killed at {moment} (hit: {hit})", result))
            failed |= bool(result[1])
            print("  " + lines[-1], flush=True)

    print(f"\nasync replay on the CPU quickstart ({args.iterations} iterations each, {(time.time() - t0) / 60:.0f} min); "
          f"runs in {out}")
    for text in lines:
        print(text)
    for name, seconds in per_iteration.items():
        print(f"{name}: median {sorted(seconds)[len(seconds) // 2]:.2f} s per iteration (iterations 2..)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
