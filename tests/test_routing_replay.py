"""MoE routing replay (moe.routing_replay, perturbation.moe_routing) and the moe/* metrics.

The multi-rank checks (tests/dist/check_routing_replay.py: EP=2 x DP=2, TP=2 with sequence
parallelism, PP=2, on a tiny Qwen3-MoE) run once per session; the single-process tests pin the
alignment of a replayed routing to its token with the causal mask: replaying other experts for
token j alone changes the logprobs at positions >= j and none before.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import dist_job, read_results

from megatron_alp.config import ModelConfig, ParallelConfig
from megatron_alp.models.families import hf_to_megatron
from megatron_alp.models.routing import no_expert
from megatron_alp.models.tiny import tiny_hf_config
from megatron_alp.resolve import config_from_dict
from megatron_alp.runtime.parallel import init_distributed
from megatron_alp.training.builder import build_gpt_model
from megatron_alp.training.calibration import probe_routing, probe_sequences
from megatron_alp.training.layer_states import megatron_layer_states
from megatron_alp.training.micro_batch import Batching
from megatron_alp.training.policy_update import compute_logprobs
from megatron_alp.training.rl_batch import RLBatch
from megatron_alp.training.routing_replay import PassRouting, RoutingPlan, routing_metrics

LAYOUTS = ("ep2", "tp2", "pp2")


REPLAY = dist_job("routing_replay", "check_routing_replay.py", "{dir}/result.json", timeout=900)


@pytest.fixture(scope="module")
def replay(dist_jobs):
    return read_results(dist_jobs.run("routing_replay") / "result.json")


@REPLAY
@pytest.mark.parametrize("layout", LAYOUTS)
def test_r2_update_logprobs_equal_old_logprobs_bit_for_bit(replay, layout):
    """R2 with perturbation.init_std 0: the update pass replays the old pass's experts, and its
    logprobs are the old pass's exactly; replaying other experts (each shifted by one) changes them,
    so the replay is what the pass used."""
    r = replay[f"{layout}/r2_exact"]
    assert r["bitwise_equal"] and r["max_diff"] == 0.0, r
    assert r["shifted_max_diff"] > 1e-3, r
    m = r["metrics"]
    assert m["moe/replayed_frac"] == 1.0 and m["moe/update_flip_frac"] == 0.0 and m["moe/noise_flip_frac"] == 0.0
    assert m["moe/expert_load"] >= 1.0 and m["moe/expert_load_worst_layer"] >= m["moe/expert_load"]
    assert 0.5 < m["moe/aux_loss"] < 4.0, m  # 1 at perfect balance, at most E/k = 4
    stage_layers = [0, 1] if layout == "pp2" else [0, 1, 2, 3]
    assert r["recorded_layers"] == stage_layers  # rank 0 records the layers of its pipeline stage
    rows_and_micro = [tuple(x) for x in r["rows_and_micro_batches"]]
    # (rows, micro-batches that reached the loss) per rank. EP=2 x DP=2 with one sequence on rank 0
    # and seven on rank 1: rank 0 runs three fillers so that both run every all-to-all. Without data
    # parallelism both ranks hold the eight rows; under PP=2 only the last stage computes the loss.
    expected = {"ep2": [(1, 4), (7, 4)], "tp2": [(8, 4), (8, 4)], "pp2": [(8, 0), (8, 4)]}[layout]
    assert rows_and_micro == expected


@REPLAY
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ("fixed", "follow"))
def test_replay_survives_recomputation(replay, layout, mode):
    """Full activation recomputation re-runs every router in the backward: the recomputed routers
    take the experts of their forward (PP=2's 1F1B recomputes micro-batch 0 after micro-batch 1's
    forward), so the update is the same as without recomputation."""
    r = replay[f"{layout}/recompute"][mode]
    none, full = r["recomputed_router_calls"]
    assert none == 0 and full > 0, r
    assert r["grad_norm"][0] == r["grad_norm"][1], r
    assert r["logprob_diff"] == 0.0, r
    flips = r["update_flip_frac"]
    assert flips[0] == flips[1]
    assert (flips[0] == 0.0) if mode == "fixed" else (flips[0] > 0.0)


@REPLAY
@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_routing_reaches_the_replay_through_packing_and_sharding(replay, layout):
    """R3's data path with routing given by the test: from trajectories through build_rl_batch, an
    uneven data-parallel split and packed micro-batches to every router; each sequence's
    logprobs equal those of the sequence replayed alone. The given routing matters (replaying it
    moves logprobs by > 1e-2 against the model's own routing) and the agreement metric tells a
    routing equal to the router's own (1.0) from a random one (chance: 1 / C(8, 2))."""
    r = replay[f"{layout}/r3_packing"]
    assert r["packed_vs_alone"] < 1e-5, r
    assert r["replay_vs_free"] > 1e-2, r
    assert r["agreement_own"] == 1.0, r
    assert abs(r["agreement_random"] - 1 / 28) < 0.03, r


@REPLAY
def test_noise_flips_routing_under_follow_not_under_fixed(replay):
    """sigma vs the fraction of (token, layer) whose experts the ALP noise changes in the update
    pass (EP=2): under `fixed` the experts used never differ from the unperturbed pass's, under
    `follow` they flip, more with larger sigma."""
    table = replay["ep2/flip_table"]
    print("\nsigma     follow: flips  |log ratio|max   fixed: flips  router's own choice changed")
    for row in table:
        f, x = row["follow"], row["fixed"]
        print(f"{row['sigma']:<8g}  {f['update_flip_frac']:>13.4f}  {f['max_abs_log_ratio']:>14.4f}"
              f"   {x['update_flip_frac']:>12.4f}  {x['noise_flip_frac']:>27.4f}")
    follow = [row["follow"]["update_flip_frac"] for row in table]
    assert all(row["fixed"]["update_flip_frac"] == 0.0 for row in table)
    assert all(b > a for a, b in zip(follow, follow[1:])), follow
    assert follow[0] < 0.05 and follow[-1] > 0.5, follow
    for row in table:  # under follow the experts used are the perturbed router's own choice
        assert row["follow"]["update_flip_frac"] == row["follow"]["noise_flip_frac"]


# ------------------------------------------------------------------------------ one process


@pytest.fixture(scope="module")
def moe_model():
    init_distributed(ParallelConfig(), seed=3)
    args = hf_to_megatron(tiny_hf_config("qwen3_moe", num_experts=8))
    model = build_gpt_model(args, ModelConfig(tiny="qwen3_moe", dtype="float32", layer_spec="local"),
                            ParallelConfig())
    return model


def _one_sequence(n: int = 12) -> RLBatch:
    tokens = torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(11))
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
    mask = torch.ones(1, n)
    mask[0, -1] = 0
    return RLBatch(tokens, targets, mask, torch.zeros(1, n), torch.zeros(1), torch.tensor([n]))


