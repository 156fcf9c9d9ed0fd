"""``perturbation.init_std: auto`` on 2 gloo ranks (DP=2, PP=2, TP=2 with sequence parallelism).

The "engine" is the same tiny Qwen2 with its weights rounded to bfloat16 (a real source of
mismatch: the engine's weights in a lower precision); the batch is 32 random prompt+response
sequences. For each layout the script calibrates, then measures, with its own arithmetic on the
logprobs of every rank (gathered), what the test asserts:

- ``engine_kl``: mean(r - 1 - log r), r = pi_train / pi_engine, over all response tokens;
- ``perturbed_kl``: mean(r - 1 - log r), r = pi_train,sigma / pi_train, for eight noise draws that
  the calibration never used (other perturbation steps);
- whether the unperturbed logprobs after calibration equal those before, bit for bit;
- each rank's sigmas, and the calibration's own metrics.

Usage: torchrun --nproc_per_node 2 check_calibration.py RESULT.json
"""

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from common import build, full_state, load_full_state, reinit
from megatron_alp.training.calibration import calibrate_sigma
from megatron_alp.config import PerturbationConfig
from megatron_alp.training.micro_batch import Batching
from megatron_alp.training.perturbation import sigma_stats
from megatron_alp.training.policy_update import compute_logprobs
from megatron_alp.training.rl_batch import RLBatch, dp_assignment, dp_shard

LAYOUTS = {"dp2": dict(tp=1, pp=1), "pp2": dict(tp=1, pp=2), "tp2_sp": dict(tp=2, pp=1, sp=True)}
ROWS, PROMPT, RESPONSE, VOCAB = 32, 4, 20, 512
BATCHING = Batching(size=4)
PROBE_STEPS = tuple(range(101, 109))


def random_batch() -> RLBatch:
    g = torch.Generator().manual_seed(11)
    length = PROMPT + RESPONSE
    tokens = torch.randint(3, VOCAB, (ROWS, length), generator=g)
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1), value=0)
    mask = torch.zeros(ROWS, length)
    mask[:, PROMPT - 1: length - 1] = 1
    return RLBatch(tokens, targets, mask, torch.zeros(ROWS, length), torch.zeros(ROWS), torch.full((ROWS,), length))


def gathered(lp, mask) -> list[float]:
    """The masked logprobs of every data-parallel rank (from the last stage), in rank order."""
    local = None if lp is None else lp[mask > 0].tolist()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (ps.get_data_parallel_rank(), ps.is_pipeline_last_stage(), local))
    by_rank = {r: v for r, last, v in parts if last}
    return [x for r in sorted(by_rank) for x in by_rank[r]]


def k3(samples_lp: list[float], other_lp: list[float]) -> float:
    d = torch.tensor(other_lp, dtype=torch.float64) - torch.tensor(samples_lp, dtype=torch.float64)
    return float((d.exp() - 1 - d).mean())


def calibrate(layout: str, init: dict, target: float) -> dict:
    spec = LAYOUTS[layout]
    par = reinit(tp=spec["tp"], pp=spec["pp"], sp=spec.get("sp", False))
    engine = build("qwen2", par)
    load_full_state(engine, {k: v.to(torch.bfloat16).float() for k, v in init.items()})
    cfg = PerturbationConfig(enabled=True, init_std="auto", calibration_target=target)
    model = build("qwen2", par, cfg)
    load_full_state(model, init)
    batch, _ = dp_shard(random_batch(), dp_assignment(ROWS, ps.get_data_parallel_world_size()),
                        ps.get_data_parallel_rank())
    passes = dict(batching=BATCHING, temperature=1.0, pad_id=0)
    rollout = compute_logprobs(engine, batch, **passes)
    old = compute_logprobs(model, batch, **passes)
    if ps.is_pipeline_last_stage():
        batch.rollout_logprobs = rollout
        batch.old_logprobs = old
    else:  # earlier stages hold no logprobs; the engine's are needed on every stage
        batch.rollout_logprobs = torch.zeros(batch.tokens.shape)
    metrics = calibrate_sigma(model, batch, cfg, iteration=0, fused=True, **passes)
    after = compute_logprobs(model, batch, **passes)
    probes = [gathered(compute_logprobs(model, batch, perturb_step=s, **passes), batch.loss_mask) for s in PROBE_STEPS]
    old_all, rollout_all = gathered(old, batch.loss_mask), gathered(rollout, batch.loss_mask)
    sigmas = [None] * dist.get_world_size()
    dist.all_gather_object(sigmas, {k: v for k, v in sigma_stats(model).items() if k.endswith("/mean")})
    return {
        "metrics": metrics,
        "engine_kl": k3(rollout_all, old_all),
        "perturbed_kl": [k3(old_all, p) for p in probes],
        "unperturbed_unchanged": gathered(after, batch.loss_mask) == old_all,
        "sigmas": sigmas,
    }


def main() -> None:
    init = full_state(build("qwen2", reinit()))
    results = {f"{layout}/1": calibrate(layout, init, 1.0) for layout in LAYOUTS}
    results["dp2/4"] = calibrate("dp2", init, 4.0)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)


main()
