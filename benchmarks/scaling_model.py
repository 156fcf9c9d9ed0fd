"""Projected time of one training iteration of a shipped config at 8, 64 and 256 GPUs: colocated,
with one rollout engine or with engine replicas on every GPU, and with the engines on GPUs of their
own (``rollout.placement: separate``), synchronous or asynchronous. A model, not a measurement:
nothing here runs a GPU, and every rate is a flag whose default names its source (docs/scaling.md).

    colocated                  iteration = rollout + offload + logprob passes + update + sync
    separate, max_staleness 0  iteration = rollout (R engine GPUs) + logprob + update (T trainer GPUs) + sync
    separate, max_staleness 1  iteration = max(rollout, logprob + update) + sync

With separate engines the engines generate batch b+1 while the trainer trains batch b; the weight
sync then waits for both (the engine's running generation ends first, and the trainer's weights
must not change while they are read), so neither side works during it. Partial rollouts
(``rollout.partial_rollout``) let the sync pause the generation instead; in this steady state the
sum is the same, and whatever they gain on long tails is not modelled. Per node,
``--engine-gpus-per-node`` of the ``--gpus-per-node`` GPUs run engines (the last ones, as
``rollout.gpus``) at ``--separate-utilization``, the rest run trainer ranks; a config that is
already separate keeps its own ``rollout.gpus`` and utilization.

- rollout: each sample's response length is drawn once (seeded lognormal with mean
  --mean-response and --response-cv, clipped to max_response_length). Whole groups go to the
  replicas the way DistributedRollout.split does when prompts are alike (megatron_alp.algorithms.balance
  .partition of equal costs: round robin), and the step waits for the slowest replica. A replica
  of TP t decodes B sequences at once, B = min(its samples, its KV cache / one mean sequence,
  --max-num-seqs); one decode step costs max(matmul FLOPs at --gen-mfu, HBM traffic of its weights
  and KV cache at --hbm-eff) + --step-ms. A replica takes max(its tokens / B steps of B, its
  longest response x a step of 1): throughput-bound or tail-bound. One engine = one replica of TP
  t, the other GPUs idle while it generates.
- offload: Megatron's offloaded state (megatron_alp.plan.memory) to pinned host memory and back, and the
  sleeping engine's weights out and back, at --pcie-gbps.
- logprob passes (old policy if the loss or the mismatch metrics need it, reference if kl_coef > 0)
  and the update (forward + backward, one more forward with recompute: full): 2 x active
  parameters FLOPs per token plus causal attention, at --train-mfu of --peak-tflops on every GPU;
  each of the updates_per_iteration optimizer steps adds its data-parallel collectives (fp32
  gradients reduce-scattered, bf16 parameters all-gathered: 6 B per parameter of the rank, 8 without
  the distributed optimizer), not overlapped, at --nvlink-gbps in one node, --ib-gbps across nodes.
- sync: the model in its dtype, gathered on every rank and loaded into every replica at --sync-gbps;
  with separate engines the replica leaders also broadcast it to their engines' workers over NCCL
  at --broadcast-gbps (not overlapped with the gather: an upper bound).
- tokens/s/GPU counts every GPU of the job, the engines' included.

    .venv/bin/python benchmarks/scaling_model.py                 # the 1.5B, 7B and Qwen3-30B-A3B configs
    .venv/bin/python benchmarks/scaling_model.py configs/qwen3-4b_seq_alp.yaml --gpus 8 16 \
        --set trainer.prompts_per_iteration=256 --mean-response 600
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_alp.algorithms.balance import partition  # noqa: E402
from megatron_alp.algorithms.policy_loss import needs_old_logprobs  # noqa: E402
from megatron_alp.config import Config, ConfigError, apply_overrides  # noqa: E402
from megatron_alp.plan.architecture import Architecture, resolve_architecture  # noqa: E402
from megatron_alp.plan.estimates import DTYPE_BYTES  # noqa: E402
from megatron_alp.plan.memory import memory_plan  # noqa: E402
from megatron_alp.resolve import config_from_dict, load_config

CONFIGS = ["configs/qwen2.5-math-1.5b_token_alp.yaml", "configs/qwen2.5-7b_tir_seq_alp.yaml",
           "configs/qwen3-30b-a3b_seq_alp.yaml"]
PARTS = ("rollout", "offload", "logprob", "update", "sync")
# Measured by NVIDIA, published: GRPO on-policy, DGX-H100, BF16, Megatron backend; tokens/s/GPU =
# all tokens of a step's samples / step time / GPUs. NVIDIA-NeMo/RL docs/about/performance-summary.md: the
# v0.6 table (PR #2346) and the v0.5 table (PR #1772).
NEMO_RL = [
    ("Qwen3-30B-A3B", 32, 1102, "v0.6: 2,048 samples of mean 3,203 (max 4,096) tokens, generation TP2, step 192 s"),
    ("Qwen3-30B-A3B", 32, 1414, "v0.6, 1-step off-policy: 16 generation + 16 training GPUs (recipe "
                                "grpo-qwen3-30ba3b-4n8g-async-1off), generation TP2, step 152 s"),
    ("Llama-3.1-8B", 16, 1581, "v0.5: 2,048 samples of mean 1,019 (max 4,096) tokens, generation TP1, step 92.8 s"),
]
# Measured by verl's authors, published (docs/advance/fully_async.md, verl-project/verl): DAPO on
# Qwen2.5-Math-7B, H20, responses up to 28K tokens; step seconds, colocated sync vs fully async.
VERL_FULLY_ASYNC = [
    (128, "colocated sync 356 s/step vs fully async 64 trainer + 64 rollout GPUs 151 s/step (staleness 0.5, "
          "partial rollout, streaming): 2.35-2.67x in total time over 400 steps"),
]

# flag, default, where the default comes from (the source is in --help and docs/scaling.md)
ASSUMPTIONS = [
    ("peak_tflops", 989.0, "H100 SXM dense BF16 tensor-core peak (NVIDIA H100 datasheet)"),
    ("hbm_tbps", 3.35, "H100 SXM HBM3 bandwidth (NVIDIA H100 datasheet)"),
    ("hbm_eff", 0.6, "assumed: vLLM decode reaches ~77%% of the HBM ceiling at batch 1 on an A100 "
                     "(johnmusgrave.com vLLM throughput-latency sweep), less with paged KV reads"),
    ("gen_mfu", 0.3, "assumed: decode GEMMs of B rows reach less of the peak than training's"),
    ("step_ms", 1.0, "assumed: scheduler, sampling over the vocabulary and logprob output per decode step"),
    ("max_num_seqs", 1024, "vLLM 0.32 default on GPUs of >= 70 GiB (vllm/engine/arg_utils.py); the repo keeps it"),
    ("train_mfu", 0.3, "assumed: Megatron-Core reaches up to 47%% MFU pretraining on H100 (Megatron-LM); "
                       "RL micro-batches of 1-4 variable-length sequences less"),
    ("nvlink_gbps", 200.0, "assumed: a fraction of an H100's 900 GB/s NVLink 4 (datasheet) for NCCL collectives"),
    ("ib_gbps", 40.0, "assumed: 400 Gb/s NDR InfiniBand per GPU (DGX H100), 50 GB/s line rate"),
    ("pcie_gbps", 25.0, "assumed: pinned copies over PCIe Gen5 x16 (64 GB/s peak), 8 GPUs of a node at once"),
    ("sync_gbps", 4.0, "NeMo-RL's colocated CUDA-IPC refit of Qwen3-30B-A3B (with MXFP8 quantization) took "
                       "13-17 s (NVIDIA-NeMo/RL PR #3294, B200): ~4 GB/s of its 61 GB bf16 model"),
    ("broadcast_gbps", 60.0, "separate engines: NCCL broadcast into vLLM; checkpoint-engine updated GLM-4.5-Air "
                             "(BF16, ~213 GB) on 8xH800 in 3.47 s, ~61 GB/s (MoonshotAI/checkpoint-engine README)"),
    ("gpus_per_node", 8, "DGX H100: 8 GPUs per node"),
    ("engine_gpus_per_node", 4, "assumed: half of every node generates (NeMo-RL's one-step off-policy Qwen3-30B-A3B "
                                "recipe: 2 of 4 nodes; verl's fully async 7B runs: 64 of 128 GPUs)"),
    ("separate_utilization", 0.9, "vLLM's default gpu_memory_utilization: an engine with a GPU of its own"),
    ("prompt_tokens", 200, "assumed: a math problem in a chat template"),
    ("mean_response", 0.0, "assumed: 0 means half of rollout.sampling.max_response_length"),
    ("response_cv", 0.6, "assumed: standard deviation / mean of response lengths (0: all equal, no stragglers)"),
    ("seed", 0, "seed of the drawn response lengths"),
]
Rates = dataclasses.make_dataclass("Rates", [(name, type(default), default) for name, default, _ in ASSUMPTIONS],
                                   frozen=True)


def active_params(arch: Architecture) -> int:
    """Parameters one token's matmuls use: the layers (routed experts: top-k of them) and the
    output layer (the input embedding is a lookup)."""
    dense, expert = arch.layer_params()
    routed = expert * arch.topk // arch.experts if arch.experts else 0
    return arch.layers * (dense + routed) + arch.vocab * arch.hidden


def response_lengths(cfg: Config, r) -> list[int]:
    """One drawn length per sample of an iteration, sample j of prompt g at g x n + j."""
    s = cfg.rollout.sampling
    samples, mean, cap = cfg.trainer.prompts_per_iteration * s.n, r.mean_response or s.max_response_length / 2, \
        s.max_response_length
    if r.response_cv == 0:
        return [min(cap, round(mean))] * samples
    s2 = math.log(1 + r.response_cv ** 2)
    rng = random.Random(r.seed)
    return [max(1, min(cap, round(rng.lognormvariate(math.log(mean) - s2 / 2, math.sqrt(s2)))))
            for _ in range(samples)]


def replica_seconds(resp: list[int], arch: Architecture, cfg: Config, plan, r) -> float:
    t = cfg.rollout.tensor_parallel_size
    kv_token = 2 * arch.layers * max(1, arch.kv_heads // t) * arch.head_dim * (
        1 if cfg.rollout.kv_cache_dtype == "fp8" else DTYPE_BYTES.get(cfg.rollout.dtype, 2))  # per GPU
    rollout = plan.phase("rollout")
    mean = sum(resp) / len(resp)
    fit = int(rollout.nbytes("kv_cache") // (kv_token * (r.prompt_tokens + mean)))  # mean sequences the KV cache holds
    b = max(1, min(len(resp), r.max_num_seqs, fit))

    def step(b: int, response: float) -> float:  # one decode step of b sequences, on each of the t GPUs
        flops = b * 2 * active_params(arch) / t
        traffic = rollout.nbytes("engine_weights") + b * kv_token * (r.prompt_tokens + response / 2)
        compute, memory = r.gen_mfu * r.peak_tflops * 1e12, r.hbm_eff * r.hbm_tbps * 1e12
        return max(flops / compute, traffic / memory) + r.step_ms / 1e3

    return max(sum(resp) / b * step(b, mean), max(resp) * step(1, max(resp)))


def rollout_seconds(cfg: Config, arch: Architecture, plan, engines: int, r) -> float:
    """The slowest of ``engines`` replicas, each dealt whole groups as DistributedRollout.split deals them."""
    n = cfg.rollout.sampling.n
    lengths = response_lengths(cfg, r)
    shares = partition([1.0] * cfg.trainer.prompts_per_iteration, engines)
    return max(replica_seconds([lengths[g * n + j] for g in share for j in range(n)], arch, cfg, plan, r)
               for share in shares if share)


def training_seconds(cfg: Config, arch: Architecture, plan, gpus: int, one_node: bool, r) -> tuple[float, float]:
    """(logprob passes, update) on ``gpus`` trainer GPUs; their collectives over NVLink when the
    trainer's ranks are ``one_node``, else over InfiniBand."""
    seqs = [r.prompt_tokens + x for x in response_lengths(cfg, r)]
    attention = 2 * arch.layers * arch.heads * arch.head_dim * sum(x * x for x in seqs)  # causal QK^T and AV
    forward = 2 * active_params(arch) * sum(seqs) + attention
    compute = gpus * r.train_mfu * r.peak_tflops * 1e12
    passes = int(needs_old_logprobs(cfg.loss.name) or cfg.trainer.mismatch_metrics) + int(cfg.loss.kl_coef > 0)
    rank_params = plan.phase("training").nbytes("weights") / DTYPE_BYTES[cfg.model.dtype]
    dp = gpus // (cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size)
    collectives = (6 if cfg.parallel.use_distributed_optimizer else 8) * rank_params * (dp > 1) / (
        (r.nvlink_gbps if one_node else r.ib_gbps) * 1e9)
    update = (4 if cfg.model.recompute == "full" else 3) * forward / compute
    return passes * forward / compute, update + cfg.trainer.updates_per_iteration * collectives


