"""Rollout engine throughput and weight-sync time, in process vs in vLLM's engine-core subprocess.

For a random model of the chosen size, each placement is started, warmed up, then timed on
``--prompts`` x ``--n`` sampled responses of ``--max-tokens`` (tokens/s counts generated tokens)
and on ``--syncs`` full weight syncs from HF-named tensors (in memory in process; through a
safetensors folder for the subprocess, as under torchrun). Both placements run in one invocation
and the ratios are printed side by side.

    python benchmarks/bench_rollout.py                                   # CPU, tiny Qwen2
    python benchmarks/bench_rollout.py --device cuda --model-size 1.5b --dtype bfloat16 \\
        --prompts 256 --max-tokens 512                                   # GPU machine (vLLM GPU build)

Model sizes (random weights, the tiny 512-token tokenizer): ``tiny`` (~0.7 M parameters),
``0.5b`` (Qwen2.5-0.5B-like layers: 24 x 896, ~0.36 B), ``1.5b`` (Qwen2.5-1.5B-like: 28 x 1536,
~1.3 B).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_alp.config import RolloutConfig  # noqa: E402
from megatron_alp.models.tiny import make_tiny_model  # noqa: E402
from megatron_alp.rollout import SamplingParams, build_engine  # noqa: E402

SIZES = {
    "tiny": {},
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, max_position_embeddings=4096),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, max_position_embeddings=4096),
}


def bench_placement(placement: str, model_dir: Path, weights: dict, args) -> dict:
    cfg = RolloutConfig(dtype=args.dtype, quantization=args.quantization, engine_process=placement,
                        max_model_len=args.prompt_len + args.max_tokens + 8, gpu_memory_utilization=args.gpu_mem,
                        request_timeout_s=3600.0)
    t0 = time.perf_counter()
    engine = build_engine(cfg, str(model_dir), seed=0)
    start_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(3, 500, (args.prompt_len - 1,), generator=g).tolist()] for _ in range(args.prompts)]
    try:
        engine.generate(prompts[:4], SamplingParams(n=2, max_tokens=8))  # warm-up
        t0 = time.perf_counter()
        groups = engine.generate(prompts, SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens))
        gen_s = time.perf_counter() - t0
        tokens = sum(len(c.response_ids) for grp in groups for c in grp)
        sync_s = []
        for _ in range(args.syncs):
            t0 = time.perf_counter()
            engine.update_weights(weights.items())
            sync_s.append(time.perf_counter() - t0)
    finally:
        engine.shutdown()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    return {"start_s": start_s, "tokens": tokens, "tokens_per_s": tokens / gen_s,
            "sync_s": sum(sync_s) / len(sync_s), "sync_mb": nbytes / 2**20}


def main() -> None:
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
    args = p.parse_args()
    if (args.device == "cuda") != torch.cuda.is_available():
        sys.exit(f"--device {args.device} but torch.cuda.is_available() is {torch.cuda.is_available()}")

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        model_dir = make_tiny_model(args.family, Path(tmp) / "model", seed=0, dtype=args.dtype,
                                    **SIZES[args.model_size])
        weights = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            weights.update(load_file(str(f), device=args.device))
        params = sum(t.numel() for t in weights.values())
        print(f"model: {args.family} {args.model_size} ({params / 1e6:.1f} M parameters, {args.dtype}), "
              f"device {args.device}, quantization {args.quantization}; {args.prompts} prompts x n={args.n}, "
              f"{args.prompt_len} prompt + {args.max_tokens} response tokens")
        rows = {}
        for placement in args.placements.split(","):
            rows[placement] = bench_placement(placement, model_dir, weights, args)
    print(f"{'placement':<12} {'start s':>8} {'gen tokens':>10} {'tokens/s':>10} {'s/sync':>8} {'MB/sync':>8}")
    for name, r in rows.items():
        print(f"{name:<12} {r['start_s']:8.1f} {r['tokens']:10d} {r['tokens_per_s']:10.0f} "
              f"{r['sync_s']:8.3f} {r['sync_mb']:8.1f}")
    if {"in_process", "subprocess"} <= rows.keys():
        a, b = rows["in_process"], rows["subprocess"]
        print(f"subprocess / in_process: tokens/s x{b['tokens_per_s'] / a['tokens_per_s']:.2f}, "
              f"s/sync x{b['sync_s'] / a['sync_s']:.2f}")


if __name__ == "__main__":
    main()
