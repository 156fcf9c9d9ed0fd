"""Latency and throughput of the TIR sandbox: what its memory cgroup costs (issue 25) and, with
``--baseline REF``, this checkout against an earlier commit (issue 38: at most 10% slower).

    python benchmarks/bench_sandbox.py [--executions 64] [--repeats 21] [--rounds 3] [--workers 1 2 4 8]
                                       [--baseline REF]

Runs a trivial snippet through a bare ``python -I`` subprocess (the floor of any
process-per-execution design) and through the sandbox of this checkout with its per-execution
memory cgroup (``cgroup="auto"``) and without it (``cgroup="off"``); with ``--baseline`` also
through the sandbox of commit REF (default settings, its own checkout in a temporary git worktree,
driven in a child process that times its own executions). All are measured alternately so that
load on the machine hits them alike. Prints the median latency of each and executions per second
through ``run_many`` at several worker counts, side by side, with the ratios (target: at least
0.9). Where this machine allows no memory cgroup both local columns run without one, and the
start-up lines printed first say so. On a busy machine, compare medians over several runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# --serve DIR: the baseline's child process, which imports the sandbox of the checkout in DIR
SERVING = "--serve" in sys.argv
ROOT = Path(sys.argv[sys.argv.index("--serve") + 1]) if SERVING else Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_alp.config import SandboxConfig  # noqa: E402
from megatron_alp.tir.sandbox import SandboxExecutor  # noqa: E402

SNIPPET = "total = sum(i * i for i in range(1000))\nprint(total)"
MODES = ("off", "auto")  # this checkout without, with the memory cgroup


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def check(results) -> None:
    if not all(r.ok and r.text == "332833500\n" for r in results):
        raise SystemExit(f"benchmark executions failed: {[r.text for r in results if not r.ok][:3]}")


def executor(mode: str, workers: int) -> SandboxExecutor:
    if mode == "off":
        return SandboxExecutor(SandboxConfig(workers=workers, allow_no_memory_cgroup=True), cgroup="off")
    return SandboxExecutor(SandboxConfig(workers=workers))


def serve() -> int:
    """The baseline's side: one JSON request per line (``{"workers": w, "n": n}``), answered with the
    seconds ``n`` executions took through an executor of ``w`` workers (one run when ``n`` is 1)."""
    executors: dict[int, SandboxExecutor] = {}
    print(json.dumps({"startup": executor("auto", 1).startup_line}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        w, n = request["workers"], request["n"]
        if w not in executors:
            executors[w] = executor("auto", w)
            executors[w].run_many([SNIPPET] * w)
        ex, results = executors[w], []
        seconds = timed(lambda: results.extend(ex.run_many([SNIPPET] * n) if n > 1 else [ex.run(SNIPPET)]))
        check(results)
        print(json.dumps({"seconds": seconds}), flush=True)
    for ex in executors.values():
        ex.close()
    return 0


class Baseline:
    """The sandbox of an earlier commit, in a child process of its own checkout."""

    def __init__(self, ref: str):
        self.dir = tempfile.mkdtemp(prefix="bench-sandbox-baseline-")
        here = Path(__file__).resolve().parents[1]
        subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", self.dir, ref], check=True,
                       capture_output=True)
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", self.dir], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=self.dir)
        self.startup_line = json.loads(self.proc.stdout.readline())["startup"]

    def seconds(self, workers: int, n: int) -> float:
        self.proc.stdin.write(json.dumps({"workers": workers, "n": n}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        subprocess.run(["git", "worktree", "remove", "--force", self.dir], cwd=Path(__file__).resolve().parents[1],
                       capture_output=True)


def main() -> int:
    if SERVING:
        return serve()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executions", type=int, default=64, help="executions per throughput measurement")
    parser.add_argument("--repeats", type=int, default=21, help="sequential runs per latency measurement")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3, help="alternating throughput rounds per worker count")
    parser.add_argument("--baseline", metavar="REF", help="also measure the sandbox of this git commit")
    args = parser.parse_args()

    baseline = Baseline(args.baseline) if args.baseline else None
    bare_cmd = [sys.executable, "-I", "-c", SNIPPET]
    try:
        with executor("off", 1) as off, executor("auto", 1) as on:
            print(f"with the cgroup: {on.startup_line}\nwithout:         {off.startup_line}")
            runners = {"bare": lambda: timed(lambda: subprocess.run(bare_cmd, capture_output=True, check=True)),
                       "off": lambda: timed(lambda: check([off.run(SNIPPET)])),
                       "auto": lambda: timed(lambda: check([on.run(SNIPPET)]))}
            if baseline is not None:
                print(f"baseline {args.baseline}: {baseline.startup_line}")
                runners["baseline"] = lambda: baseline.seconds(1, 1)
            times = {name: [] for name in runners}
            for fn in runners.values():
                fn()  # warm caches
            for _ in range(args.repeats):  # alternate, so load on the machine hits all alike
                for name, fn in runners.items():
                    times[name].append(fn())
        lat = {name: statistics.median(t) for name, t in times.items()}

        print(f"\nlatency, median of {args.repeats} sequential executions of the snippet")
        print(f"{'configuration':<36}{'latency ms':>12}{'over bare ms':>14}")
        rows = [("bare python -I subprocess", "bare"), ("sandbox without memory cgroup", "off"),
                ("sandbox with memory cgroup", "auto")] + ([(f"baseline {args.baseline}", "baseline")] if baseline else [])
        for title, name in rows:
            print(f"{title:<36}{lat[name] * 1e3:>12.1f}{(lat[name] - lat['bare']) * 1e3:>14.1f}")
        print(f"memory cgroup cost: {(lat['auto'] - lat['off']) * 1e3:+.1f} ms per execution")
        if baseline is not None:
            print(f"this checkout against the baseline: {(lat['auto'] - lat['baseline']) * 1e3:+.1f} ms per execution")

        print(f"\nthroughput: {args.executions} executions of the snippet through run_many, median of "
              f"{args.rounds} alternating rounds (exec/s)")
        print(f"{'workers':>8}{'no cgroup':>11}{'cgroup':>9}{'ratio':>8}" + (f"{'baseline':>10}{'ratio':>8}" if baseline else ""))
        for w in args.workers:
            executors = {mode: executor(mode, w) for mode in MODES}
            rates = {name: [] for name in (*MODES, "baseline")}
            try:
                for ex in executors.values():
                    ex.run_many([SNIPPET] * w)
                for _ in range(args.rounds):
                    for mode, ex in executors.items():
                        results = []
                        seconds = timed(lambda: results.extend(ex.run_many([SNIPPET] * args.executions)))
                        check(results)
                        rates[mode].append(args.executions / seconds)
                    if baseline is not None:
                        rates["baseline"].append(args.executions / baseline.seconds(w, args.executions))
            finally:
                for ex in executors.values():
                    ex.close()
            med = {name: statistics.median(r) for name, r in rates.items() if r}
            line = f"{w:>8}{med['off']:>11.1f}{med['auto']:>9.1f}{med['auto'] / med['off']:>8.2f}"
            if baseline is not None:
                line += f"{med['baseline']:>10.1f}{med['auto'] / med['baseline']:>8.2f}"
            print(line)
    finally:
        if baseline is not None:
            baseline.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
