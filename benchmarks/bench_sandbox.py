"""Latency and throughput of the TIR sandbox, and what its memory cgroup (issue 25) costs.

    python benchmarks/bench_sandbox.py [--executions 64] [--repeats 21] [--rounds 3] [--workers 1 2 4 8]

Runs a trivial snippet through a bare ``python -I`` subprocess (the floor of any
process-per-execution design) and through the sandbox of this checkout with its per-execution
memory cgroup (``cgroup="auto"``) and without it (``cgroup="off"``), measured alternately so that
load on the machine hits both alike. Prints the median latency of each and executions per second
through ``run_many`` at several worker counts, side by side, with the ratio of the two (target: at
least 0.9). Where this machine allows no memory cgroup both columns run without one, and the
start-up line printed first says so. On a busy machine, compare medians over several runs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_alp.config import SandboxConfig  # noqa: E402
from megatron_alp.tir.sandbox import SandboxExecutor  # noqa: E402

SNIPPET = "total = sum(i * i for i in range(1000))\nprint(total)"
MODES = ("off", "auto")  # without, with the memory cgroup


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def check(results) -> None:
    if not all(r.ok and r.text == "332833500\n" for r in results):
        raise SystemExit(f"benchmark executions failed: {[r.text for r in results if not r.ok][:3]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executions", type=int, default=64, help="executions per throughput measurement")
    parser.add_argument("--repeats", type=int, default=21, help="sequential runs per latency measurement")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3, help="alternating throughput rounds per worker count")
    args = parser.parse_args()

    bare_cmd = [sys.executable, "-I", "-c", SNIPPET]
    with SandboxExecutor(SandboxConfig(workers=1), cgroup="off") as off, \
            SandboxExecutor(SandboxConfig(workers=1), cgroup="auto") as on:
        print(f"with the cgroup: {on.startup_line}\nwithout:         {off.startup_line}")
        runners = {"bare": lambda: subprocess.run(bare_cmd, capture_output=True, check=True),
                   "off": lambda: check([off.run(SNIPPET)]), "auto": lambda: check([on.run(SNIPPET)])}
        times = {name: [] for name in runners}
        for fn in runners.values():
            fn()  # warm caches
        for _ in range(args.repeats):  # alternate, so load on the machine hits all alike
            for name, fn in runners.items():
                times[name].append(timed(fn))
    lat = {name: statistics.median(t) for name, t in times.items()}

    print(f"\nlatency, median of {args.repeats} sequential executions of the snippet")
    print(f"{'configuration':<36}{'latency ms':>12}{'over bare ms':>14}")
    for title, name in (("bare python -I subprocess", "bare"), ("sandbox without memory cgroup", "off"),
                        ("sandbox with memory cgroup", "auto")):
        print(f"{title:<36}{lat[name] * 1e3:>12.1f}{(lat[name] - lat['bare']) * 1e3:>14.1f}")
    print(f"memory cgroup cost: {(lat['auto'] - lat['off']) * 1e3:+.1f} ms per execution")

    print(f"\nthroughput: {args.executions} executions of the snippet through run_many, median of "
          f"{args.rounds} alternating rounds (exec/s)")
    print(f"{'workers':>8}{'no cgroup':>11}{'cgroup':>9}{'ratio':>8}")
    for w in args.workers:
        executors = {mode: SandboxExecutor(SandboxConfig(workers=w), cgroup=mode) for mode in MODES}
        rates = {mode: [] for mode in MODES}
        try:
            for ex in executors.values():
                ex.run_many([SNIPPET] * w)
            for _ in range(args.rounds):
                for mode, ex in executors.items():
                    results = []
                    seconds = timed(lambda: results.extend(ex.run_many([SNIPPET] * args.executions)))
                    check(results)
                    rates[mode].append(args.executions / seconds)
        finally:
            for ex in executors.values():
                ex.close()
        off_rate, on_rate = statistics.median(rates["off"]), statistics.median(rates["auto"])
        print(f"{w:>8}{off_rate:>11.1f}{on_rate:>9.1f}{on_rate / off_rate:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
