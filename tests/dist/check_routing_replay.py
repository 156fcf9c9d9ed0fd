"""MoE routing replay on a tiny Qwen3-MoE (4 layers, 8 experts, top-2) on 2 gloo ranks: expert
parallel (EP=2 x DP=2), tensor parallel with sequence parallelism (TP=2) and pipeline parallel (PP=2).

Per layout:
- r2_exact: the old-policy pass records its routing; the update pass (ALP, sigma = 0) replays it:
  its logprobs equal the old pass's bit for bit, and replaying other experts changes them.
- recompute: one update with R2 under ``fixed`` and under ``follow`` (sigma 0.05), with and without
  full activation recomputation: the same update (PP=2 recomputes micro-batch 0 after micro-batch
  1's forward, 1F1B).
- r3_packing: engine routing given by the test travels from trajectories through the batch, an
  uneven data-parallel split and packed micro-batches into the replay: the logprobs equal those of
  each sequence replayed alone; the router's own choice agrees with a given routing equal to it and
  not with a random one.
Under EP=2 the uneven split (one sequence on rank 0, seven on rank 1) makes rank 0 run fillers, so
both ranks run every MoE all-to-all.
On EP=2 only: the flip table, sigma vs the fraction of (token, layer) whose experts the noise flips
under ``follow`` and ``fixed``.

Usage: torchrun --nproc_per_node 2 check_routing_replay.py RESULT.json
"""

import json
import math
import sys

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from common import full_state, load_full_state, reinit
from megatron_alp.training import policy_update
from megatron_alp.config import LossConfig, ModelConfig, OptimizerConfig, PerturbationConfig
from megatron_alp.training.step_metrics import StepMetrics
from megatron_alp.training.micro_batch import Batching
from megatron_alp.training.builder import build_gpt_model
from megatron_alp.models.families import hf_to_megatron
from megatron_alp.models.routing import RoutingControl
from megatron_alp.models.tiny import tiny_hf_config
from megatron_alp.training.optim import build_optimizer, wrap_for_training
from megatron_alp.training.perturbation import sigma_parameters
from megatron_alp.training.policy_update import compute_logprobs, train_mini_batch
from megatron_alp.training.rl_batch import build_rl_batch, dp_assignment, dp_shard
from megatron_alp.data.trajectory import Trajectory
from megatron_alp.training.routing_replay import PassRouting, routing_metrics

EXPERTS, TOPK, LAYERS = 8, 2, 4
HF = tiny_hf_config("qwen3_moe", num_experts=EXPERTS, num_experts_per_tok=TOPK, num_hidden_layers=LAYERS)
LAYOUTS = {"ep2": dict(tp=1, pp=1, sp=False, ep=2), "tp2": dict(tp=2, pp=1, sp=True, ep=1),
           "pp2": dict(tp=1, pp=2, sp=False, ep=1)}
SIGMAS = (1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
ROWS, PROMPT = 8, 4
LENGTHS = [24, 9, 17, 6, 21, 12, 15, 8]
OLD = PassRouting(record=True, agreement=True)
R2_FIXED = PassRouting(replay="old_routing", flips=True, load=True)
FOLLOW = PassRouting(flips=True, load=True)
LOSS = LossConfig(name="alp_token", kl_coef=0.0, entropy_coef=0.0)


def trajectories(routing=None) -> list[Trajectory]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(3, 512, (n,), generator=g).tolist()
        routed = None if routing is None else routing[i]
        out.append(Trajectory(prompt_ids=ids[:PROMPT], response_ids=ids[PROMPT:], rollout_logprobs=[0.0] * (n - PROMPT),
                              loss_mask=[1] * (n - PROMPT), response_text="", finish_reason="stop",
                              routed_experts=routed))
    return out


def random_routing(seed: int) -> list[np.ndarray]:
    """Engine-like routing: distinct top-k experts per token and layer, the last token missing."""
    rng = np.random.default_rng(seed)
    return [np.stack([[rng.choice(EXPERTS, TOPK, replace=False) for _ in range(LAYERS)] for _ in range(n - 1)])
            .astype(np.uint8) for n in LENGTHS]


def advantages() -> torch.Tensor:
    return torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(ROWS)])


def build(par, sigma=None, recompute="none"):
    pert = PerturbationConfig(enabled=True, init_std=sigma, lr=0.0) if sigma is not None else None
    mcfg = ModelConfig(tiny="qwen3_moe", dtype="float32", layer_spec="local", recompute=recompute)
    return build_gpt_model(hf_to_megatron(HF), mcfg, par, pert), pert


def rows_of(batch_rows: list[int], values, group_rows=True) -> dict:
    """{global row: per-token list} of every rank's last-stage values, on every rank."""
    local = None
    if values is not None and ps.get_tensor_model_parallel_rank() == 0:
        local = {r: values[i, : LENGTHS[r]].tolist() for i, r in enumerate(batch_rows)}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {r: v for p in parts if p for r, v in p.items()}


