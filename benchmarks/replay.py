"""Does a change keep behaviour? The seeded quickstart variants at two revisions, compared number
for number.

Runs, from a checkout of ``--base`` (a git revision, in a temporary worktree) and from this working
tree, the same short seeded runs: the CPU quickstart synchronous and asynchronous, its TIR variant
synchronous and asynchronous, two data-parallel ranks with dynamic sampling and Seq-MIS, and the
``mismatch``, ``intervene`` and ``eval`` commands on the synchronous run's model and checkpoint.
Then every metric of every iteration (``metrics.jsonl``) and every number of the commands' JSON
reports is compared; timings, throughputs and memory are left out. A structural change prints
IDENTICAL for every row.

    python benchmarks/replay.py --base HEAD~1            # about 25 minutes on 2 cores
    python benchmarks/replay.py --base main --only sync async
    python benchmarks/replay.py --base HEAD~1 --keep       # prints where the runs are kept
    python benchmarks/replay.py --base-runs RUNS/runs-base # the base's kept runs again, without rerunning it

The numbers hold per machine (vLLM's CPU kernels and thread counts differ between machines), so
compare two revisions on one machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = ("timing/", "throughput/", "memory/", "offload/", "reload/", "sync/seconds", "sync/gbps", "sync/wait_s",
        "rollout/replica_tokens_per_s", "rollout/straggler_ratio", "generation_s", "tokens_per_s")
QS, TIR = "configs/quickstart_cpu.yaml", "configs/quickstart_tir_cpu.yaml"
ASYNC = ["rollout.placement=separate", "trainer.max_staleness=1"]
RUNS = {
    "sync": ["train", QS, "trainer.iterations=4", "trainer.eval_interval=2", "trainer.save_interval=2"],
    "async": ["train", QS, "trainer.iterations=4", "trainer.eval_interval=2", "trainer.save_interval=2", *ASYNC],
    "tir": ["train", TIR, "trainer.iterations=3", "trainer.sft_warmup_steps=60"],
    "tir_async": ["train", TIR, "trainer.iterations=3", "trainer.sft_warmup_steps=60", *ASYNC],
    "dp2": ["torchrun", "train", QS, "trainer.iterations=3", "trainer.sft_warmup_steps=40", "trainer.dynamic_sampling=true",
            "loss.name=seq_mis", "perturbation.enabled=null"],
}
# commands on the synchronous run: (argv after the config, the report they write under OUT)
COMMANDS = {
    "mismatch": (["mismatch", QS, "--prompts", "8", "perturbation.init_std=auto", "--out", "{out}"], "mismatch.json"),
    "intervene": (["intervene", QS, "--checkpoint", "{sync}/checkpoints/iter_0000004", "--prompts", "8", "--out", "{out}"],
                  "intervene.json"),
    "eval": (["eval", QS, "--limit", "10", "--out", "{out}/eval.json"], "eval.json"),
}


def _skip(key: str) -> bool:
    return any(s in key for s in SKIP)


def differences(a, b, path: str = "") -> list[str]:
    """Where two JSON values differ, timings aside; run-directory paths are not compared."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if _skip(k):
                continue
            if k not in a or k not in b:
                out.append(f"{path}{k}: only in {'base' if k in a else 'change'}")
            else:
                out += differences(a[k], b[k], f"{path}{k}.")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} entries"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}{i}.")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    if isinstance(a, str) and isinstance(b, str) and ("replay-" in a or "replay-" in b):
        return []
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def run_all(tree: Path, out: Path, only: list[str], log) -> None:
    python = sys.executable
    env = {**os.environ, "PYTHONPATH": str(tree)}
    for name, argv in RUNS.items():
        if name not in only:
            continue
        launcher = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2"] if argv[0] == "torchrun" else [python]
        args = argv[1:] if argv[0] == "torchrun" else argv
        cmd = [*launcher, "-m", "megatron_alp.cli", *args, f"trainer.output_dir={out / name}"]
        log(f"  {tree.name}: {name}")
        subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    for name, (argv, _) in COMMANDS.items():
        if name not in only:
            continue
        args = [a.format(out=out / name, sync=out / "sync") for a in argv]
        log(f"  {tree.name}: {name}")
        subprocess.run([python, "-m", "megatron_alp.cli", *args, f"trainer.output_dir={out / 'sync'}"], cwd=tree,
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def compare(base: Path, change: Path, only: list[str]) -> int:
    failed = 0
    for name in only:
        if name in RUNS:
            a, b = ([json.loads(line) for line in (d / name / "metrics.jsonl").read_text().splitlines()]
                    for d in (base, change))
            what = f"{len(a)} iterations x {len(a[0])} metrics"
        else:
            report = COMMANDS[name][1]
            a, b = (json.loads((d / name / report).read_text()) for d in (base, change))
            what = report
        diff = differences(a, b)
        failed += bool(diff)
        print(f"{name:10s} {what:32s} {'IDENTICAL' if not diff else 'DIFFERENT'}")
        for line in diff[:10]:
            print(f"    {line}")
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--base", help="git revision to compare this working tree with")
    which.add_argument("--base-runs", metavar="DIR", type=Path,
                       help="the runs-base folder an earlier --keep left: compare with those runs instead")
    parser.add_argument("--only", nargs="+", choices=[*RUNS, *COMMANDS], help="a subset (intervene and mismatch "
                        "and eval need sync)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders (printed)")
    args = parser.parse_args()
    only = args.only or [*RUNS, *COMMANDS]
    if {"mismatch", "intervene", "eval"} & set(only):
        only = list(dict.fromkeys(["sync", *only]))
    work = Path(tempfile.mkdtemp(prefix="replay-"))
    base_tree, base_runs = work / "base", args.base_runs or work / "runs-base"
    missing = [name for name in only if args.base_runs and not (base_runs / name).is_dir()]
    if missing:
        parser.error(f"--base-runs {base_runs}: no runs of {', '.join(missing)} there")
    try:
        if args.base:
            subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), args.base], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            run_all(base_tree, base_runs, only, print)
        run_all(ROOT, work / "runs-change", only, print)
        failed = compare(base_runs, work / "runs-change", only)
    finally:
        if args.base:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
        if args.keep:
            print(f"runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("behaviour replays" if not failed else f"{failed} of {len(only)} differ")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
