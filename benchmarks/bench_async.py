"""Synchronous colocated vs asynchronous separate training on the CPU quickstart model, side by side.

Arms (each trains from the same warm-started base model, seed and data order):

- ``sync``: colocated, ``trainer.max_staleness: 0``: generate, then train, then sync, in turn;
- ``async``: ``rollout.placement: separate``, ``trainer.max_staleness: 1``: the engine generates
  batch b+1 while the trainer updates on batch b (weights by ``sync_method: broadcast``), under the
  default ``trainer.async_schedule: deterministic`` (batch b+1 by the weights of iteration b: the sync
  after iteration b waits for it);
- ``free``: the same under ``trainer.async_schedule: free`` (batch b+1 by whichever weights the
  engine holds when it starts), to price the deterministic schedule.

In every arm the engine's threads are pinned to one core (``rollout.cpu_cores``) and the trainer
to another (``os.sched_setaffinity`` on the trainer process), so the comparison measures the
overlap, not a change in the cores each side computes on. The timing runs on each ``--configs``
entry: the single-turn quickstart, whose ~9-token answers make generation about a tenth of an
iteration (the overlap can hide no more than that), and its multi-turn TIR variant, where the
episodes (engine turns and sandboxed code) take about as long as the update. Printed: median
seconds per iteration (``timing/total_s``, first iteration excluded: engine warm-up), the
generation share of the synchronous iteration, the async / sync ratio (target: <= 0.7) and the
deterministic / free ratio.

Then, on the first config under staleness 1, each of ``--losses`` (default Token-ALP vs
Token-TIS): the importance-ratio envelope (P98 / P2 of the ratio the loss clips) and the
train-vs-rollout KL (k3 estimate, unperturbed old policy vs the engine that sampled, staleness
included), side by side with their ratios.

    python benchmarks/bench_async.py                       # 10 iterations per arm
    python benchmarks/bench_async.py --iterations 20 --losses alp_token token_tis seq_bypass
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_methods import print_side_by_side, summarize  # noqa: E402  (benchmarks/ is not a package)

ASYNC = ["rollout.placement=separate", "trainer.max_staleness=1"]


def train(config: Path, run_dir: Path, base: Path | None, loss: str, overrides: list[str], args) -> list[dict]:
    cmd = [sys.executable, "-m", "megatron_alp.cli", "train", str(config),
           f"trainer.output_dir={run_dir}", f"trainer.iterations={args.iterations}",
           f"trainer.save_interval={args.iterations}", "trainer.progress_bar=false", "trainer.tensorboard=false",
           "trainer.eval_interval=0", f"loss.name={loss}", "perturbation.enabled=null", "loss.clip_low=null",
           "loss.clip_high=null", f"rollout.cpu_cores=[{args.engine_core}]", *overrides, *args.overrides]
    if base is not None:
        cmd += ["model.tiny=null", f"model.hf_path={base}", "trainer.sft_warmup_steps=0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    print(f"--- {run_dir.name}: {' '.join(cmd[4:])}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, {args.trainer_core}))
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["iteration"] >= 0]  # iteration -1: the base model's validation


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows[1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", type=Path, nargs="+",
                   default=[ROOT / "configs" / "quickstart_cpu.yaml", ROOT / "configs" / "quickstart_tir_cpu.yaml"])
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--losses", nargs="+", default=["alp_token", "token_tis"],
                   help="losses compared under staleness 1 on the first config (the first also runs the timing)")
    cores = sorted(os.sched_getaffinity(0))
    p.add_argument("--trainer-core", type=int, default=cores[0])
    p.add_argument("--engine-core", type=int, default=cores[-1])
    p.add_argument("--out", type=Path, default=None, help="run directories go here (default: a temp dir)")
    p.add_argument("overrides", nargs="*", help="extra KEY=VALUE config overrides for every run")
    args = p.parse_args()
    if args.trainer_core == args.engine_core:
        raise SystemExit("--trainer-core and --engine-core must differ (this machine has one core?)")

    root = args.out or Path(tempfile.mkdtemp(prefix="bench_async_"))
    first = args.losses[0]
    timing, runs = [], {}
    for config in args.configs:
        name = config.stem
        sync = train(config, root / f"{name}_sync", None, first, [], args)
        base = root / f"{name}_sync" / "base_model"
        runs[name] = {first: train(config, root / f"{name}_async_{first}", base, first, ASYNC, args)}
        free = train(config, root / f"{name}_async_free_{first}", base, first, [*ASYNC, "trainer.async_schedule=free"],
                     args)
        if config == args.configs[0]:
            for loss in args.losses[1:]:
                runs[name][loss] = train(config, root / f"{name}_async_{loss}", base, loss, ASYNC, args)
        timing.append((name, sync, runs[name][first], free))

    print(f"\n{args.iterations} iterations per arm ({first}); trainer on core {args.trainer_core}, engine on core "
          f"{args.engine_core}; medians over iterations 2..; runs in {root}")
    print(f"{'config':<22}{'sync s/it':>10}{'generation':>12}{'async s/it':>12}{'staleness':>11}{'async/sync':>12}"
          f"{'free s/it':>11}{'det/free':>10}")
    for name, sync, fast, free in timing:
        s, a, f = median(sync, "timing/total_s"), median(fast, "timing/total_s"), median(free, "timing/total_s")
        share = median(sync, "timing/rollout_s") / s
        print(f"{name:<22}{s:>10.2f}{share:>11.0%}{a:>12.2f}{max(r['staleness/max'] for r in fast):>11.0f}"
              f"{a / s:>11.2f}x{f:>11.2f}{a / f:>9.2f}x")
    print("(target: async <= 0.7x sync; the overlap hides at most the generation share of an iteration. "
          "det/free: what the deterministic schedule costs)")

    name = args.configs[0].stem
    print(f"\n{name} under staleness 1 (over the iterations):")
    print_side_by_side({loss: summarize(rows) for loss, rows in runs[name].items()}, args.losses)
    return 0


if __name__ == "__main__":
    sys.exit(main())
