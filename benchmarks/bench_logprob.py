"""The output layer + sampled-token logprobs + entropy, three ways, on one rank at a realistic
vocabulary (Qwen2.5: 151,936), forward and backward, side by side:

- ``naive``: ``F.linear`` makes the logits, fp32 ``log_softmax`` of all of them;
- ``fused``: ``F.linear`` makes the logits, :func:`token_logprobs` walks them chunk by chunk
  (the logits and their gradient are the only full-size tensors);
- ``linear``: :func:`linear_token_logprobs` from the hidden states and the weight, tile by tile:
  no ``[tokens, vocab]`` tensor at all; its backward recomputes each chunk's logits.

Every path starts from the same hidden states ``[tokens, hidden]`` and weight ``[vocab, hidden]``
and returns both gradients. Peak memory is what a path adds on top of those inputs: on the CPU each
path runs in its own subprocess and reports its peak RSS (``ru_maxrss``) minus the RSS after the
inputs were allocated; on CUDA ``max_memory_allocated`` minus the allocation before the call. The
weight gradient (the size of the weight) is in every path's peak; it is also printed without it.
Times are the best of ``--reps`` rounds in which the paths alternate; differences are the largest
absolute differences of logprobs, entropy and both gradients from the naive path. On a CPU shared
with other work, pass ``--threads 1``. Targets: ``linear`` peak extra memory <= 0.25x ``fused``'s,
at equal or better time.

    python benchmarks/bench_logprob.py --threads 1          # CPU, 2048 tokens, bf16
    python benchmarks/bench_logprob.py --device cuda --tokens 16384 --hidden 4096
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

from megatron_alp.training.logprobs import linear_token_logprobs, reference_token_logprobs, token_logprobs  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PATHS = ("naive", "fused", "linear")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _make_inputs(args, device):
    g = torch.Generator(device=device).manual_seed(0)
    dtype = DTYPES[args.dtype]
    hidden = torch.randn(1, args.tokens, args.hidden, generator=g, device=device).to(dtype)
    weight = torch.empty(args.vocab, args.hidden, dtype=dtype, device=device)
    for s in range(0, args.vocab, 8192):  # no transient full-size fp32 copy
        weight[s:s + 8192].normal_(0.0, 3.0 / args.hidden ** 0.5, generator=g)
    targets = torch.randint(0, args.vocab, (1, args.tokens), generator=g, device=device)
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def _step(path: str, hidden, weight, targets, args):
    """Forward + backward of the output layer and the logprobs (+ entropy) of ``path``."""
    if path == "linear":
        lp, ent = linear_token_logprobs(hidden, weight, targets, temperature=args.temperature,
                                        with_entropy=args.entropy)
    elif path == "fused":
        lp, ent = token_logprobs(torch.nn.functional.linear(hidden, weight), targets, temperature=args.temperature,
                                 with_entropy=args.entropy)
    else:
        lp, ent = reference_token_logprobs(torch.nn.functional.linear(hidden, weight), targets, args.temperature,
                                           with_entropy=args.entropy)
    g = torch.Generator(device=lp.device).manual_seed(1)
    loss = (lp * torch.randn(lp.shape, generator=g, device=lp.device)).sum()
    if ent is not None:
        loss = loss + (ent * torch.randn(ent.shape, generator=g, device=lp.device)).sum()
    loss.backward()
    return lp.detach(), (ent.detach() if ent is not None else None)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_memory(path: str, args) -> dict:
    """Peak memory one forward + backward of ``path`` adds on top of its inputs (hidden, weight)."""
    device = torch.device(args.device)
    hidden, weight, targets = _make_inputs(args, device)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_bytes()
    _step(path, hidden, weight, targets, args)
    _sync(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"peak_extra_bytes": peak, "weight_grad_bytes": weight.numel() * weight.element_size(),
            "logits_bytes": args.tokens * args.vocab * weight.element_size()}


def timings_and_errors(args) -> dict[str, dict]:
    """Best forward + backward time of each path, the paths interleaved round by round so that load
    from other processes hits all alike; and each path's largest difference from the naive one."""
    device = torch.device(args.device)
    hidden, weight, targets = _make_inputs(args, device)
    out = {path: {"time_s": float("inf")} for path in PATHS}
    values = {}
    for _ in range(args.reps + 1):  # the first round warms up
        for path in PATHS:
            hidden.grad = weight.grad = None
            _sync(device)
            t0 = time.perf_counter()
            lp, ent = _step(path, hidden, weight, targets, args)
            _sync(device)
            out[path]["time_s"] = min(out[path]["time_s"], time.perf_counter() - t0)
            values[path] = (lp, ent, hidden.grad.float(), weight.grad.float())
    for path in PATHS:
        diffs = [(a - b).abs().max().item() for a, b in zip(values[path], values["naive"]) if a is not None]
        out[path]["max_abs_diff"] = dict(zip(("logprob", "entropy", "grad_hidden", "grad_weight") if args.entropy
                                             else ("logprob", "grad_hidden", "grad_weight"), diffs))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=2048, help="tokens in the micro-batch (b * s)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (the output layer's input)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of hidden states and weight")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--no-entropy", dest="entropy", action="store_false", help="logprobs only")
    p.add_argument("--reps", type=int, default=5, help="timed rounds per path (after one warm-up round)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if args.worker:
        print(json.dumps(peak_memory(args.worker, args)))
        return 0

    results = {}
    for path in PATHS:
        if args.device == "cpu":  # own process: ru_maxrss is a per-process high-water mark
            cmd = [sys.executable, __file__, "--worker", path] + sys.argv[1:]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[path] = json.loads(out.strip().splitlines()[-1])
        else:
            results[path] = peak_memory(path, args)
            torch.cuda.empty_cache()
    for path, r in timings_and_errors(args).items():
        results[path].update(r)
    gib = 1024 ** 3
    wgrad = results["naive"]["weight_grad_bytes"]
    print(f"device={args.device} tokens={args.tokens} hidden={args.hidden} vocab={args.vocab} dtype={args.dtype} "
          f"entropy={args.entropy} threads={torch.get_num_threads()}")
    print(f"(inputs not counted; every path returns the weight gradient, {wgrad / gib:.2f} GiB, counted; "
          f"the logits would be {results['naive']['logits_bytes'] / gib:.2f} GiB)")
    print(f"{'path':<8}{'fwd+bwd s':>11}{'peak extra GiB':>16}{'without wgrad':>15}   max |diff| vs naive")
    for path in PATHS:
        r = results[path]
        diffs = " ".join(f"{k}={v:.1e}" for k, v in r["max_abs_diff"].items()) if path != "naive" else ""
        print(f"{path:<8}{r['time_s']:>11.3f}{r['peak_extra_bytes'] / gib:>16.3f}"
              f"{(r['peak_extra_bytes'] - wgrad) / gib:>15.3f}   {diffs}")
    fused, linear = results["fused"], results["linear"]
    mem = (linear["peak_extra_bytes"] - wgrad) / max(fused["peak_extra_bytes"] - wgrad, 1)
    print(f"linear/fused peak extra memory without the weight gradient: {mem:.2f}x (target <= 0.25); "
          f"with it: {linear['peak_extra_bytes'] / max(fused['peak_extra_bytes'], 1):.2f}x")
    print(f"linear/fused time: {linear['time_s'] / fused['time_s']:.2f}x (target <= 1);  "
          f"linear/naive time: {linear['time_s'] / results['naive']['time_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
