"""Update-pass time and computed tokens: padded vs token-budget vs packed micro-batches, and the
data-parallel imbalance before/after balancing.

RL responses have long-tailed lengths. ``--sequences`` sequences get a prompt of 30-120 tokens and a
response drawn from a lognormal (median ``--median``, sigma ``--sigma``, capped at ``--cap``). Each
configuration runs the policy update of a random Megatron GPT (Megatron-Core, local spec on the
CPU, one rank) on the whole batch -- forward, backward and one optimizer step with
:func:`~megatron_alp.training.policy_update.train_mini_batch` -- in alternating rounds; the median time per
configuration and the ratio to the padded baseline are printed side by side with computed tokens:

- ``padded``: ``--rows`` rows per micro-batch, longest first (the row-count mode);
- ``budget``: length-sorted padded rows within ``--max-tokens`` computed tokens;
- ``packed``: sequences end to end within ``--max-tokens`` tokens: on the CPU's local spec,
  length-sorted rows that short sequences share, under a block-diagonal causal mask; with
  Transformer Engine (a GPU machine) one THD row per micro-batch.

Then, for each data-parallel size in ``--dp``, the imbalance (max / mean estimated cost per rank) of
the contiguous split and of the LPT-balanced split; and for DP=2 the simulated update time (each
rank's shard is run here in turn, the step takes as long as the slower rank): padded contiguous vs
packed balanced. Target: packed time <= 0.6x padded.

    python benchmarks/bench_packing.py                           # CPU defaults (64 sequences)
    python benchmarks/bench_packing.py --hidden 2048 --layers 16 --dtype bfloat16   # a GPU machine: TE spec
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_alp.algorithms.balance import imbalance, sequence_cost  # noqa: E402
from megatron_alp.config import LossConfig, ModelConfig, OptimizerConfig, ParallelConfig, PerturbationConfig  # noqa: E402
from megatron_alp.models.families import hf_to_megatron  # noqa: E402
from megatron_alp.models.tiny import tiny_hf_config  # noqa: E402
from megatron_alp.runtime.parallel import init_distributed  # noqa: E402
from megatron_alp.training.builder import build_gpt_model  # noqa: E402
from megatron_alp.training.micro_batch import Batching  # noqa: E402
from megatron_alp.training.optim import build_optimizer, wrap_for_training  # noqa: E402
from megatron_alp.training.policy_update import train_mini_batch  # noqa: E402
from megatron_alp.training.rl_batch import RLBatch, dp_assignment, dp_shard  # noqa: E402
from megatron_alp.training.step_metrics import StepMetrics  # noqa: E402


def make_batch(args) -> RLBatch:
    g = torch.Generator().manual_seed(args.seed)
    n = args.sequences
    prompts = torch.randint(30, 121, (n,), generator=g)
    responses = torch.exp(torch.log(torch.tensor(float(args.median))) + args.sigma * torch.randn(n, generator=g))
    responses = responses.round().clamp(1, args.cap).long()
    lengths = prompts + responses
    width = int(lengths.max())
    tokens = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width)
    for i in range(n):
        tokens[i, : lengths[i]] = torch.randint(3, args.vocab, (int(lengths[i]),), generator=g)
        mask[i, prompts[i] - 1: lengths[i] - 1] = 1
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1), value=0)
    adv = torch.randn(n, generator=g)
    lp = -torch.rand(n, width, generator=g) * mask
    return RLBatch(tokens, targets, mask, lp, adv, lengths, old_logprobs=lp.clone())


def build(args):
    init_distributed(ParallelConfig())
    hf = tiny_hf_config("qwen2", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                        num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab,
                        max_position_embeddings=8192)
    margs = hf_to_megatron(hf)
    model = build_gpt_model(margs, ModelConfig(tiny="qwen2", dtype=args.dtype, layer_spec="auto"), ParallelConfig())
    model = wrap_for_training(model, ParallelConfig())
    optimizer, _ = build_optimizer(model, OptimizerConfig(lr=1e-6, min_lr=1e-6, weight_decay=0.0),
                                   PerturbationConfig(), ParallelConfig(), total_steps=10**6)
    return model, optimizer


def update_pass(model, optimizer, batch: RLBatch, batching: Batching) -> tuple[float, int]:
    """Seconds of one policy update on ``batch`` and the tokens it computed (pad tokens included)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    stats = train_mini_batch(model, optimizer, batch, loss_cfg=LossConfig(name="grpo", kl_coef=0.0), step=0,
                             batching=batching, temperature=1.0, pad_id=0, metrics=StepMetrics())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, stats["computed_tokens"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--median", type=int, default=300)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--cap", type=int, default=2048)
    p.add_argument("--rows", type=int, default=4, help="rows per padded micro-batch (trainer.micro_batch_size)")
    p.add_argument("--max-tokens", type=int, default=4096, help="token budget (trainer.max_tokens_per_micro_batch)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dp", type=int, nargs="*", default=[2, 4, 8])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    batch = make_batch(args)
    model, optimizer = build(args)
    ways = {
        "padded": Batching(size=args.rows),
        "budget": Batching(max_tokens=args.max_tokens),
        "packed": Batching(max_tokens=args.max_tokens, pack=True),
    }
    real = int(batch.lengths.sum())
    print(f"{args.sequences} sequences, {real} tokens (lengths {int(batch.lengths.min())}-{int(batch.lengths.max())}, "
          f"median {int(batch.lengths.median())}); model {args.layers} x {args.hidden}, vocab {args.vocab}, {args.dtype}")
    update_pass(model, optimizer, batch, ways["packed"])  # warm-up
    times, computed = {k: [] for k in ways}, {}
    for _ in range(args.reps):
        for name, batching in ways.items():
            seconds, computed[name] = update_pass(model, optimizer, batch, batching)
            times[name].append(seconds)
    results = {"ways": {}, "dp": {}}
    base = statistics.median(times["padded"])
    print(f"{'update pass':<12}{'median s':>10}{'vs padded':>11}{'computed tokens':>17}{'pad frac':>10}")
    for name in ways:
        t, c = statistics.median(times[name]), computed[name]
        results["ways"][name] = {"seconds": t, "ratio": t / base, "computed_tokens": c}
        print(f"{name:<12}{t:>10.2f}{t / base:>10.2f}x{c:>17}{1 - real / c:>10.2f}")

    costs = [sequence_cost(n, args.hidden) for n in batch.lengths.tolist()]
    print(f"\n{'dp':<4}{'imbalance contiguous':>22}{'balanced':>10}   (max / mean estimated cost per rank)")
    for dp in args.dp:
        pair = [imbalance([sum(costs[i] for i in rows) for rows in dp_assignment(len(batch), dp, 1, c)[0]])
                for c in (None, costs)]
        results["dp"][dp] = {"contiguous": pair[0], "balanced": pair[1]}
        print(f"{dp:<4}{pair[0]:>22.3f}{pair[1]:>10.3f}")

    sim = {}
    for name, c, batching in (("padded, contiguous", None, ways["padded"]), ("packed, balanced", costs, ways["packed"])):
        split = dp_assignment(len(batch), 2, 1, c)
        sim[name] = max(update_pass(model, optimizer, dp_shard(batch, split, r)[0], batching)[0] for r in range(2))
    ratio = sim["packed, balanced"] / sim["padded, contiguous"]
    results["dp2_simulated"] = {**sim, "ratio": ratio}
    print("\nDP=2 update step (slower rank; each rank's shard run here in turn):")
    for name, t in sim.items():
        print(f"  {name:<20}{t:>8.2f} s")
    print(f"  packed+balanced / padded+contiguous: {ratio:.2f}x (target <= 0.6x)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