def project(cfg: Config, gpus: int, engines: int, r, plan=None) -> dict:
    """Seconds of each part of one colocated iteration on ``gpus`` GPUs with ``engines`` rollout replicas."""
    hf, _ = resolve_architecture(cfg)
    arch = Architecture.from_hf(hf)
    plan = plan or memory_plan(cfg, gpus, 80.0)
    tokens = sum(r.prompt_tokens + x for x in response_lengths(cfg, r))
    logprob, update = training_seconds(cfg, arch, plan, gpus, gpus <= r.gpus_per_node, r)
    engine = plan.phase("rollout").nbytes("engine_weights") if cfg.rollout.free_memory_during_training else 0
    parts = {
        "rollout": rollout_seconds(cfg, arch, plan, engines, r),
        "offload": 2 * (plan.offloaded_bytes + engine) / (r.pcie_gbps * 1e9),
        "logprob": logprob,
        "update": update,
        "sync": arch.total_params * DTYPE_BYTES[cfg.model.dtype] / (r.sync_gbps * 1e9),
    }
    total = sum(parts.values())
    return {**parts, "total": total, "tokens": tokens, "tokens_per_s_per_gpu": tokens / total / gpus,
            "engines": engines, "fits": plan.fits}


def iteration_seconds(parts: dict, asynchronous: bool) -> float:
    """One iteration of separate engines: the parts in turn, or with ``trainer.max_staleness: 1``
    generation beside the trainer's logprob passes and update, then the sync, which waits for both."""
    if asynchronous:
        return max(parts["rollout"], parts["logprob"] + parts["update"]) + parts["sync"]
    return parts["rollout"] + parts["logprob"] + parts["update"] + parts["sync"]


