"""The paper's Figure 3 (middle/right) on the CPU quickstart model, in one command.

1. Train the quickstart for ``--iterations`` (10) with FP8 (per-channel) rollouts and
   ``perturbation.init_std: auto`` (skipped when the checkpoint exists): a training checkpoint with
   its Adam state and a sigma calibrated to the FP8 mismatch.
2. From that checkpoint, ``megatron-alp intervene`` with the checkpoint's optimizer state, the same
   FP8 engine and ``--seeds`` (5) batches, for each comparison (``alp_seq:seq_bypass``,
   ``alp_token:alp_token@0``) at each learning rate (1e-4, the config's, and 1e-3): the log-ratio
   envelope after one update with and without the noise, side by side.

Prints each comparison's table (docs/mismatch.md explains them; the verdict line says in how many
probability bins the noisy arm's envelope is the narrower).

    python benchmarks/figure3.py [--run-dir runs/figure3] [--seeds 5] [--lrs 1e-4 1e-3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart_cpu.yaml"
ENGINE = ["rollout.quantization=fp8_per_channel"]


def cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "megatron_alp.cli", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"megatron-alp {args[0]} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", default="runs/figure3")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--lrs", nargs="+", default=["1e-4", "1e-3"])
    parser.add_argument("--compare", nargs="+", default=["alp_seq:seq_bypass", "alp_token:alp_token@0"])
    args = parser.parse_args()
    run = Path(args.run_dir).absolute()
    ckpt = run / "checkpoints" / f"iter_{args.iterations:07d}"
    if not ckpt.is_dir():
        print(f"training the checkpoint: {args.iterations} iterations, FP8 rollouts, init_std auto -> {ckpt}", flush=True)
        cli("train", str(CONFIG), f"trainer.output_dir={run}", *ENGINE, "perturbation.init_std=auto",
            f"trainer.iterations={args.iterations}", f"trainer.save_interval={args.iterations}",
            "trainer.eval_interval=0", "trainer.progress_bar=false")
    for lr in args.lrs:
        for compare in args.compare:
            out = run / "intervene" / f"lr{lr}_{compare.replace(':', '_vs_')}"
            print(f"\n=== {compare}, optimizer.lr {lr}", flush=True)
            printed = cli("intervene", str(CONFIG), f"trainer.output_dir={run}", *ENGINE, f"optimizer.lr={lr}",
                          f"optimizer.min_lr={lr}", "--checkpoint", str(ckpt), "--compare", compare,
                          "--seeds", str(args.seeds), "--out", str(out))
            print("\n".join(line for line in printed.splitlines() if not line.startswith("megatron-alp intervene:")),
                  flush=True)


if __name__ == "__main__":
    main()