def test_a_replayed_routing_acts_on_its_own_token(moe_model):
    """Replay the router's own experts everywhere except token j of one layer: the logprobs at
    positions < j (which cannot see token j) stay bit-identical, the one at j changes; a routing
    shifted by one position would break one of the two."""
    batch = _one_sequence()
    own = compute_logprobs(moe_model, batch, batching=Batching(size=1), temperature=1.0, pad_id=0,
                           routing=PassRouting(record=True))
    recorded = batch.old_routing.clone()
    assert recorded.shape == (1, 12, 4, 2) and recorded.dtype == torch.uint8
    assert (recorded[0, :, :, 0] != recorded[0, :, :, 1]).all()  # top-2: two distinct experts
    for j in (3, 7):
        changed = recorded.clone()
        changed[0, j, 1] = (changed[0, j, 1] + 1) % 8  # token j, layer 1: other experts
        batch.rollout_routing = changed
        lp = compute_logprobs(moe_model, batch, batching=Batching(size=1), temperature=1.0, pad_id=0,
                              routing=PassRouting(replay="rollout_routing"))
        assert torch.equal(lp[0, :j], own[0, :j]), j
        assert (lp[0, j] - own[0, j]).abs() > 1e-6, j


def test_tokens_without_given_routing_route_on_their_own(moe_model):
    """The no-expert marker (padding, the token the engine never fed back) leaves a token to its
    router: replaying a routing that gives none reproduces the unreplayed pass exactly."""
    batch = _one_sequence()
    own = compute_logprobs(moe_model, batch, batching=Batching(size=1), temperature=1.0, pad_id=0)
    batch.rollout_routing = torch.full((1, 12, 4, 2), no_expert(torch.uint8), dtype=torch.uint8)
    lp = compute_logprobs(moe_model, batch, batching=Batching(size=1), temperature=1.0, pad_id=0,
                          routing=PassRouting(replay="rollout_routing", agreement=True))
    assert torch.equal(lp, own)
    assert "moe/rollout_agreement" not in routing_metrics(moe_model)  # nothing to compare with


