"""Rollout throughput and weight-sync time: engine placement, replica count, sync method.

For a random model of the chosen size, each configuration is started, warmed up, then timed on
``--prompts`` x ``--n`` sampled responses of ``--max-tokens`` (tokens/s counts generated tokens)
and/or on ``--syncs`` full weight syncs from HF-named tensors. All configurations of a
comparison run in one invocation and their ratios are printed side by side:

- default: vLLM in process vs in its engine-core subprocess, tokens/s and s/sync (weights in
  memory either way: the worker's reload in process, shared-memory buckets to the subprocess);
- ``--replicas 1 2``: the script re-runs itself under torchrun (one rank per replica of the
  largest count, ``OMP_NUM_THREADS=1``), starts ``DistributedRollout`` with each count and times
  them in turn, ``--repeats`` rounds (median), on the same prompts with per-sample seeds (every
  count samples the same tokens). On the CPU each engine's model runs on one thread, pinned to
  its own core when several share the machine; its scheduler (engine core) and the rank that
  drives it are processes of their own. A reference line gives what k single-thread matmul
  loops on k cores do over one, the most k replicas can gain on this machine (a VM's vCPUs may
  share hardware). Target: 2 replicas >= 1.6x the tokens/s of 1 on 2 cores;
- ``--sync-method memory folder broadcast``: an engine subprocess takes ``--syncs`` syncs (after
  one untimed warm-up) through shared-memory buckets, a safetensors folder in /dev/shm, or a
  broadcast of each bucket in a process group of the engine's own (gloo on the CPU; NCCL for
  ``--device cuda`` weights, which needs the engine on another GPU than the weights: not on a
  one-GPU machine). Target: memory <= 0.5x the seconds of folder;
- ``--gather``: the trainer side of a sync, ``iter_hf_weights`` under torchrun (2 ranks, the model
  at TP2 and then PP2), delivered to every rank (``receivers=None``, the HF export's way) and to the
  replica leaders only (the weight sync's way): the MB each rank receives (counted at the
  torch.distributed calls: others' all-gather parts, broadcasts from another rank, point-to-point
  receives) and yields per sync, and s/sync, side by side (docs/scaling.md has the formula at scale).

    python benchmarks/bench_rollout.py                                   # CPU, tiny Qwen2
    python benchmarks/bench_rollout.py --replicas 1 2 --prompts 64 --max-tokens 256   # CPU, 2 cores
    python benchmarks/bench_rollout.py --sync-method memory folder broadcast --model-size 100m --syncs 10
    python benchmarks/bench_rollout.py --gather --model-size 100m --syncs 5
    python benchmarks/bench_rollout.py --device cuda --model-size 1.5b --dtype bfloat16 \\
        --prompts 256 --max-tokens 512                                   # GPU machine (vLLM GPU build)

Model sizes (random weights, the tiny 512-token tokenizer): ``tiny`` (~0.7 M parameters),
``100m`` (12 x 768, intermediate 3072, ~0.1 B), ``0.5b`` (Qwen2.5-0.5B-like layers: 24 x 896,
~0.36 B), ``1.5b`` (Qwen2.5-1.5B-like: 28 x 1536, ~1.3 B).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_alp.config import RolloutConfig  # noqa: E402
from megatron_alp.models.tiny import make_tiny_model  # noqa: E402
from megatron_alp.rollout import SamplingParams, build_engine  # noqa: E402
from megatron_alp.runtime.parallel import free_port  # noqa: E402

SIZES = {
    "tiny": {},
    "100m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=2, max_position_embeddings=4096),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, max_position_embeddings=4096),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, max_position_embeddings=4096),
}
SEED = 1234  # per-sample seeds of the timed generate calls


def rollout_config(args, **overrides) -> RolloutConfig:
    return RolloutConfig(dtype=args.dtype, quantization=args.quantization,
                         max_model_len=args.prompt_len + args.max_tokens + 8, gpu_memory_utilization=args.gpu_mem,
                         request_timeout_s=3600.0, **overrides)


def make_prompts(args) -> list[list[int]]:
    """The same random prompts in every process (the torchrun ranks must agree on them)."""
    g = torch.Generator().manual_seed(0)
    return [[1, *torch.randint(3, 500, (args.prompt_len - 1,), generator=g).tolist()] for _ in range(args.prompts)]


def timed_syncs(engine, weights: dict, syncs: int) -> list[float]:
    seconds = []
    for _ in range(syncs):
        t0 = time.perf_counter()
        engine.update_weights(weights.items())
        seconds.append(time.perf_counter() - t0)
    return seconds


def weight_mb(weights: dict) -> float:
    return sum(t.numel() * t.element_size() for t in weights.values()) / 2**20


# ------------------------------------------------------------------- in process vs subprocess

def bench_placement(placement: str, model_dir: Path, weights: dict, args) -> dict:
    t0 = time.perf_counter()
    engine = build_engine(rollout_config(args, engine_process=placement), str(model_dir), seed=0)
    start_s = time.perf_counter() - t0
    prompts = make_prompts(args)
    try:
        engine.generate(prompts[:4], SamplingParams(n=2, max_tokens=8))  # warm-up
        t0 = time.perf_counter()
        groups = engine.generate(prompts, SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens))
        gen_s = time.perf_counter() - t0
        tokens = sum(len(c.response_ids) for grp in groups for c in grp)
        sync_s = timed_syncs(engine, weights, args.syncs)
    finally:
        engine.shutdown()
    return {"start_s": start_s, "tokens": tokens, "tokens_per_s": tokens / gen_s,
            "sync_s": sum(sync_s) / len(sync_s), "sync_mb": weight_mb(weights)}


def report_placements(rows: dict) -> None:
    print(f"{'placement':<12} {'start s':>8} {'gen tokens':>10} {'tokens/s':>10} {'s/sync':>8} {'MB/sync':>8}")
    for name, r in rows.items():
        print(f"{name:<12} {r['start_s']:8.1f} {r['tokens']:10d} {r['tokens_per_s']:10.0f} "
              f"{r['sync_s']:8.3f} {r['sync_mb']:8.1f}")
    if {"in_process", "subprocess"} <= rows.keys():
        a, b = rows["in_process"], rows["subprocess"]
        print(f"subprocess / in_process: tokens/s x{b['tokens_per_s'] / a['tokens_per_s']:.2f}, "
              f"s/sync x{b['sync_s'] / a['sync_s']:.2f}")


# ----------------------------------------------------------------------------- sync methods

def bench_sync_method(method: str, model_dir: Path, weights: dict, args) -> dict:
    """Syncs into an engine subprocess after an untimed warm-up one, so that the mean is the
    steady cost of a training iteration, not first-call work in either process."""
    engine = build_engine(rollout_config(args, engine_process="subprocess", sync_method=method), str(model_dir),
                          seed=0)
    try:
        engine.update_weights(weights.items())
        seconds = timed_syncs(engine, weights, args.syncs)
        path = engine.last_sync["path"]
    finally:
        engine.shutdown()
    if path != method:
        raise RuntimeError(f"sync_method={method} but the engine synced through {path!r}")
    mean = sum(seconds) / len(seconds)
    return {"sync_s": mean, "min_s": min(seconds), "max_s": max(seconds), "sync_mb": weight_mb(weights),
            "gb_per_s": weight_mb(weights) * 2**20 / mean / 1e9}


def report_sync_methods(rows: dict, syncs: int) -> None:
    print(f"engine subprocess, mean of {syncs} syncs after one untimed")
    print(f"{'method':<9} {'s/sync':>8} {'min s':>8} {'max s':>8} {'MB/sync':>8} {'GB/s':>8}")
    for name, r in rows.items():
        print(f"{name:<9} {r['sync_s']:8.3f} {r['min_s']:8.3f} {r['max_s']:8.3f} {r['sync_mb']:8.1f} "
              f"{r['gb_per_s']:8.2f}")
    if {"memory", "folder"} <= rows.keys():
        ratio = rows["memory"]["sync_s"] / rows["folder"]["sync_s"]
        print(f"memory / folder: s/sync x{ratio:.2f} (target <= 0.5: {'met' if ratio <= 0.5 else 'NOT met'})")
    if {"memory", "broadcast"} <= rows.keys():
        print(f"broadcast / memory: s/sync x{rows['broadcast']['sync_s'] / rows['memory']['sync_s']:.2f}")


# --------------------------------------------------------------------------------- replicas

_SPIN = """import os, sys, time, torch
os.sched_setaffinity(0, {int(sys.argv[1])}); torch.set_num_threads(1); a = torch.randn(256, 256); n = 0
time.sleep(max(0.0, float(sys.argv[2]) - time.time())); t0 = time.perf_counter()
while time.perf_counter() - t0 < 2.0: a @ a; n += 1
print(n)"""


def cpu_scaling(k: int) -> float | None:
    """Matrix products done by k single-thread processes on k cores at once over those of one:
    the most k replicas can gain here (a VM's vCPUs may share physical cores or host time)."""
    cores = sorted(os.sched_getaffinity(0))[:k]
    if len(cores) < k:
        return None

    def work(on: list[int]) -> int:
        start = str(time.time() + 4.0)  # after every process has imported torch
        procs = [subprocess.Popen([sys.executable, "-c", _SPIN, str(c), start], stdout=subprocess.PIPE, text=True)
                 for c in on]
        return sum(int(p.communicate()[0]) for p in procs)

    return work(cores) / work(cores[:1])


def report_cpu_scaling(k: int, device: str) -> None:
    ratios = [cpu_scaling(k) for _ in range(3)] if device == "cpu" and k > 1 else []
    if ratios and None not in ratios:
        print(f"CPU: {k} single-thread matmul loops on {k} cores at once do x{statistics.median(ratios):.2f} "
              f"(x{min(ratios):.2f}-{max(ratios):.2f} in 3 tries) the work of one", flush=True)


def run_replica_job(model_dir: Path, args) -> dict:
    """This script again under torchrun (``--replica-job``), one rank per replica of the largest
    count."""
    nproc = max(args.replicas)
    if any(nproc % r for r in args.replicas):
        sys.exit(f"--replicas {args.replicas}: every count must divide {nproc} (the job's ranks)")
    return {int(r): row for r, row in run_job(model_dir, args, nproc, "--replica-job").items()}


def run_job(model_dir: Path, args, nproc: int, role: str) -> dict:
    """This script again under torchrun on ``nproc`` ranks as ``role`` (``--replica-job``,
    ``--gather-job``); the ranks' results come back through a JSON file rank 0 writes."""
    job = model_dir.parent / "job.json"
    out = model_dir.parent / "job_result.json"
    job.write_text(json.dumps({**vars(args), "model_dir": str(model_dir), "out": str(out)}))
    # The settings travel in a file: torchrun would take options such as --n for its own.
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_port", str(free_port()), str(Path(__file__).resolve()), role, str(job)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"torchrun failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-8000:]}")
    return json.loads(out.read_text())