class Capture:
    """The update pass's logprobs next to the old-policy pass's, per micro-batch (test probe on the
    loss function)."""

    def __init__(self):
        self.pairs = []
        self.inner = policy_update.policy_loss

    def __enter__(self):
        def probe(cfg, inputs):
            keep = inputs.mask > 0
            self.pairs.append((inputs.logprobs.detach()[keep].clone(), inputs.old_logprobs[keep].clone()))
            return self.inner(cfg, inputs)
        policy_update.policy_loss = probe
        return self

    def __exit__(self, *exc):
        policy_update.policy_loss = self.inner

    def bitwise_equal(self) -> bool:
        return all(torch.equal(a, b) for a, b in self.pairs)

    def max_diff(self) -> float:
        """Over every rank (the last pipeline stage holds the loss)."""
        local = max(((a - b).abs().max().item() for a, b in self.pairs if a.numel()), default=0.0)
        t = torch.tensor([local])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()


RECOMPUTED = [0]  # router calls that were recomputations (test probe)
_route = RoutingControl.route


def _counting_route(self, tap, scores, probs, own):
    if self._current is not None and tap.seen == self._index:
        RECOMPUTED[0] += 1
    return _route(self, tap, scores, probs, own)


RoutingControl.route = _counting_route


UNEVEN = [100.0] + [1.0] * (ROWS - 1)  # data-parallel rank 0 gets one sequence, rank 1 the other seven


def local_batch(routing=None, costs=None):
    """This rank's rows: an equal contiguous split without ``costs``, else split by ``costs``."""
    batch = build_rl_batch(trajectories(routing), advantages(), pad_id=0)
    assignment = dp_assignment(ROWS, ps.get_data_parallel_world_size(), 1, costs)
    local, _ = dp_shard(batch, assignment, ps.get_data_parallel_rank())
    return local, assignment[0][ps.get_data_parallel_rank()]


def everywhere(value: bool) -> bool:
    t = torch.tensor([0.0 if value else 1.0])
    dist.all_reduce(t)
    return t.item() == 0.0


def r2_exact(par, init) -> dict:
    model, pert = build(par, sigma=0.0)
    load_full_state(model, init)
    model = wrap_for_training(model, par)
    opt, _ = build_optimizer(model, OptimizerConfig(lr=0.0, min_lr=0.0), pert, par, total_steps=1)
    # uneven shares: under expert parallelism the rank with one sequence runs fillers to keep in step
    local, _ = local_batch(costs=UNEVEN)
    batching = Batching(size=2)
    local.old_logprobs = compute_logprobs(model, local, batching=batching, temperature=1.0, pad_id=0, routing=OLD)
    if local.old_logprobs is None:
        local.old_logprobs = torch.zeros(local.tokens.shape)
    local.rollout_logprobs = local.old_logprobs * local.loss_mask
    with Capture() as replayed:
        train_mini_batch(model, opt, local, loss_cfg=LOSS, step=0, batching=batching, temperature=1.0, pad_id=0,
                         metrics=StepMetrics(), routing=R2_FIXED)
    metrics = routing_metrics(model)
    true_routing = local.old_routing
    local.old_routing = torch.where(true_routing < EXPERTS, (true_routing + 1) % EXPERTS, true_routing)
    with Capture() as shifted:
        train_mini_batch(model, opt, local, loss_cfg=LOSS, step=1, batching=batching, temperature=1.0, pad_id=0,
                         metrics=StepMetrics(), routing=R2_FIXED)
    routing_metrics(model)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, (len(local), len(replayed.pairs)))
    return {"bitwise_equal": everywhere(replayed.bitwise_equal()), "max_diff": replayed.max_diff(),
            "rows_and_micro_batches": counts,
            "shifted_max_diff": shifted.max_diff(), "metrics": metrics,
            "recorded_layers": sorted({int(x) for x in (true_routing < EXPERTS).any(-1).any(0).any(0).nonzero()
                                       .flatten().tolist()})}


def recompute(par, init) -> dict:
    out = {}
    for mode, routing in (("fixed", R2_FIXED), ("follow", FOLLOW)):
        after = {}
        for how in ("none", "full"):
            model, pert = build(par, sigma=0.05, recompute=how)
            load_full_state(model, init)
            model = wrap_for_training(model, par)
            opt, _ = build_optimizer(model, OptimizerConfig(lr=1e-2, min_lr=1e-2, weight_decay=0.0), pert, par,
                                     total_steps=1)
            local, rows = local_batch()
            batching = Batching(size=1)  # 4 micro-batches per rank: PP=2 runs 1F1B with a warm-up forward
            local.old_logprobs = compute_logprobs(model, local, batching=batching, temperature=1.0, pad_id=0,
                                                  routing=OLD)
            if local.old_logprobs is None:
                local.old_logprobs = torch.zeros(local.tokens.shape)
            local.rollout_logprobs = local.old_logprobs * local.loss_mask
            RECOMPUTED[0] = 0
            stats = train_mini_batch(model, opt, local, loss_cfg=LOSS, step=0, batching=batching, temperature=1.0,
                                     pad_id=0, metrics=StepMetrics(), routing=routing)
            metrics = routing_metrics(model)
            lp = compute_logprobs(model, local, batching=batching, temperature=1.0, pad_id=0)
            after[how] = {"grad_norm": stats["grad_norm"], "logprobs": rows_of(rows, lp), "metrics": metrics,
                          "recomputed_router_calls": RECOMPUTED[0]}
        a, b = after["none"], after["full"]
        diff = max(abs(x - y) for r in a["logprobs"] for x, y in zip(a["logprobs"][r], b["logprobs"][r]))
        out[mode] = {"grad_norm": [a["grad_norm"], b["grad_norm"]], "logprob_diff": diff,
                     "update_flip_frac": [a["metrics"].get("moe/update_flip_frac"),
                                          b["metrics"].get("moe/update_flip_frac")],
                     "recomputed_router_calls": [a["recomputed_router_calls"], b["recomputed_router_calls"]]}
    return out


