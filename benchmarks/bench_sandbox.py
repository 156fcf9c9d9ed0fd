"""Sandbox throughput and per-execution overhead, measured side by side in one run.

    python benchmarks/bench_sandbox.py [--executions 64] [--workers 1 2 4 8]

Prints, for a trivial snippet: the latency of a bare ``python -I`` subprocess (the floor any
process-per-execution design pays), of a sandboxed execution with full isolation and with
namespaces off, the overhead of each over the bare process, and executions per second through
``SandboxExecutor.run_many`` at several worker counts.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_alp.config import SandboxConfig  # noqa: E402
from megatron_alp.tir.sandbox import SandboxExecutor  # noqa: E402

SNIPPET = "total = sum(i * i for i in range(1000))\nprint(total)"


def median_latency(fn, repeats: int) -> float:
    fn()  # warm caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executions", type=int, default=64, help="executions per throughput measurement")
    parser.add_argument("--repeats", type=int, default=15, help="sequential runs per latency measurement")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()

    bare = median_latency(lambda: subprocess.run([sys.executable, "-I", "-c", SNIPPET], capture_output=True,
                                                 check=True), args.repeats)
    with SandboxExecutor(SandboxConfig(workers=1)) as full:
        protections = sorted(full.protections)
        full_lat = median_latency(lambda: full.run(SNIPPET), args.repeats)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with SandboxExecutor(SandboxConfig(workers=1), isolation="none") as basic:
            basic_lat = median_latency(lambda: basic.run(SNIPPET), args.repeats)

    print(f"protections (auto): {', '.join(protections)}")
    print(f"{'configuration':<34}{'latency ms':>12}{'overhead ms':>13}{'x bare':>8}")
    for name, lat in (("bare python -I subprocess", bare), ("sandbox, isolation=none", basic_lat),
                      ("sandbox, isolation=auto", full_lat)):
        print(f"{name:<34}{lat * 1e3:>12.1f}{(lat - bare) * 1e3:>13.1f}{lat / bare:>8.2f}")

    print(f"\nthroughput, {args.executions} executions of the snippet (isolation=auto)")
    print(f"{'workers':>8}{'exec/s':>10}{'speedup':>9}")
    base_rate = None
    for w in args.workers:
        with SandboxExecutor(SandboxConfig(workers=w)) as ex:
            ex.run_many([SNIPPET] * w)
            t0 = time.perf_counter()
            results = ex.run_many([SNIPPET] * args.executions)
            rate = args.executions / (time.perf_counter() - t0)
        if not all(r.ok and r.text == "332833500\n" for r in results):
            raise SystemExit(f"benchmark executions failed: {[r.text for r in results if not r.ok][:3]}")
        base_rate = base_rate or rate
        print(f"{w:>8}{rate:>10.1f}{rate / base_rate:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
