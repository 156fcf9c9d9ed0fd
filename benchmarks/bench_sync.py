"""Full vs delta weight sync on real training, side by side in one run.

Two ``megatron-alp train`` runs of the same config from the same warm-started base model and seed,
one iteration's sync after each update: ``full`` (every sync sends the whole model) and ``delta``
(``rollout.sync_delta=true``: only the elements whose bits changed travel from the trainer ranks to
the replica leaders, which rebuild the changed tensors and hand them to the engine; a full sync every
``--anchor`` syncs). Per iteration, from each run's ``metrics.jsonl``:

- ``changed``: ``sync/changed_frac``, the share of the model's elements that changed since the last
  sync (in the engine's dtype where it only casts: bf16 for the quickstart);
- ``payload MiB``: what reached the replica leader from the trainer ranks (``sync/delta_bytes``; for
  the full run the whole model, ``sync/bytes``);
- ``engine MiB``: what the leader handed to the engine (``sync/bytes``: the tensors that changed);
- ``sync s``: ``sync/seconds``, and ``encode s``: ``sync/delta_s``.

It also checks that the two runs trained alike: every metric that does not measure time, memory or
the sync itself is equal iteration by iteration (the engine generated from the same weights; the
verification probe of ``rollout.verify_sync`` compares engine and trainer after every sync). That
the engine's weights after N delta syncs equal a full sync's bit for bit, also after an engine
restart and a fresh process, is tests/test_delta_sync.py.

    python benchmarks/bench_sync.py                                    # quickstart, 20 iterations
    python benchmarks/bench_sync.py --iterations 3 --out /tmp/bs       # a smoke test (about 4 minutes)
    python benchmarks/bench_sync.py model.tiny_overrides.hidden_size=768 ...   # a larger model
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_run import train  # noqa: E402  (benchmarks/ is not a package)

MIB = 2**20
COMMON = ["trainer.eval_interval=0", "trainer.validate_base=false",
          "trainer.progress_bar=false", "rollout.verify_sync=true"]
RUNS = {"full": ["rollout.sync_delta=false"], "delta": ["rollout.sync_delta=true"]}
# what the two runs may differ in: clocks, memory, the sync's own accounting
MEASURED = ("timing/", "memory/", "throughput/", "sync/", "phase/", "time", "rollout/replica_tokens_per_s",
            "rollout/straggler_ratio")


def records(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("iteration", -1) >= 0]


def differences(full: list[dict], delta: list[dict]) -> list[str]:
    """Each training metric that differs between the runs, as ``iteration key: full vs delta``."""
    out = []
    for a, b in zip(full, delta):
        for key in sorted(set(a) | set(b)):
            if not key.startswith(MEASURED) and a.get(key) != b.get(key):
                out.append(f"{a['iteration']} {key}: {a.get(key)} vs {b.get(key)}")
    return out


def table(full: list[dict], delta: list[dict]) -> str:
    head = f"{'iter':>4} {'changed':>9} {'full MiB':>9} {'payload MiB':>12} {'engine MiB':>11} {'ratio':>7} " \
           f"{'full s':>7} {'delta s':>8} {'encode s':>9} anchor"
    lines = [head]
    for a, b in zip(full, delta):
        payload = b.get("sync/delta_bytes", b["sync/bytes"])
        lines.append(f"{a['iteration']:>4} {b.get('sync/changed_frac', float('nan')):>9.4f} {a['sync/bytes'] / MIB:>9.2f} "
                     f"{payload / MIB:>12.3f} {b['sync/bytes'] / MIB:>11.2f} {a['sync/bytes'] / max(payload, 1):>6.1f}x "
                     f"{a['sync/seconds']:>7.3f} {b['sync/seconds']:>8.3f} {b.get('sync/delta_s', 0.0):>9.3f} "
                     f"{int(b.get('sync/anchor', 1))}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart_cpu.yaml")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--anchor", type=int, default=20, help="rollout.sync_delta_anchor of the delta run")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_sync")
    p.add_argument("overrides", nargs="*", help="extra KEY=VALUE config overrides for both runs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    if any((out / name).exists() for name in RUNS):
        raise SystemExit(f"bench_sync: {out} already holds runs: choose another --out")
    overrides = [*COMMON, f"trainer.iterations={args.iterations}", f"trainer.save_interval={args.iterations}",
                 f"rollout.sync_delta_anchor={args.anchor}",
                 *args.overrides]
    for name, extra in RUNS.items():
        run_dir = out / name
        run_dir.mkdir(parents=True)
        if name != "full":  # the same warm-started base model, made once
            shutil.copytree(out / "full" / "base_model", run_dir / "base_model")
        print(f"{name}: training {args.iterations} iterations ...", flush=True)
        print(f"{name}: done in {train(args.config, run_dir, overrides + extra):.0f} s", flush=True)
    full, delta = records(out / "full"), records(out / "delta")
    diff = differences(full, delta)
    results = {"config": str(args.config), "overrides": overrides, "full": full, "delta": delta, "differences": diff}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + table(full, delta) + "\n")
    print("the runs trained alike: every training metric equal" if not diff else
          f"the runs differ in {len(diff)} training metrics, e.g. " + "; ".join(diff[:3]))
    print(f"wrote {out / 'results.json'}; runs in {out}/{{full,delta}}")
    return 0 if not diff else 1


if __name__ == "__main__":
    sys.exit(main())
