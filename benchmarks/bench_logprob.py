"""Fused vocab-parallel token logprobs vs the naive ``log_softmax(full logits)`` path.

Measures forward + backward (logprobs and, by default, entropy of the sampled tokens, as the
policy update needs them) on one rank at a realistic vocabulary (Qwen2.5: 151,936) and prints
time and peak-memory ratios side by side.

Peak memory is what the computation adds on top of the input logits: on the CPU each path runs
in its own subprocess and reports its peak RSS (``ru_maxrss``) minus the RSS right after the
logits were allocated; on CUDA ``max_memory_allocated`` minus the allocation before the call.
Both include the logits gradient (same size and dtype as the logits) that every path returns.
Times are the best of ``--reps`` rounds in which the two paths alternate. On a CPU shared with
other work, pass ``--threads 1``: the fused path runs many small cache-sized OpenMP regions, and
a thread descheduled by a competing process stalls each of them, which inflates its time far more
than the naive path's few large kernels.

    python benchmarks/bench_logprob.py                      # CPU, 2048 tokens, bf16 logits
    python benchmarks/bench_logprob.py --threads 1          # stable timings on a busy CPU
    python benchmarks/bench_logprob.py --device cuda --tokens 8192
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_alp.logprobs import reference_token_logprobs, token_logprobs  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _make_inputs(args, device):
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.empty(1, args.tokens, args.vocab, dtype=DTYPES[args.dtype], device=device)
    for s in range(0, args.tokens, 256):  # no transient full-size fp32 copy
        logits[:, s:s + 256].normal_(0.0, 3.0, generator=g)
    targets = torch.randint(0, args.vocab, (1, args.tokens), generator=g, device=device)
    return logits.requires_grad_(), targets


def _step(path: str, logits, targets, args) -> None:
    if path == "fused":
        lp, ent = token_logprobs(logits, targets, temperature=args.temperature, with_entropy=args.entropy)
    else:
        lp, ent = reference_token_logprobs(logits, targets, args.temperature, with_entropy=args.entropy)
    loss = lp.sum() + (ent.sum() if ent is not None else 0.0)
    loss.backward()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_memory(path: str, args) -> dict:
    """Peak memory one forward + backward of ``path`` adds on top of the input logits."""
    device = torch.device(args.device)
    logits, targets = _make_inputs(args, device)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_bytes()
    _step(path, logits, targets, args)
    _sync(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"peak_extra_bytes": peak, "logits_bytes": logits.numel() * logits.element_size()}


def timings(args) -> dict[str, float]:
    """Best forward + backward time of each path, the paths interleaved round by round so that
    load from other processes hits both alike."""
    device = torch.device(args.device)
    logits, targets = _make_inputs(args, device)
    best = {"naive": float("inf"), "fused": float("inf")}
    for _ in range(args.reps + 1):  # the first round warms up
        for path in best:
            logits.grad = None
            _sync(device)
            t0 = time.perf_counter()
            _step(path, logits, targets, args)
            _sync(device)
            best[path] = min(best[path], time.perf_counter() - t0)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=2048, help="tokens in the micro-batch (b * s)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of the input logits")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--no-entropy", dest="entropy", action="store_false", help="logprobs only")
    p.add_argument("--reps", type=int, default=5, help="timed rounds per path (after one warm-up round)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--worker", choices=["fused", "naive"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if args.worker:
        print(json.dumps(peak_memory(args.worker, args)))
        return 0

    results = {}
    for path in ("naive", "fused"):
        if args.device == "cpu":  # own process: ru_maxrss is a per-process high-water mark
            cmd = [sys.executable, __file__, "--worker", path] + sys.argv[1:]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[path] = json.loads(out.strip().splitlines()[-1])
        else:
            results[path] = peak_memory(path, args)
            torch.cuda.empty_cache()
        results[path]["path"] = path
    for path, t in timings(args).items():
        results[path]["time_s"] = t
    naive, fused = results["naive"], results["fused"]
    gib = 1024 ** 3
    print(f"device={args.device} tokens={args.tokens} vocab={args.vocab} logits={args.dtype} "
          f"entropy={args.entropy} threads={torch.get_num_threads()} "
          f"(input logits {naive['logits_bytes'] / gib:.2f} GiB, not counted)")
    print(f"{'path':<8}{'fwd+bwd s':>12}{'peak extra GiB':>16}")
    for r in (naive, fused):
        print(f"{r['path']:<8}{r['time_s']:>12.3f}{r['peak_extra_bytes'] / gib:>16.3f}")
    print(f"memory ratio naive/fused: {naive['peak_extra_bytes'] / max(fused['peak_extra_bytes'], 1):.2f}x  "
          f"(target >= 4)")
    print(f"time ratio fused/naive:   {fused['time_s'] / naive['time_s']:.2f}x  (target <= 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