def test_a_replay_naming_a_missing_expert_is_refused(moe_model):
    batch = _one_sequence()
    batch.rollout_routing = torch.full((1, 12, 4, 2), 9, dtype=torch.uint8)
    with pytest.raises(ValueError, match="rollout_routing names expert 9, but the model has 8 experts"):
        compute_logprobs(moe_model, batch, batching=Batching(size=1), temperature=1.0, pad_id=0,
                         routing=PassRouting(replay="rollout_routing"))


def test_r3_without_engine_routing_names_the_keys(moe_model):
    with pytest.raises(RuntimeError, match="moe.routing_replay=r3 needs rollout.return_routed_experts"):
        compute_logprobs(moe_model, _one_sequence(), batching=Batching(size=1), temperature=1.0, pad_id=0,
                         routing=PassRouting(replay="rollout_routing"))


def test_the_layer_probe_replays_the_engines_routing_under_r3(moe_model):
    """N5: under R3 the probe's Megatron forward uses the engine's experts, as the update pass does.
    Given the router's own choice it is the free forward bit for bit; given other experts for token
    3 at layer 1, the input of layer 2 changes from token 3 on and nothing before layer 2 or token 3
    does. The probe takes the engine's routing of its own rows only under R3."""
    batch = _one_sequence()
    compute_logprobs(moe_model, batch, batching=Batching(size=1), temperature=1.0, pad_id=0,
                     routing=PassRouting(record=True))
    own = batch.old_routing.clone()
    changed = own.clone()
    changed[0, 3, 1] = (changed[0, 3, 1] + 3) % 8
    batch.rollout_routing = changed
    sequences = probe_sequences([batch.tokens[0].tolist()], budget=10)
    assert probe_routing(batch, sequences, "old_routing") is None and probe_routing(batch, sequences, None) is None
    given = probe_routing(batch, sequences, "rollout_routing")
    assert len(given) == 1 and torch.equal(given[0], changed[0, :10])

    free = megatron_layer_states(moe_model, sequences, ("input",))[0]["input"]
    as_own = megatron_layer_states(moe_model, sequences, ("input",), routing=[own[0, :10]])[0]["input"]
    replayed = megatron_layer_states(moe_model, sequences, ("input",), routing=given)[0]["input"]
    assert free.shape == (4, 10, moe_model.config.hidden_size)
    assert torch.equal(as_own, free)
    assert torch.equal(replayed[:2], free[:2]) and torch.equal(replayed[2, :3], free[2, :3])
    assert (replayed[2, 3] - free[2, 3]).abs().max() > 1e-6
    batch.rollout_routing = None
    with pytest.raises(RuntimeError, match="rollout.return_routed_experts"):
        probe_routing(batch, sequences, "rollout_routing")


def test_the_aux_loss_metric_is_megatrons_formula(moe_model):
    """moe/aux_loss against the switch load-balancing loss written out from Megatron's definition
    (E / (k T^2) sum_e P_e n_e, P_e the softmax mass, n_e the tokens of the top-k) on the router
    logits of the same forward, per layer."""
    routing_metrics(moe_model)  # start from empty statistics
    batch = _one_sequence()
    logits = {}
    hooks = [layer.mlp.router.register_forward_hook(
        lambda mod, args, out, i=i: logits.__setitem__(i, mod.gating(args[0]).reshape(-1, 8).detach()))
        for i, layer in enumerate(moe_model.decoder.layers)]
    compute_logprobs(moe_model, batch, batching=Batching(size=1), temperature=1.0, pad_id=0,
                     routing=PassRouting(load=True))
    for h in hooks:
        h.remove()
    m = routing_metrics(moe_model)
    expected = []
    for i in range(4):
        x = logits[i][:-1]  # every position but the last
        p = torch.softmax(x.double(), -1)
        n = torch.zeros(8, dtype=torch.float64).scatter_add_(0, x.topk(2).indices.flatten(),
                                                           torch.ones(2 * len(x), dtype=torch.float64))
        expected.append(8 / (2 * len(x) ** 2) * (p.sum(0) * n).sum().item())
    assert m["moe/aux_loss"] == pytest.approx(sum(expected) / 4, rel=1e-6)  # fp32 softmax in the model
    load = m["moe/expert_load"]
    assert math.isfinite(load) and load >= 1.0


