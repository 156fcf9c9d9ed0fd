"""Training-inference mismatch of two (or more) objectives on the same task, side by side.

Trains the CPU quickstart (or any config) once per ``--methods`` entry from the same
warm-started base model, seed and data order, with the rollout engine in the precision given
by ``--rollout-dtype`` / ``--quantization`` (bf16 or FP8 rollouts against an fp32 trainer), then
prints per method, over the iterations:

- the importance-ratio envelope ``P98 / P2`` of pi_train / pi_rollout on the loss tokens, where
  pi_train is the forward the loss used (perturbed for ALP): its mean and its worst iteration;
- the train-vs-rollout KL (k3 estimate of KL(pi_rollout || pi_train), unperturbed old policy);
- the mean reward of the first and last iterations.

The first method's run creates the warm-started base model; the others start from a copy of it
(``model.hf_path``), so every difference comes from the objective. Ratios are printed against
the first method.

    python benchmarks/compare_methods.py                                   # Token-ALP vs Seq-Bypass, bf16 rollouts
    python benchmarks/compare_methods.py --quantization fp8_per_channel    # FP8 rollouts
    python benchmarks/compare_methods.py --methods alp_seq seq_mis grpo --iterations 20
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_alp.algorithms.policy_loss import POLICY_LOSSES

ROOT = Path(__file__).resolve().parents[1]


def run_method(method: str, run_dir: Path, base: Path | None, args) -> list[dict]:
    overrides = [
        f"trainer.output_dir={run_dir}", f"trainer.iterations={args.iterations}",
        f"trainer.save_interval={args.iterations}", "trainer.progress_bar=false", "trainer.tensorboard=false",
        # the loss declares whether it perturbs and its clip range (megatron_alp/algorithms/policy_loss.py)
        f"loss.name={method}", "perturbation.enabled=null", "loss.clip_low=null", "loss.clip_high=null",
        f"rollout.dtype={args.rollout_dtype}", f"rollout.quantization={args.quantization}",
        *args.overrides,
    ]
    if base is not None:
        overrides += ["model.tiny=null", f"model.hf_path={base}", "trainer.sft_warmup_steps=0"]
    cmd = [sys.executable, "-m", "megatron_alp.cli", "train", str(args.config), *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    print(f"--- {method}: {' '.join(cmd[3:])}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{method} failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["iteration"] >= 0]  # iteration -1: the base model's validation


def summarize(rows: list[dict]) -> dict:
    width = [r["ratio/p98"] / r["ratio/p2"] for r in rows if r.get("ratio/p2", 0) > 0]
    kl = [r["mismatch/kl_k3"] for r in rows if math.isfinite(r.get("mismatch/kl_k3", math.nan))]
    return {
        "envelope P98/P2 (mean)": sum(width) / len(width),
        "envelope P98/P2 (max)": max(width),
        "ratio max (max)": max(r["ratio/max"] for r in rows),
        "KL k3 train-rollout (mean)": sum(kl) / len(kl),
        "KL k3 train-rollout (max)": max(kl),
        "reward first": rows[0]["reward/mean"],
        "reward last": rows[-1]["reward/mean"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart_cpu.yaml")
    p.add_argument("--methods", nargs="+", default=["alp_token", "seq_bypass"], choices=sorted(POLICY_LOSSES),
                   metavar="LOSS", help=f"registered losses: {', '.join(POLICY_LOSSES)}")
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--rollout-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default="none", choices=["none", "fp8", "fp8_per_channel"])
    p.add_argument("--out", type=Path, default=None, help="run directories go here (default: a temp dir)")
    p.add_argument("overrides", nargs="*", help="extra KEY=VALUE config overrides for every run")
    args = p.parse_args()

    root = args.out or Path(tempfile.mkdtemp(prefix="compare_methods_"))
    results, base = {}, None
    for method in args.methods:
        rows = run_method(method, root / method, base, args)
        results[method] = summarize(rows)
        if base is None and (root / method / "base_model" / "config.json").is_file():
            base = root / method / "base_model"

    rollout = args.rollout_dtype + ("" if args.quantization == "none" else f" + {args.quantization}")
    print(f"\nrollouts: {rollout}; {args.iterations} iterations each; runs in {root}")
    print_side_by_side(results, args.methods)
    return 0


def print_side_by_side(results: dict[str, dict], methods: list[str]) -> None:
    """One row per metric of :func:`summarize`, one column per method, then each method's ratio to
    the first."""
    first = methods[0]
    header = f"{'metric':<28}" + "".join(f"{m:>14}" for m in methods)
    header += "".join(f"{m + '/' + first:>22}" for m in methods[1:])
    print(header)
    for key in results[first]:
        line = f"{key:<28}" + "".join(f"{results[m][key]:>14.4g}" for m in methods)
        for m in methods[1:]:
            ref = results[first][key]
            line += f"{(results[m][key] / ref if ref else math.nan):>22.3f}"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