def replica_worker(job: str) -> None:
    """One rank of the torchrun job: all replica counts started side by side, then timed in turn
    on the same prompts, ``--repeats`` rounds, so that load changes on the machine hit all alike."""
    import torch.distributed as dist

    from megatron_alp.config import ParallelConfig
    from megatron_alp.rollout import DistributedRollout
    from megatron_alp.runtime.parallel import init_distributed

    args = argparse.Namespace(**json.loads(Path(job).read_text()))
    init_distributed(ParallelConfig(), seed=0)
    prompts = make_prompts(args)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=SEED)
    rollouts, rows = {}, {}
    try:
        for replicas in dict.fromkeys(args.replicas):
            t0 = time.perf_counter()
            rollouts[replicas] = DistributedRollout(
                rollout_config(args, replicas=replicas, engine_process="subprocess"), args.model_dir, seed=0)
            rows[replicas] = {"start_s": time.perf_counter() - t0, "gen_s": []}
            rollouts[replicas].generate(prompts[:4], SamplingParams(n=2, max_tokens=8, seed=SEED))  # warm-up
            rollouts[replicas].take_stats()
        for _ in range(args.repeats):
            for replicas, rollout in rollouts.items():
                time.sleep(1.5)  # vLLM's idle worker busy-polls for 1 s after its last step
                dist.barrier()
                t0 = time.perf_counter()
                groups = rollout.generate(prompts, params)
                rows[replicas]["gen_s"].append(time.perf_counter() - t0)
                rows[replicas]["responses"] = [c.response_ids for g in groups for c in g]
    finally:
        for rollout in rollouts.values():
            rollout.shutdown()
    for replicas, row in rows.items():
        stats = rollouts[replicas].take_stats()
        responses = row.pop("responses")
        row.update(tokens=sum(map(len, responses)), straggler=stats.get("rollout/straggler_ratio", 1.0),
                   replica_min=stats.get("rollout/replica_tokens_per_s_min", 0.0),
                   replica_max=stats.get("rollout/replica_tokens_per_s_max", 0.0),
                   digest=hashlib.sha1(json.dumps(responses).encode()).hexdigest()[:12])
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))