# ----------------------------------------------------------------------------------- the plan


def _cfg(**sections):
    return config_from_dict({"model": {"tiny": "qwen3_moe"}, **sections})


@pytest.mark.parametrize("replay, loss, moe_routing, expected", [
    ("none", "grpo", None, (None, None, None, False)),
    ("none", "alp_token", None, (None, None, None, False)),  # follow: the perturbed router chooses
    ("none", "alp_token", "fixed", (None, None, "old_routing", True)),
    ("r2", "grpo", None, (None, "old_routing", "old_routing", True)),
    ("r2", "alp_seq", None, (None, "old_routing", "old_routing", True)),
    ("r3", "alp_token", None, ("rollout_routing", "rollout_routing", "rollout_routing", False)),
])
def test_which_pass_replays_what(replay, loss, moe_routing, expected):
    pert = {} if moe_routing is None else {"moe_routing": moe_routing}
    plan = RoutingPlan.for_config(_cfg(moe={"routing_replay": replay}, loss={"name": loss}, perturbation=pert))
    assert (plan.old.replay, plan.ref.replay, plan.update.replay, plan.needs_old_pass) == expected
    assert plan.old.record and plan.update.flips and plan.update.load


# ------------------------------------------------------------------------------------ GPU: R3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU: vLLM returns routed experts only "
                                                          "from its Model Runner V2 (Triton, CUDA)")
def test_r3_end_to_end_with_vllm(tmp_path):
    """vLLM samples a tiny Qwen3-MoE and returns the experts of every token it fed through the model;
    they travel with the trajectories into the trainer's passes. The trainer's own router agrees
    with the engine on almost every (token, layer) pair (same weights, both fp32), and
    replaying the engine's routing brings the trainer's logprobs no further from the engine's than
    its own routing does."""
    from megatron_alp.config import RolloutConfig, SamplingConfig
    from megatron_alp.data.trajectory import Trajectory
    from megatron_alp.models.hf_weights import load_hf_weights
    from megatron_alp.models.tiny import make_tiny_model
    from megatron_alp.rollout import SamplingParams, build_engine
    from megatron_alp.training.rl_batch import build_rl_batch

    init_distributed(ParallelConfig(), seed=3)  # first, as the trainer: an in-process engine adopts the group
    hf = dict(num_experts=8, num_experts_per_tok=2)
    model_dir = make_tiny_model("qwen3_moe", tmp_path / "moe", seed=3, **hf)
    cfg = RolloutConfig(dtype="float32", max_model_len=256, return_routed_experts=True, gpu_memory_utilization=0.3,
                        sampling=SamplingConfig(max_prompt_length=64, max_response_length=64))
    engine = build_engine(cfg, str(model_dir), seed=0)
    try:
        prompts = [[1, 5, 6, 7, 8, 9], [1, 20, 21], [1, 300, 301, 302, 303, 304, 305, 306]]
        groups = engine.generate(prompts, SamplingParams(n=2, max_tokens=24))
    finally:
        engine.shutdown()
    trajs = [Trajectory.from_completion(c) for g in groups for c in g]
    for t in trajs:
        fed = len(t.prompt_ids) + len(t.response_ids) - 1
        assert t.routed_experts.shape == (fed, 4, 2) and t.routed_experts.dtype.name == "uint8"
        assert (t.routed_experts < 8).all() and (t.routed_experts[..., 0] != t.routed_experts[..., 1]).all()
    model = build_gpt_model(hf_to_megatron(tiny_hf_config("qwen3_moe", **hf)),
                            ModelConfig(hf_path=str(model_dir), dtype="float32", layer_spec="local"), ParallelConfig())
    load_hf_weights(model, model_dir)
    batch = build_rl_batch(trajs, torch.zeros(len(trajs)), pad_id=0)
    keep = batch.loss_mask > 0
    kw = dict(batching=Batching(size=2), temperature=1.0, pad_id=0)
    own = compute_logprobs(model, batch, routing=PassRouting(record=True, agreement=True), **kw)
    agreement = routing_metrics(model)["moe/rollout_agreement"]
    replayed = compute_logprobs(model, batch, routing=PassRouting(replay="rollout_routing"), **kw)
    assert agreement > 0.9, agreement
    engine_lp = batch.rollout_logprobs[keep]
    assert (replayed[keep] - engine_lp).abs().mean() <= (own[keep] - engine_lp).abs().mean() + 1e-6
