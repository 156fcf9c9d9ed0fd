"""Synchronous colocated vs asynchronous separate training on the CPU quickstart, side by side.

Arms (each trains the quickstart model from the same warm-started base, seed and data order):

- ``sync``: colocated, ``trainer.max_staleness: 0``: generate, then train, then sync, in turn;
- ``async``: ``rollout.placement: separate``, ``trainer.max_staleness: 1``: the engine generates
  batch b+1 while the trainer updates on batch b;
- ``async_tis`` (with ``--losses``): the same schedule with another loss (default Token-TIS).

In every arm the engine's threads are pinned to one core (``rollout.cpu_cores``) and the trainer
to another (``os.sched_setaffinity`` on the trainer process), so the comparison measures the
overlap, not a change in the cores each side computes on. Printed: median seconds per iteration
(``timing/total_s``, first iteration excluded: engine warm-up) and their ratio (target: async <=
0.7x sync), staleness, then for each loss under staleness 1 the importance-ratio envelope (P98 /
P2 of the ratio the loss clips) and the train-vs-rollout KL (k3 estimate, unperturbed old policy vs
the engine that sampled, staleness included), side by side with their ratios.

    python benchmarks/bench_async.py                       # 10 iterations per arm, Token-ALP vs Token-TIS
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


def train(run_dir: Path, base: Path | None, loss: str, overrides: list[str], args) -> list[dict]:
    cmd = [sys.executable, "-m", "megatron_alp.cli", "train", str(args.config),
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
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart_cpu.yaml")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--losses", nargs="+", default=["alp_token", "token_tis"],
                   help="losses compared under staleness 1 (the first also runs the sync arm)")
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
    sync = train(root / "sync", None, first, [], args)
    base = root / "sync" / "base_model"
    runs = {f"async:{loss}": train(root / f"async_{loss}", base, loss,
                                   ["rollout.placement=separate", "trainer.max_staleness=1"], args)
            for loss in args.losses}

    def per_iteration(rows):
        return statistics.median(r["timing/total_s"] for r in rows[1:])

    print(f"\n{args.iterations} iterations per arm; trainer on core {args.trainer_core}, engine on core "
          f"{args.engine_core}; runs in {root}")
    s, a = per_iteration(sync), per_iteration(runs[f"async:{first}"])
    print(f"{'arm':<22}{'s/iteration':>12}{'staleness max':>15}{'rollout wait s':>16}")
    for name, rows in {"sync (colocated)": sync, **runs}.items():
        wait = statistics.median(r.get("timing/rollout_wait_s", r["timing/rollout_s"]) for r in rows[1:])
        print(f"{name:<22}{per_iteration(rows):>12.2f}{max(r['staleness/max'] for r in rows):>15.0f}{wait:>16.2f}")
    print(f"async / sync seconds per iteration ({first}): {a / s:.2f}x (target <= 0.7)")

    print("\nunder staleness 1 (over the iterations):")
    print_side_by_side({loss: summarize(runs[f"async:{loss}"]) for loss in args.losses}, args.losses)
    return 0


if __name__ == "__main__":
    sys.exit(main())
