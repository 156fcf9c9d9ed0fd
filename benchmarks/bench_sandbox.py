"""Latency and throughput of the TIR sandbox, and what its hardening (issue 12) costs.

    python benchmarks/bench_sandbox.py [--executions 64] [--repeats 21] [--rounds 3]
                                       [--workers 1 2 4 8] [--baseline auto|REF|none]

Runs a trivial snippet through a bare ``python -I`` subprocess (the floor of any
process-per-execution design), through the sandbox of this checkout and through the previous,
single-module sandbox (``megatron_alp/tir/sandbox/`` as of git revision REF; ``auto``: the last
revision that had it), measured alternately so that load on the machine hits both alike. Prints
the median latency of each, the hardening's cost per execution (target: at most +15 ms), and
executions per second through ``run_many`` at several worker counts with the ratio of the two
(target: at least 0.9). On a busy machine, compare medians over several runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_alp.config import SandboxConfig  # noqa: E402
from megatron_alp.tir.sandbox import SandboxExecutor  # noqa: E402

SNIPPET = "total = sum(i * i for i in range(1000))\nprint(total)"
OLD_PATH = "megatron_alp/tir/sandbox/"


def load_baseline(ref: str, workdir: str):
    """The previous sandbox module from git, or None (with the reason printed)."""
    if ref == "none":
        return None, "not requested"
    git = ["git", "-C", str(ROOT)]
    if ref == "auto":
        last = subprocess.run([*git, "rev-list", "-n", "1", "HEAD", "--", OLD_PATH], capture_output=True, text=True)
        if not last.stdout.strip():
            return None, f"no revision has {OLD_PATH}"
        candidates = [last.stdout.strip(), last.stdout.strip() + "^"]  # the last change may be its removal
    else:
        candidates = [ref]
    for rev in candidates:
        shown = subprocess.run([*git, "show", f"{rev}:{OLD_PATH}"], capture_output=True)
        if shown.returncode == 0:
            path = Path(workdir) / "previous_sandbox.py"
            path.write_bytes(shown.stdout)
            spec = importlib.util.spec_from_file_location("previous_sandbox", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            label = subprocess.run([*git, "rev-parse", "--short", rev], capture_output=True, text=True).stdout
            return module, label.strip()
    return None, f"{OLD_PATH} not found at {ref}"


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
    parser.add_argument("--baseline", default="auto", help="git revision of the previous sandbox, auto or none")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as workdir:
        previous, label = load_baseline(args.baseline, workdir)
        cfg = SandboxConfig(workers=1)
        bare_cmd = [sys.executable, "-I", "-c", SNIPPET]
        with SandboxExecutor(cfg) as new:
            old = previous.SandboxExecutor(cfg) if previous else None
            try:
                runners = {"bare": lambda: subprocess.run(bare_cmd, capture_output=True, check=True),
                           "hardened": lambda: check([new.run(SNIPPET)])}
                if old:
                    runners["previous"] = lambda: check([old.run(SNIPPET)])
                times = {name: [] for name in runners}
                for name, fn in runners.items():
                    fn()  # warm caches
                for _ in range(args.repeats):  # alternate, so load on the machine hits all alike
                    for name, fn in runners.items():
                        times[name].append(timed(fn))
            finally:
                if old:
                    old.close()
            protections = sorted(new.protections)
        lat = {name: statistics.median(t) for name, t in times.items()}

        print(f"protections: {', '.join(protections)}")
        print(f"\nlatency, median of {args.repeats} sequential executions of the snippet")
        print(f"{'configuration':<36}{'latency ms':>12}{'over bare ms':>14}")
        rows = [("bare python -I subprocess", "bare"), (f"previous sandbox ({label})", "previous"),
                ("hardened sandbox", "hardened")]
        for title, name in rows:
            if name in lat:
                print(f"{title:<36}{lat[name] * 1e3:>12.1f}{(lat[name] - lat['bare']) * 1e3:>14.1f}")
        if "previous" in lat:
            print(f"hardening cost: {(lat['hardened'] - lat['previous']) * 1e3:+.1f} ms per execution "
                  "(target: at most +15 ms)")
        else:
            print(f"no previous sandbox to compare with: {label}")

        print(f"\nthroughput: {args.executions} executions of the snippet through run_many, median of "
              f"{args.rounds} alternating rounds (exec/s)")
        print(f"{'workers':>8}{'previous':>10}{'hardened':>10}{'ratio':>8}")
        for w in args.workers:
            wcfg = SandboxConfig(workers=w)
            executors = {"hardened": SandboxExecutor(wcfg)}
            if previous:
                executors["previous"] = previous.SandboxExecutor(wcfg)
            rates = {name: [] for name in executors}
            try:
                for ex in executors.values():
                    ex.run_many([SNIPPET] * w)
                for _ in range(args.rounds):
                    for name, ex in executors.items():
                        results = []
                        seconds = timed(lambda: results.extend(ex.run_many([SNIPPET] * args.executions)))
                        check(results)
                        rates[name].append(args.executions / seconds)
            finally:
                for ex in executors.values():
                    ex.close()
            new_rate = statistics.median(rates["hardened"])
            old_rate = statistics.median(rates["previous"]) if previous else float("nan")
            print(f"{w:>8}{old_rate:>10.1f}{new_rate:>10.1f}{new_rate / old_rate:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