def separate_config(cfg: Config, r) -> Config:
    """``cfg`` with its engines on the last ``--engine-gpus-per-node`` GPUs of every node at
    ``--separate-utilization`` (a config that is already separate is kept)."""
    if cfg.rollout.placement == "separate":
        return cfg
    engine_gpus = list(range(r.gpus_per_node - r.engine_gpus_per_node, r.gpus_per_node))
    overrides = ["rollout.placement=separate", f"rollout.gpus={engine_gpus}", "rollout.replicas=auto",
                 f"rollout.gpu_memory_utilization={r.separate_utilization}", "rollout.free_memory_during_training=false"]
    return config_from_dict(apply_overrides(cfg.model_dump(mode="json"), overrides))


def project_separate(cfg: Config, gpus: int, r) -> dict:
    """Seconds of each part of one iteration on ``gpus`` GPUs of which every node's ``rollout.gpus``
    run the engines (``separate_config``) and the others the trainer, synchronous and asynchronous
    totals; ConfigError when the layout cannot run."""
    cfg = separate_config(cfg, r)
    hf, _ = resolve_architecture(cfg)
    arch = Architecture.from_hf(hf)
    if gpus % r.gpus_per_node:
        raise ConfigError(f"{gpus} GPUs are not whole nodes of --gpus-per-node {r.gpus_per_node}")
    per_node = r.gpus_per_node - len(cfg.rollout.gpus)
    trainer_gpus = gpus // r.gpus_per_node * per_node
    plan = memory_plan(cfg, trainer_gpus, 80.0, nproc_per_node=per_node)
    engines = plan.engine_gpus // cfg.rollout.tensor_parallel_size
    logprob, update = training_seconds(cfg, arch, plan, trainer_gpus, trainer_gpus <= per_node, r)
    model_bytes = arch.total_params * DTYPE_BYTES[cfg.model.dtype]
    parts = {
        "rollout": rollout_seconds(cfg, arch, plan, engines, r),
        "offload": 0.0,  # nothing is offloaded, no engine sleeps
        "logprob": logprob,
        "update": update,
        "sync": model_bytes / (r.sync_gbps * 1e9) + model_bytes / (r.broadcast_gbps * 1e9),
    }
    tokens = sum(r.prompt_tokens + x for x in response_lengths(cfg, r))
    out = {**parts, "tokens": tokens, "trainer_gpus": trainer_gpus, "engine_gpus": plan.engine_gpus,
           "engines": engines, "fits": plan.fits}
    for mode, asynchronous in (("sync", False), ("async", True)):
        total = iteration_seconds(parts, asynchronous)
        out[f"total_{mode}"] = total
        out[f"tokens_per_s_per_gpu_{mode}"] = tokens / total / gpus
    return out