def r3_packing(par, init) -> dict:
    model, _ = build(par)
    load_full_state(model, init)
    model = wrap_for_training(model, par)
    r3 = PassRouting(replay="rollout_routing", record=True, agreement=True)
    given = random_routing(seed=5)
    # reference: every sequence alone in its micro-batch, rows split equally
    alone, alone_rows = local_batch(given)
    ref = compute_logprobs(model, alone, batching=Batching(size=1), temperature=1.0, pad_id=0, routing=r3)
    ref_rows = rows_of(alone_rows, ref)
    random_agreement = routing_metrics(model).get("moe/rollout_agreement")
    free = compute_logprobs(model, alone, batching=Batching(size=1), temperature=1.0, pad_id=0, routing=OLD)
    free_rows = rows_of(alone_rows, free)
    routing_metrics(model)
    own = [alone.old_routing[i, : LENGTHS[r] - 1].numpy() for i, r in enumerate(alone_rows)]
    own_parts = [None] * dist.get_world_size()
    dist.all_gather_object(own_parts, dict(zip(alone_rows, own)))
    own_by_row = {}
    for part in own_parts:  # pipeline stages each hold their own layers (the rest: the no-expert marker)
        for r, v in part.items():
            own_by_row[r] = np.minimum(own_by_row[r], v) if r in own_by_row else v
    # packed rows of an uneven split (expert parallelism: fillers keep the ranks' micro-batch counts equal)
    packed, packed_rows = local_batch(given, costs=UNEVEN)
    batching = Batching(max_tokens=30, pack=True)
    got = compute_logprobs(model, packed, batching=batching, temperature=1.0, pad_id=0, routing=r3)
    got_rows = rows_of(packed_rows, got)
    routing_metrics(model)
    # the trainer's own routing given as the engine's: the router agrees with it
    mine, mine_rows = local_batch([own_by_row[r] for r in range(ROWS)], costs=[float(n) for n in LENGTHS])
    compute_logprobs(model, mine, batching=batching, temperature=1.0, pad_id=0, routing=r3)
    own_agreement = routing_metrics(model).get("moe/rollout_agreement")

    def diff(a, b):
        return max(abs(x - y) for r in a for x, y in zip(a[r][: LENGTHS[r] - 1], b[r][: LENGTHS[r] - 1]))

    return {"packed_vs_alone": diff(got_rows, ref_rows), "replay_vs_free": diff(ref_rows, free_rows),
            "agreement_random": random_agreement, "agreement_own": own_agreement}


def flip_table(par, init) -> list[dict]:
    model, pert = build(par, sigma=1e-4)
    load_full_state(model, init)
    model = wrap_for_training(model, par)
    opt, _ = build_optimizer(model, OptimizerConfig(lr=0.0, min_lr=0.0), pert, par, total_steps=1)
    local, _ = local_batch()
    batching = Batching(size=2)
    local.old_logprobs = compute_logprobs(model, local, batching=batching, temperature=1.0, pad_id=0, routing=OLD)
    local.rollout_logprobs = local.old_logprobs * local.loss_mask
    routing_metrics(model)
    table = []
    for sigma in SIGMAS:
        for p in sigma_parameters(model):
            p.data.fill_(math.log(sigma))
        row = {"sigma": sigma}
        for mode, routing in (("follow", FOLLOW), ("fixed", R2_FIXED)):
            with Capture() as cap:
                train_mini_batch(model, opt, local, loss_cfg=LOSS, step=0, batching=batching, temperature=1.0,
                                 pad_id=0, metrics=StepMetrics(), routing=routing)
            m = routing_metrics(model)
            row[mode] = {"noise_flip_frac": m["moe/noise_flip_frac"], "update_flip_frac": m["moe/update_flip_frac"],
                         "max_abs_log_ratio": cap.max_diff()}
        table.append(row)
    return table


def main() -> None:
    init = full_state(build(reinit())[0])
    results = {}
    for name, spec in LAYOUTS.items():
        par = reinit(spec["tp"], spec["pp"], spec["sp"], ep=spec["ep"])
        results[f"{name}/r2_exact"] = r2_exact(par, init)
        results[f"{name}/recompute"] = recompute(par, init)
        results[f"{name}/r3_packing"] = r3_packing(par, init)
        if name == "ep2":
            results["ep2/flip_table"] = flip_table(par, init)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


main()
