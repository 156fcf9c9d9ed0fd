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

And the layer probe of ``calibration_mode: per_layer_added`` (DP=2, TP=2 with sequence
parallelism): the "engine" is the model with a drift delta of the script's own added to layer 2's
input (a hook, in the one-rank layout), so it adds drift before layer 2 only; the probe's drift per
layer (added, and cumulative as ``per_layer`` measures it) and delta's robust RMS by the script's
arithmetic.

Usage: torchrun --nproc_per_node 2 check_calibration.py RESULT.json
"""

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from common import build, full_state, load_full_state, reinit
from megatron_alp.training.calibration import calibrate_sigma, input_divergence
from megatron_alp.config import PerturbationConfig
from megatron_alp.training.layer_states import megatron_layer_states
from megatron_alp.training.micro_batch import Batching
from megatron_alp.training.perturbation import sigma_stats
from megatron_alp.training.policy_update import compute_logprobs
from megatron_alp.training.rl_batch import RLBatch, dp_assignment, dp_shard

LAYOUTS = {"dp2": dict(tp=1, pp=1), "pp2": dict(tp=1, pp=2), "tp2_sp": dict(tp=2, pp=1, sp=True)}
ROWS, PROMPT, RESPONSE, VOCAB = 32, 4, 20, 512
BATCHING = Batching(size=4)
PROBE_STEPS = tuple(range(101, 109))
PROBE_LENGTHS, DRIFT_LAYER, DRIFT = (7, 10), 2, 1e-2  # odd length: padded for the sequence-parallel split


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


def drifting_engine(init: dict) -> tuple[list[list[int]], list[dict], float]:
    """The probe sequences, the "engine's" layer inputs of them (the model plus delta at layer
    DRIFT_LAYER's input, one rank's layout) and delta's robust RMS: sqrt(median over dimensions of
    the mean over all tokens of delta^2)."""
    g = torch.Generator().manual_seed(5)
    sequences = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROBE_LENGTHS]
    model = build("qwen2", reinit(), PerturbationConfig(enabled=True, init_std=1e-4))
    load_full_state(model, init)
    hidden = model.config.hidden_size
    deltas = [DRIFT * torch.randn(n, hidden, generator=g) for n in PROBE_LENGTHS]
    current = {}

    def add(module, args, kwargs):
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] + current["delta"][:, None]}

    hook = model.decoder.layers[DRIFT_LAYER].register_forward_pre_hook(add, with_kwargs=True)
    engine = []
    for sequence, delta in zip(sequences, deltas):
        current["delta"] = delta
        engine += megatron_layer_states(model, [sequence], ("input",))
    hook.remove()
    squares = torch.cat(deltas).double().square().mean(dim=0)
    return sequences, engine, float(squares.median().sqrt())


def added_drift(layout: str, init: dict, sequences: list[list[int]], engine: list[dict]) -> dict:
    spec = LAYOUTS[layout]
    model = build("qwen2", reinit(tp=spec["tp"], pp=1, sp=spec.get("sp", False)),
                  PerturbationConfig(enabled=True, init_std=1e-4))
    load_full_state(model, init)
    layers = [0, 1, 2, 3]
    fed = megatron_layer_states(model, sequences, ("input",), fed=[e["input"] for e in engine], at=tuple(layers))
    own = megatron_layer_states(model, sequences, ("input",))
    return {"added": input_divergence(engine, fed, layers), "cumulative": input_divergence(engine, own, layers)}


def main() -> None:
    init = full_state(build("qwen2", reinit()))
    results = {f"{layout}/1": calibrate(layout, init, 1.0) for layout in LAYOUTS}
    results["dp2/4"] = calibrate("dp2", init, 4.0)
    sequences, engine, delta_rms = drifting_engine(init)
    for layout in ("dp2", "tp2_sp"):
        results[f"added/{layout}"] = {**added_drift(layout, init, sequences, engine), "delta_rms": delta_rms}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)


main()