def report(path: str, gpu_counts: list[int], r, overrides: list[str]) -> None:
    cfg = load_config(path, overrides)
    arch = Architecture.from_hf(resolve_architecture(cfg)[0])
    s, t = cfg.rollout.sampling, cfg.rollout.tensor_parallel_size
    lengths = response_lengths(cfg, r)
    print(f"\n{Path(path).stem}: {cfg.trainer.prompts_per_iteration} prompts x {s.n} samples of "
          f"{r.prompt_tokens} + {sum(lengths) / len(lengths):.0f} tokens on average (responses drawn with mean "
          f"{r.mean_response or s.max_response_length / 2:.0f}, CV {r.response_cv}, cut at {s.max_response_length}); "
          f"{arch.total_params / 1e9:.2f}B parameters, {active_params(arch) / 1e9:.2f}B active; rollout TP{t}")
    print(f"{'GPUs':>5} {'layout, rollout engines':<38} " + " ".join(f"{p:>8}" for p in PARTS)
          + f" {'total s':>8} {'tok/s/GPU':>10}  plan")

    def row(gpus: int, label: str, p: dict, total: float, fits: bool) -> None:
        print(f"{gpus:5d} {label:<38} " + " ".join(f"{p[k]:8.1f}" for k in PARTS)
              + f" {total:8.1f} {p['tokens'] / total / gpus:10.0f}  "
              + ("fits" if fits else "DOES NOT FIT (megatron-alp plan)"))

    for gpus in gpu_counts:
        if cfg.rollout.placement == "colocated":
            plan = memory_plan(cfg, gpus, 80.0)
            for engines in (1, gpus // t):
                p = project(cfg, gpus, engines, r, plan)
                row(gpus, f"colocated, {engines} x TP{t}" + (" (one)" if engines == 1 else ""), p, p["total"], p["fits"])
        try:
            p = project_separate(cfg, gpus, r)
        except ConfigError as err:
            print(f"{gpus:5d} {'separate':<38} layout cannot run: {str(err).splitlines()[-1].strip()}")
            continue
        split = f"separate {p['trainer_gpus']}T+{p['engine_gpus']}E, {p['engines']} x TP{t}"
        row(gpus, f"{split}, sync", p, p["total_sync"], p["fits"])
        row(gpus, f"{split}, async", p, p["total_async"], p["fits"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("configs", nargs="*", default=CONFIGS, help="shipped configs to project")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256], help="GPU counts (H100 80 GB)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, applied to every config")
    for name, default, source in ASSUMPTIONS:
        ap.add_argument("--" + name.replace("_", "-"), dest=name, type=type(default), default=default, help=source)
    args = ap.parse_args(argv)
    r = Rates(**{name: getattr(args, name) for name, _, _ in ASSUMPTIONS})
    print("PROJECTED, not measured: every rate below is an assumption (python benchmarks/scaling_model.py --help)")
    print(f"separate: per {r.gpus_per_node}-GPU node {r.engine_gpus_per_node} engine GPUs (E) at "
          f"gpu_memory_utilization {r.separate_utilization}, the rest trainer GPUs (T); sync: max_staleness 0, "
          "async: max_staleness 1 = max(rollout, logprob + update) + sync; offload 0")
    for path in args.configs:
        report(path if Path(path).exists() else str(ROOT / path), args.gpus, r, args.overrides)
    print("\nMEASURED by NVIDIA with NeMo-RL on its own setups (published, for comparison; not this repository):")
    for model, gpus, rate, what in NEMO_RL:
        print(f"  {model:<14} {gpus:3d} H100  {rate:5d} tok/s/GPU  (NeMo-RL {what})")
    print("MEASURED by verl's authors (published):")
    for gpus, what in VERL_FULLY_ASYNC:
        print(f"  Qwen2.5-Math-7B {gpus:3d} H20   {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