def report_replicas(rows: dict) -> None:
    """Tokens/s is the median over the repeats (their range beside it shows the noise); the
    replicas' own rates and the straggler ratio are over all repeats together."""
    print(f"{'replicas':>8} {'start s':>8} {'gen tokens':>10} {'tokens/s':>10} {'repeats min-max':>16} "
          f"{'replica tok/s min-max':>22} {'straggler':>9} {'samples':>12}")
    rate = {}
    for r, row in sorted(rows.items()):
        rates = [row["tokens"] / s for s in row["gen_s"]]
        rate[r] = statistics.median(rates)
        repeats = f"{min(rates):.0f}-{max(rates):.0f}"
        replica = f"{row['replica_min']:.0f}-{row['replica_max']:.0f}"
        print(f"{r:8d} {row['start_s']:8.1f} {row['tokens']:10d} {rate[r]:10.0f} {repeats:>16} {replica:>22} "
              f"{row['straggler']:9.2f} {row['digest']:>12}")
    if len({row["digest"] for row in rows.values()}) > 1:
        print("WARNING: the replica counts sampled different tokens (per-sample seeds should make them equal)")
    if {1, 2} <= rate.keys():
        ratio = rate[2] / rate[1]
        print(f"2 replicas / 1: tokens/s x{ratio:.2f} (target >= 1.6: {'met' if ratio >= 1.6 else 'NOT met'})")


# --------------------------------------------------------------------------- weight gather

GATHER_LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


class ReceivedBytes:
    """While installed, counts the bytes this rank receives in the calls iter_hf_weights makes:
    the other ranks' parts of an all-gather, a broadcast from another rank, a point-to-point receive."""

    def __init__(self):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        self.count = 0
        self._dist, self._c10d = dist, distributed_c10d
        self._saved = (dist.all_gather, dist.broadcast, dist.irecv)
        self._inside = False

    def __enter__(self) -> "ReceivedBytes":
        all_gather, broadcast, irecv = self._saved
        rank = self._dist.get_rank()

        def counting_all_gather(parts, tensor, *a, **kw):
            self.count += sum(_nbytes(t) for t in parts) - _nbytes(tensor)
            return all_gather(parts, tensor, *a, **kw)

        def counting_broadcast(tensor, src=None, *a, **kw):
            self.count += 0 if src == rank else _nbytes(tensor)
            return broadcast(tensor, src, *a, **kw)

        def counting_irecv(tensor, *a, **kw):
            if self._inside:  # the CPU shims' torch-function mode calls irecv again, through this wrapper
                return irecv(tensor, *a, **kw)
            self.count += _nbytes(tensor)
            self._inside = True
            try:
                return irecv(tensor, *a, **kw)
            finally:
                self._inside = False

        self._install(counting_all_gather, counting_broadcast, counting_irecv)
        return self

    def __exit__(self, *exc) -> None:
        self._install(*self._saved)

    def _install(self, all_gather, broadcast, irecv) -> None:
        self._dist.all_gather, self._dist.broadcast, self._dist.irecv = all_gather, broadcast, irecv
        self._c10d.irecv = irecv  # P2POp accepts only distributed_c10d's own irecv


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def gather_worker(job: str) -> None:
    """One rank of the torchrun job: per layout, the model loaded from the HF folder, then
    ``--syncs`` gathers to every rank and to the replica leaders, one untimed warm-up each."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_alp.config import ModelConfig, ParallelConfig
    from megatron_alp.models.families import hf_to_megatron, load_hf_config
    from megatron_alp.models.hf_weights import iter_hf_weights, load_hf_weights
    from megatron_alp.rollout.placement import replica_layout
    from megatron_alp.runtime.parallel import init_distributed
    from megatron_alp.runtime.platform import has_gpu
    from megatron_alp.training.builder import build_gpt_model

    args = argparse.Namespace(**json.loads(Path(job).read_text()))
    rows = {}
    for name, (tp, pp) in GATHER_LAYOUTS.items():
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        par = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        init_distributed(par, seed=0)
        world = dist.get_world_size()
        model = build_gpt_model(hf_to_megatron(load_hf_config(args.model_dir)),
                                ModelConfig(hf_path=args.model_dir, dtype=args.dtype, layer_spec="local"), par)
        load_hf_weights(model, args.model_dir)
        layout = replica_layout(rollout_config(args), world, world // (tp * pp), has_gpu())
        leaders = [layout.leader(k) for k in range(layout.replicas)]
        row = rows.setdefault(name, {"leader_ranks": leaders})
        for way, receivers in (("everyone", None), ("leaders", leaders)):
            for _ in iter_hf_weights(model, args.sync_bucket_mb << 20, receivers):
                pass  # warm-up: the export plan, first-touch allocations
            seconds, received, yielded = [], [], []
            for _ in range(args.syncs):
                dist.barrier()
                t0 = time.perf_counter()
                with ReceivedBytes() as traffic:
                    yielded.append(sum(_nbytes(t) for _, t in iter_hf_weights(
                        model, args.sync_bucket_mb << 20, receivers)))
                seconds.append(time.perf_counter() - t0)
                received.append(traffic.count)
            if len(set(received)) > 1 or len(set(yielded)) > 1:
                raise RuntimeError(f"{name} {way}: traffic differs between syncs: {received} {yielded}")
            row[way] = {"received": received[0], "yielded": yielded[0], "seconds": statistics.median(seconds)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(everyone))


def report_gather(ranks: list, syncs: int) -> None:
    print(f"weight gather per sync, {len(ranks)} ranks (median s of {syncs}): MB received / yielded by each rank")
    print(f"{'layout':<7} {'rank':>4} {'leader':>6} | {'every rank: recv':>16} {'yield':>8} {'s':>7} | "
          f"{'leaders only: recv':>18} {'yield':>8} {'s':>7}")
    for layout in GATHER_LAYOUTS:
        for rank, rows in enumerate(ranks):
            row = rows[layout]
            a, b = row["everyone"], row["leaders"]
            print(f"{layout:<7} {rank:>4} {'yes' if rank in row['leader_ranks'] else 'no':>6} | "
                  f"{a['received'] / 2**20:16.2f} {a['yielded'] / 2**20:8.2f} {a['seconds']:7.3f} | "
                  f"{b['received'] / 2**20:18.2f} {b['yielded'] / 2**20:8.2f} {b['seconds']:7.3f}")
        total = [sum(r[layout][way]["received"] for r in ranks) / 2**20 for way in ("everyone", "leaders")]
        print(f"{layout:<7} {'all':>4} {'':>6} | {total[0]:16.2f} {'':>8} {'':>7} | {total[1]:18.2f}")


# ------------------------------------------------------------------------------------- main

def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model-size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--family", choices=["qwen2", "qwen3", "llama"], default="qwen2")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--quantization", choices=["none", "fp8", "fp8_per_channel"], default="none")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--gpu-mem", type=float, default=0.5, help="rollout.gpu_memory_utilization (GPU)")
    p.add_argument("--placements", default="in_process,subprocess")
    p.add_argument("--replicas", type=int, nargs="+", help="compare these replica counts (torchrun job)")
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls per replica count (median)")
    p.add_argument("--sync-method", nargs="+", choices=["memory", "folder", "broadcast"],
                   help="compare these sync methods")
    p.add_argument("--gather", action="store_true",
                   help="MB each rank receives and yields per sync gather, to every rank vs to the leaders")
    p.add_argument("--sync-bucket-mb", type=int, default=RolloutConfig().sync_bucket_mb,
                   help="rollout.sync_bucket_mb: the gather's bucket size (--gather)")
    p.add_argument("--replica-job", help=argparse.SUPPRESS)  # the torchrun ranks of --replicas
    p.add_argument("--gather-job", help=argparse.SUPPRESS)  # the torchrun ranks of --gather
    return p.parse_args()


def load_weights(model_dir: Path, device: str) -> dict:
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(f), device=device))
    return weights


def main() -> None:
    args = parse_args()
    if (args.device == "cuda") != torch.cuda.is_available():
        sys.exit(f"--device {args.device} but torch.cuda.is_available() is {torch.cuda.is_available()}")
    if args.replica_job:
        return replica_worker(args.replica_job)
    if args.gather_job:
        return gather_worker(args.gather_job)

    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        model_dir = make_tiny_model(args.family, Path(tmp) / "model", seed=0, dtype=args.dtype,
                                    **SIZES[args.model_size])
        weights = load_weights(model_dir, args.device)
        params = sum(t.numel() for t in weights.values())
        print(f"model: {args.family} {args.model_size} ({params / 1e6:.1f} M parameters, {args.dtype}), "
              f"device {args.device}, quantization {args.quantization}; {args.prompts} prompts x n={args.n}, "
              f"{args.prompt_len} prompt + {args.max_tokens} response tokens", flush=True)
        if args.replicas:
            report_cpu_scaling(max(args.replicas), args.device)
            report_replicas(run_replica_job(model_dir, args))
        if args.sync_method:
            report_sync_methods({m: bench_sync_method(m, model_dir, weights, args) for m in args.sync_method},
                                args.syncs)
        if args.gather:
            report_gather(run_job(model_dir, args, 2, "--gather-job"), args.syncs)
        if not args.replicas and not args.sync_method and not args.gather:
            report_placements({p: bench_placement(p, model_dir, weights, args) for p in args.placements.split(",")})


if __name__ == "__main__":  # vLLM's engine subprocess re-imports this module
    main()
