"""`megatron-alp plan`: per-GPU memory of each phase against sizes computed by hand here, from the
published architectures (parameter formulas written out, bytes per parameter), the shipped configs
fitting their stated hardware, and refusals that name the keys to change."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from helpers import MODELS

from megatron_alp.cli import main
from megatron_alp.config import ConfigError
from megatron_alp.models.families import PUBLISHED
from megatron_alp.plan.layout import default_gpus
from megatron_alp.plan.memory import check_fits, memory_plan
from megatron_alp.resolve import config_from_dict, load_config
from megatron_alp.training import dist_checkpoint

ROOT = Path(__file__).resolve().parents[1]
GPU_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("quickstart"))
GiB = 2**30
H100 = 80.0


def config(name: str, *overrides: str):
    return load_config(ROOT / "configs" / name, list(overrides))


def items(phase) -> dict[str, int]:
    return {i.key: i.nbytes for i in phase.items}


def stated_gpus(path: Path) -> int:
    """The ``--gpus`` of a shipped config's stated hardware: every GPU of its nodes, or with
    ``rollout.placement: separate`` those its ``rollout.gpus`` leave to the trainer."""
    nodes, per_node = map(int, re.search(r"Hardware: (\d+) nodes? x (\d+) H100", path.read_text()).groups())
    r = load_config(path).rollout
    return nodes * (per_node - (len(r.gpus) if r.placement == "separate" else 0))


def test_qwen25_math_15b_on_one_node_by_hand():
    """Dense, tied embeddings, q/k/v biases, TP1 x DP8, no recomputation, a 16384-token micro-batch
    (4 x the 4096-token context), fused linear logprobs."""
    h, heads, kv_heads, d, ffn, layers, vocab = 1536, 12, 2, 128, 8960, 28, 151936
    q, kv = heads * d, kv_heads * d
    layer = h * (q + 2 * kv) + (q + 2 * kv) + q * h + 3 * h * ffn + 2 * h  # qkv + bias, o, gate/up/down, 2 norms
    params = layers * layer + vocab * h + h  # one (tied) embedding, final norm
    assert params == 1_543_714_304  # the published count of Qwen2.5-(Math-)1.5B

    plan = memory_plan(config("qwen2.5-math-1.5b_token_alp.yaml"), gpus=8, gpu_mem_gib=H100)
    train = items(plan.phase("training"))
    tokens = 16384  # trainer.max_tokens_per_micro_batch
    per_token_layer = 2 * (4 * h) + 2 * (2 * q + 2 * kv) + 2 * (3 * ffn)  # norm/linear inputs, Q K V + attn out, SwiGLU
    assert train == {
        "weights": params * 2, "reference": params * 2, "grads": params * 4,
        "optimizer": 12 * -(-params // 8),  # fp32 master + Adam m, v over DP8
        "activations": layers * tokens * per_token_layer,
        "hidden": tokens * h * 2,  # bf16 final hidden states: no [tokens, vocab] logits (fused_linear_logprobs)
        "hidden_grad": tokens * h * 4,  # their fp32 gradient accumulator
        "logprob_chunks": 2 * 2**26 * 4,  # two fp32 chunks alive at once: shifted logits, exp
        "token_stats": tokens * 8 * 4,  # a handful of fp32 statistics per token
        "runtime": 3 * GiB, "engine": 2 * GiB,
    }
    assert per_token_layer == 73216 and plan.phase("training").total == pytest.approx(50.58 * GiB, abs=0.01 * GiB)
    assert plan.phase("training").title == "training (policy update)"
    assert ("micro-batch 16384 tokens (token budget, padded); old/reference logprob passes 32768 tokens "
            "(forward only)") in plan.report()

    roll = items(plan.phase("rollout"))
    engine_weights = params * 2
    assert roll == {"weights": 0, "reference": 0, "grads": 0, "optimizer": 0, "runtime": 3 * GiB,
                    "engine_weights": engine_weights, "engine_workspace": 3 * GiB,
                    "kv_cache": int(0.5 * 80 * GiB) - engine_weights - 3 * GiB}
    assert plan.phase("rollout").resident == ("runtime", "engine_weights", "engine_workspace", "kv_cache")
    kv_per_token = 2 * layers * kv_heads * d * 2
    assert f"{kv_per_token / 1024:.1f} KiB of KV cache per token" in plan.report()
    assert plan.offloaded_bytes == 2 * params * 2 + 12 * -(-params // 8)  # gradients are dropped, not copied
    assert plan.fits and plan.peak == plan.phase("training").total


def test_qwen3_30b_a3b_on_two_nodes_by_hand():
    """MoE with EP8 x expert-DP2 on 16 GPUs, untied embeddings, q/k norms, full recomputation."""
    h, heads, kv_heads, d, layers, vocab = 2048, 32, 4, 128, 48, 151936
    experts, topk, expert_ffn = 128, 8, 768
    q, kv = heads * d, kv_heads * d
    dense_layer = h * (q + 2 * kv) + q * h + 2 * h + 2 * d + h * experts  # attention, norms, q/k norms, router
    expert_layer = experts * 3 * h * expert_ffn
    assert layers * (dense_layer + expert_layer) + 2 * vocab * h + h == 30_532_122_624  # published: 30.5B
    dense = layers * dense_layer + 2 * vocab * h + h  # every rank: TP1, PP1
    expert = layers * expert_layer // 8  # EP8

    plan = memory_plan(config("qwen3-30b-a3b_seq_alp.yaml"), gpus=16, gpu_mem_gib=H100)
    train = items(plan.phase("training"))
    tokens = 2048 + 2048
    one_layer = 2 * 4 * h + 2 * (2 * q + 2 * kv + q + kv) + 8 * experts + 2 * topk * (2 * h + 3 * expert_ffn)
    assert train == {
        "weights": (dense + expert) * 2, "reference": (dense + expert) * 2, "grads": (dense + expert) * 4,
        "optimizer": 12 * (-(-dense // 16) + -(-expert // 2)),  # dense over DP16, experts over expert-DP2
        "activations": layers * tokens * 2 * h + tokens * one_layer,  # layer inputs + one recomputed layer
        "hidden": tokens * h * 2, "hidden_grad": tokens * h * 4, "logprob_chunks": 2 * 2**26 * 4,
        "token_stats": tokens * 8 * 4, "runtime": 3 * GiB, "engine": 2 * GiB,
    }
    megatron_state = sum(train[k] for k in ("weights", "reference", "grads", "optimizer"))
    assert megatron_state == pytest.approx(59.8 * GiB, abs=0.1 * GiB)

    roll = items(plan.phase("rollout"))
    engine_weights = 30_532_122_624 * 2 // 4  # engine TP4
    assert roll["engine_weights"] == engine_weights
    assert roll["kv_cache"] == int(0.45 * 80 * GiB) - engine_weights - 3 * GiB
    kv_per_token = 2 * layers * 1 * d * 2  # 4 KV heads over engine TP4
    assert f"{roll['kv_cache'] // (kv_per_token * tokens)} full-length sequences" in plan.report()
    assert plan.fits

    # On the single node it used to name, Megatron's state alone is ~81 GiB per GPU.
    one_node = memory_plan(config("qwen3-30b-a3b_seq_alp.yaml"), gpus=8, gpu_mem_gib=H100)
    state = sum(items(one_node.phase("training"))[k] for k in ("weights", "reference", "grads", "optimizer"))
    assert state == pytest.approx(81.1 * GiB, abs=0.1 * GiB)
    assert not one_node.fits and one_node.failing == ("training",)
    assert any(a.startswith("--gpus 16 ") for a in one_node.advice)
    # its 4096-token budget is the engine context already, the least the config validation allows
    assert not any("max_tokens_per_micro_batch" in a or "micro_batch_size" in a for a in one_node.advice)


def test_lora_counts_the_frozen_base_and_the_adapters_by_hand():
    """Qwen2.5-32B with rank-64 adapters on every attention and MLP linear, TP4 x DP2: the base weights
    stay, their gradients, optimizer state and reference copy go, and the adapters' come instead
    (column-parallel layers: A whole, B split over TP; row-parallel: A split, B whole)."""
    h, heads, kv_heads, d, ffn, layers = 5120, 40, 8, 128, 27648, 64
    r, tp, dp = 64, 4, 2
    q, kv = heads * d, kv_heads * d
    per_layer = (r * h + r * (q + 2 * kv) // tp) + (r * q // tp + r * h) + (r * h + r * 2 * ffn // tp) + (
        r * ffn // tp + r * h)  # qkv, o, gate/up, down
    adapters = layers * per_layer
    lora = memory_plan(config("qwen2.5-32b_lora_seq_alp.yaml"), 8, H100)
    full = memory_plan(config("qwen2.5-32b_lora_seq_alp.yaml", "lora.enabled=false"), 8, H100)
    t, f = items(lora.phase("training")), items(full.phase("training"))
    assert t["weights"] == f["weights"] + adapters * 2
    assert t["grads"] == adapters * 4 and t["optimizer"] == 12 * -(-adapters // dp)
    assert "reference" not in t and f["reference"] == f["weights"]
    assert lora.fits and not full.fits


def test_pipeline_stages_count_the_fullest():
    """Qwen2.5-32B, TP4 + SP x PP2, one rollout replica. The first stage holds the embedding, two
    micro-batches in flight and the sleeping engine; the last holds the output layer and what turns
    its output into logprobs. At 4096 tokens per micro-batch the first is the fuller; at 32768 the
    last when it makes the logits and their gradient (bf16), the first with fused linear logprobs
    (at 16384), which keep only the hidden states. With a replica on every 4 GPUs both stages hold a sleeping
    engine."""
    h, heads, kv_heads, d, ffn, vocab = 5120, 40, 8, 128, 27648, 152064
    q, kv = heads * d, kv_heads * d
    layer = (h * (q + 2 * kv) + (q + 2 * kv) + q * h + 3 * h * ffn) // 4 + 2 * h  # TP4 splits the matrices
    per_token_layer = 2 * 4 * h / 4 + 2 * (2 * q + 2 * kv) / 4 + 2 * 3 * ffn / 4  # SP splits the norm inputs
    first, last = 32 * layer + vocab * h // 4, 32 * layer + vocab * h // 4 + h  # + final norm

    plan = memory_plan(config("qwen2.5-32b_seq_alp.yaml", "rollout.replicas=1"), gpus=16, gpu_mem_gib=H100)
    train = items(plan.phase("training"))
    assert plan.phase("training").where == "first pipeline stage"
    tokens = 4096
    assert train == {
        "weights": first * 2, "reference": first * 2, "grads": first * 4, "optimizer": 12 * -(-first // 2),
        # 512 x 8 responses / (DP2 x 16 updates) = 128 micro-batches: min(PP2, 128) in flight, each
        # keeping the 32 layer inputs (full recompute, one layer per chunk), plus one layer recomputed
        "activations": int(2 * 32 * tokens * 2 * h / 4 + tokens * per_token_layer),
        "runtime": 3 * GiB, "engine": 2 * GiB,
    }
    assert plan.fits

    unfused = ("trainer.max_tokens_per_micro_batch=32768", "trainer.fused_linear_logprobs=false")
    wide = memory_plan(config("qwen2.5-32b_seq_alp.yaml", *unfused, "rollout.replicas=1"), gpus=16, gpu_mem_gib=H100)
    train = items(wide.phase("training"))
    assert wide.phase("training").where == "last pipeline stage"
    wide_tokens = 8 * 4096
    last_stage = {
        "weights": last * 2, "reference": last * 2, "grads": last * 4, "optimizer": 12 * -(-last // 2),
        "activations": int(32 * wide_tokens * 2 * h / 4 + wide_tokens * per_token_layer),
        "logits": wide_tokens * vocab // 4 * (2 + 2),  # bf16 logits and their bf16 gradient
        "logprob_chunks": 2 * 2**26 * 4,
        "runtime": 3 * GiB,
    }
    assert train == last_stage
    rows = memory_plan(config("qwen2.5-32b_seq_alp.yaml", "trainer.max_tokens_per_micro_batch=null",
                              "trainer.logprob_max_tokens_per_micro_batch=null", "trainer.micro_batch_size=8",
                              "trainer.fused_linear_logprobs=false", "rollout.replicas=1"), gpus=16, gpu_mem_gib=H100)
    assert items(rows.phase("training")) == last_stage  # 8 rows x 4096 = the same 32768 tokens
    assert "micro-batch 8 x 4096 tokens\n" in rows.report()

    tokens = 4 * 4096
    fused = memory_plan(config("qwen2.5-32b_seq_alp.yaml", "trainer.max_tokens_per_micro_batch=16384",
                               "rollout.replicas=1"), gpus=16, gpu_mem_gib=H100)
    assert fused.phase("training").where == "first pipeline stage"
    assert items(fused.phase("training"))["activations"] == int(2 * 32 * tokens * 2 * h / 4 + tokens * per_token_layer)
    # 16 prompts x 8 / (DP2 x 16 updates) = 4 full-length sequences per rank and update: one
    # micro-batch of 16384 tokens, two of 8192
    for budget, in_flight in ((16384, 1), (8192, 2)):
        few = memory_plan(config("qwen2.5-32b_seq_alp.yaml", "trainer.prompts_per_iteration=16", "rollout.replicas=1",
                                 f"trainer.max_tokens_per_micro_batch={budget}"), gpus=16, gpu_mem_gib=H100)
        assert few.phase("training").where == "first pipeline stage"
        assert items(few.phase("training"))["activations"] == int(in_flight * 32 * budget * 2 * h / 4
                                                                  + budget * per_token_layer)

    replicas = memory_plan(config("qwen2.5-32b_seq_alp.yaml", *unfused, "rollout.replicas=4"),
                           gpus=16, gpu_mem_gib=H100)
    assert items(replicas.phase("training")) == {**last_stage, "engine": 2 * GiB}  # GPUs 8-15 hold 2 replicas
    assert "4 replicas" in replicas.layout


# Qwen2.5-Math-1.5B at TP1: hidden size, heads, vocabulary, layers, activation bytes per token and layer
H, HEADS, VOCAB, LAYERS = 1536, 12, 151936, 28
PER_TOKEN_LAYER = 2 * (4 * H) + 2 * (2 * 12 * 128 + 2 * 2 * 128) + 2 * (3 * 8960)


def test_token_budget_sets_the_micro_batch_tokens():
    """With ``max_tokens_per_micro_batch`` the update's micro-batch is that many tokens, whatever
    ``micro_batch_size`` says; without it, ``micro_batch_size`` rows of the engine context."""
    for budget in (4096, 8192, 16384, 24576):
        plan = memory_plan(config("qwen2.5-math-1.5b_grpo.yaml", f"trainer.max_tokens_per_micro_batch={budget}"),
                           8, H100)
        train = items(plan.phase("training"))
        assert train["activations"] == LAYERS * budget * PER_TOKEN_LAYER
        assert (train["hidden"], train["hidden_grad"], train["token_stats"]) == (
            budget * H * 2, budget * H * 4, budget * 8 * 4)
        assert f"micro-batch {budget} tokens (token budget, padded)" in plan.report()
    one_row = memory_plan(config("qwen2.5-math-1.5b_grpo.yaml", "trainer.micro_batch_size=1"), 8, H100)
    assert items(one_row.phase("training"))["activations"] == LAYERS * 16384 * PER_TOKEN_LAYER  # the budget rules

    rows = memory_plan(config("qwen2.5-math-1.5b_grpo.yaml", "trainer.max_tokens_per_micro_batch=null",
                              "trainer.logprob_max_tokens_per_micro_batch=null", "trainer.micro_batch_size=2"), 8, H100)
    assert items(rows.phase("training"))["activations"] == LAYERS * 2 * 4096 * PER_TOKEN_LAYER
    assert "micro-batch 2 x 4096 tokens\n" in rows.report() and "logprob passes" not in rows.report()


def test_local_attention_probs_of_padded_and_packed_micro_batches():
    """Unfused attention (``layer_spec: local``) keeps ``b x heads/TP`` probabilities per layer for
    each row's length squared: padded rows of the 4096-token context under a budget, or one packed
    row of the whole budget (block-diagonal mask over T x T scores). TE's flash attention keeps none."""
    def activations(*overrides):
        plan = memory_plan(config("qwen2.5-math-1.5b_grpo.yaml", *overrides), 8, 400.0)  # room: no advice search
        return items(plan.phase("training"))["activations"]

    local = "model.layer_spec=local"
    flash = LAYERS * 16384 * PER_TOKEN_LAYER
    assert activations(local) == LAYERS * (16384 * PER_TOKEN_LAYER + 2 * HEADS * 4 * 4096**2)  # 4 full rows
    assert activations(local, "trainer.sequence_packing=true") == LAYERS * (
        16384 * PER_TOKEN_LAYER + 2 * HEADS * 16384**2)
    # 8191 tokens: one full row (4096^2) or, worse, two rows of 4095
    assert activations(local, "trainer.max_tokens_per_micro_batch=8191") == LAYERS * (
        8191 * PER_TOKEN_LAYER + 2 * HEADS * 2 * 4095**2)
    rows = ("trainer.max_tokens_per_micro_batch=null", "trainer.logprob_max_tokens_per_micro_batch=null",
            "trainer.micro_batch_size=3")
    assert activations(local, *rows) == LAYERS * (3 * 4096 * PER_TOKEN_LAYER + 2 * HEADS * 3 * 4096**2)
    assert activations("model.layer_spec=te", "trainer.sequence_packing=true") == flash
    assert activations(local, "trainer.sequence_packing=true", "model.recompute=selective") == flash


def test_fused_linear_logprobs_replace_the_logits():
    """The fused path keeps the bf16 hidden states, their fp32 gradient and a few fp32 numbers per
    token in place of the [tokens, vocab/TP] logits and their gradient; without it, the plan that
    does not fit suggests it."""
    tokens = 16384
    fused = memory_plan(config("qwen2.5-math-1.5b_token_alp.yaml"), 8, H100)
    unfused = memory_plan(config("qwen2.5-math-1.5b_token_alp.yaml", "trainer.fused_linear_logprobs=false"), 8, H100)
    a, b = items(fused.phase("training")), items(unfused.phase("training"))
    assert set(b) - set(a) == {"logits"} and set(a) - set(b) == {"hidden", "hidden_grad", "token_stats"}
    assert b["logits"] == tokens * VOCAB * (2 + 2)
    assert (a["hidden"], a["hidden_grad"], a["token_stats"]) == (tokens * H * 2, tokens * H * 4, tokens * 8 * 4)
    assert a["logprob_chunks"] == b["logprob_chunks"] == 2 * 2**26 * 4
    assert unfused.phase("training").total - fused.phase("training").total == tokens * (VOCAB * 4 - H * 6 - 32)
    assert unfused.phase("training").total == pytest.approx(59.71 * GiB, abs=0.01 * GiB)  # the plan before fusing

    small = memory_plan(config("qwen2.5-math-1.5b_token_alp.yaml", "trainer.fused_linear_logprobs=false"), 8, 60.0)
    assert small.failing == ("training",)
    assert small.advice[0].startswith("trainer.fused_linear_logprobs=true  (fits: training 50.58 GiB")
    assert not any("fused_linear_logprobs" in x for x in memory_plan(
        config("qwen2.5-math-1.5b_token_alp.yaml", "trainer.max_tokens_per_micro_batch=32768"), 8, H100).advice)


def test_failing_budget_suggests_a_smaller_budget_not_below_the_context():
    big = memory_plan(config("qwen2.5-math-1.5b_grpo.yaml", "trainer.max_tokens_per_micro_batch=32768"), 8, H100)
    assert big.failing == ("training",)
    assert items(big.phase("training"))["activations"] == LAYERS * 32768 * PER_TOKEN_LAYER
    assert any(x.startswith("trainer.max_tokens_per_micro_batch=16384  (fits") for x in big.advice)
    assert not any("micro_batch_size" in x for x in big.advice)  # ignored under a budget
    odd = memory_plan(config("qwen2.5-math-1.5b_grpo.yaml", "trainer.max_tokens_per_micro_batch=6000"), 8, 30.0)
    assert odd.failing == ("training",)
    assert any(x.startswith("trainer.max_tokens_per_micro_batch=4096  (fits") for x in odd.advice)  # 3000 < 4096


def test_forward_only_logprob_passes_count_when_their_budget_makes_them_fuller():
    """The old/reference passes keep no activations for a backward: one layer's, and the output
    without its gradient, at ``logprob_max_tokens_per_micro_batch`` tokens."""
    lp = 131072
    plan = memory_plan(config("qwen2.5-math-1.5b_grpo.yaml", "trainer.fused_linear_logprobs=false",
                              f"trainer.logprob_max_tokens_per_micro_batch={lp}"), 8, H100)
    training = plan.phase("training")
    assert training.title == "training (old/reference logprob pass)"
    train = items(training)
    assert {k: train[k] for k in ("activations", "logits", "logprob_chunks")} == {
        "activations": lp * PER_TOKEN_LAYER, "logits": lp * VOCAB * 2, "logprob_chunks": 2 * 2**26 * 4}
    assert "hidden" not in train and "hidden_grad" not in train
    fused = memory_plan(config("qwen2.5-math-1.5b_grpo.yaml", f"trainer.logprob_max_tokens_per_micro_batch={lp}"),
                        8, H100)
    assert fused.phase("training").title == "training (policy update)"  # hidden states only: the update is fuller
    small = memory_plan(config("qwen2.5-math-1.5b_grpo.yaml", "trainer.fused_linear_logprobs=false",
                               f"trainer.logprob_max_tokens_per_micro_batch={lp}"), 8, 64.0)
    assert small.problems[0].startswith("training (old/reference logprob pass) needs 65.19 GiB")
    assert any(x.startswith(f"trainer.logprob_max_tokens_per_micro_batch={lp // 2}  (fits") for x in small.advice)


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_gpu_config_fits_its_stated_hardware(path):
    plan = check_fits(load_config(path), stated_gpus(path), H100)
    assert plan.fits and plan.peak <= 0.95 * H100 * GiB


def test_refusal_names_the_keys_and_exits_2(capsys):
    """Qwen2.5-32B at TP1 on one 80 GiB GPU: `megatron-alp plan` prints the plan, then refuses."""
    oversized = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                 "parallel.sequence_parallel=false", "rollout.tensor_parallel_size=1"]
    code = main(["plan", "configs/qwen2.5-32b_seq_alp.yaml", *oversized, "--gpus", "1"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "DOES NOT FIT" in out and "optimizer state" in out
    assert err.startswith("megatron-alp plan: error: the memory plan does not fit 1 GPU of 80 GiB")
    assert "training (policy update) needs" in err and "vLLM refuses to start" in err
    assert "parallel.tensor_model_parallel_size=" in err and "--gpus 16" in err
    with pytest.raises(ConfigError, match="parallel.tensor_model_parallel_size"):
        check_fits(config("qwen2.5-32b_seq_alp.yaml", *oversized), 1, H100)


def test_the_plan_judges_a_config_for_gpus_even_on_a_cpu_machine(capsys):
    """Issue 37 N2: per_layer calibration without an eager engine cannot run on GPUs; the plan, made
    on a laptop for a cluster, refuses it as the GPU job would, naming the key."""
    per_layer = ["perturbation.init_std=auto", "perturbation.calibration_mode=per_layer"]
    code = main(["plan", "configs/qwen2.5-math-1.5b_token_alp.yaml", *per_layer])
    assert code == 2 and "rollout.enforce_eager: true" in capsys.readouterr().err
    assert main(["plan", "configs/qwen2.5-math-1.5b_token_alp.yaml", *per_layer, "rollout.enforce_eager=true"]) == 0


def test_offload_keys_decide_what_stays_resident_during_rollout():
    """Without offloading, Qwen2.5-32B's state stays beside the engine and vLLM cannot wake."""
    keep = ["rollout.offload_weights=false", "rollout.offload_grads=false", "rollout.offload_optimizer=false"]
    plan = memory_plan(config("qwen2.5-32b_seq_alp.yaml", "rollout.replicas=1", *keep), gpus=16, gpu_mem_gib=H100)
    train, roll = items(plan.phase("training")), items(plan.phase("rollout"))
    # the one engine sits on the first pipeline stage, which is also training's fullest
    assert plan.phase("training").where == "first pipeline stage"
    assert roll["weights"] == train["weights"] and roll["grads"] == train["grads"]
    assert plan.failing == ("rollout",) and plan.offloaded_bytes == 0
    refusal = plan.refusal()
    left = sum(roll[k] for k in ("weights", "reference", "grads", "optimizer", "runtime"))
    assert f"({left / GiB:.2f} GiB with the runtime) plus the engine's {0.45 * 80:.2f} GiB" in refusal
    assert any(a.startswith("rollout.offload_optimizer=true") for a in plan.advice)

    only_optimizer_kept = memory_plan(config("qwen2.5-math-1.5b_token_alp.yaml", "rollout.offload_optimizer=false"),
                                      gpus=8, gpu_mem_gib=H100)
    roll = only_optimizer_kept.phase("rollout")
    assert roll.resident[:2] == ("optimizer", "runtime") and roll.nbytes("optimizer") > 0


def test_too_small_engine_budget_and_bad_layouts_are_refused():
    plan = memory_plan(config("qwen2.5-7b_tir_seq_alp.yaml", "rollout.gpu_memory_utilization=0.1"), 8, H100)
    assert plan.failing == ("kv_cache",) and any("rollout.gpu_memory_utilization=" in a for a in plan.advice)
    with pytest.raises(ConfigError, match=r"--gpus 12 is not a multiple of parallel.tensor_model_parallel_size"):
        memory_plan(config("qwen2.5-32b_seq_alp.yaml"), 12, H100)
    with pytest.raises(ConfigError, match=r"parallel.tensor_model_parallel_size=3 does not divide"):
        memory_plan(config("qwen2.5-math-1.5b_grpo.yaml", "parallel.tensor_model_parallel_size=3"), 3, H100)


def test_architecture_source(tmp_path):
    """hf_path's own config.json first, then the bundled published config of that name, else an error."""
    plan = memory_plan(config("qwen3-4b_seq_alp.yaml"), 8, H100)
    assert plan.source.startswith("bundled published config megatron_alp/models/published/Qwen3-4B.json")
    local = tmp_path / "Qwen3-4B"
    local.mkdir()
    published = json.loads((PUBLISHED / "Qwen3-4B.json").read_text())
    (local / "config.json").write_text(json.dumps({**published, "num_hidden_layers": 18}))
    half = memory_plan(config("qwen3-4b_seq_alp.yaml", f"model.hf_path={local}"), 8, H100)
    assert half.source == str(local / "config.json")
    assert half.phase("training").nbytes("weights") < plan.phase("training").nbytes("weights")
    with pytest.raises(ConfigError, match="model.hf_path: /models/Unknown-7B has no config.json"):
        memory_plan(config("qwen3-4b_seq_alp.yaml", "model.hf_path=/models/Unknown-7B"), 8, H100)
    tiny = memory_plan(config_from_dict({"model": {"tiny": "qwen3_moe"}}), 1, H100)
    assert tiny.source == "tiny qwen3_moe model (model.tiny)" and tiny.fits


def test_published_configs_agree_with_the_shipped_configs():
    assert {p.stem for p in PUBLISHED.glob("*.json")} == set(MODELS)
    for name, (layers, heads, kv_heads) in MODELS.items():
        hf = json.loads((PUBLISHED / f"{name}.json").read_text())
        facts = hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"]
        assert facts == (layers, heads, kv_heads), name
        assert hf["torch_dtype"] == "bfloat16" and hf["architectures"]


def test_default_gpus_is_the_smallest_layout():
    names = ("qwen2.5-math-1.5b_grpo.yaml", "qwen3-4b_seq_alp.yaml", "qwen2.5-32b_seq_alp.yaml",
             "qwen3-30b-a3b_seq_alp.yaml")
    assert [default_gpus(config(f)) for f in names] == [1, 2, 8, 8]  # TP1; TP2; TP4 x PP2; EP8
    # separate engines: trainer ranks enough to lead one node's replicas (4 of TP1, 2 of TP2)
    assert default_gpus(config(ASYNC)) == 4
    assert default_gpus(config(ASYNC, "rollout.tensor_parallel_size=2")) == 2


ASYNC = "qwen2.5-math-1.5b_token_alp_async.yaml"  # placement: separate, rollout.gpus [4, 5, 6, 7], utilization 0.9
PARAMS_15B = 1_543_714_304  # Qwen2.5-Math-1.5B (test_qwen25_math_15b_on_one_node_by_hand)


def test_separate_engines_by_hand():
    """--gpus counts the trainer's GPUs. A trainer GPU holds Megatron's whole state and no engine;
    an engine GPU holds the engine's gpu_memory_utilization x the GPU and a weight-sync bucket,
    no Megatron state and no trainer process; nothing is offloaded."""
    plan = memory_plan(config(ASYNC), gpus=4, gpu_mem_gib=H100)
    colocated = memory_plan(config("qwen2.5-math-1.5b_token_alp.yaml"), gpus=8, gpu_mem_gib=H100)
    train, before = items(plan.phase("training")), items(colocated.phase("training"))
    assert "engine" not in train and before["engine"] == 2 * GiB  # no sleeping engine on a trainer GPU
    assert train["optimizer"] == 12 * -(-PARAMS_15B // 4)  # DP4: 4 trainer ranks
    assert {k: v for k, v in train.items() if k != "optimizer"} == {
        k: v for k, v in before.items() if k not in ("optimizer", "engine")}

    engine_weights = PARAMS_15B * 2
    assert items(plan.phase("rollout")) == {
        "engine_weights": engine_weights, "engine_workspace": 3 * GiB,
        "kv_cache": int(0.9 * 80 * GiB) - engine_weights - 3 * GiB,
        "sync_bucket": 512 * 2**20,  # rollout.sync_bucket_mb's default
    }
    assert plan.phase("rollout").total == int(0.9 * 80 * GiB) + 512 * 2**20
    assert plan.offloaded_bytes == 0 and plan.engine_gpus == 4 and plan.fits
    report = plan.report()
    assert "layout  4 trainer GPUs + 4 engine GPUs x 80 GiB" in report and "4 replicas in all" in report
    assert "nothing offloaded" in report and "host memory for the offloaded state" not in report
    kv_per_token = 2 * 28 * 2 * 128 * 2
    assert f"{(int(0.9 * 80 * GiB) - engine_weights - 3 * GiB) // (kv_per_token * 4096)} full-length" in report

    # two nodes of 4 trainer ranks: DP8, 8 engine GPUs
    two = memory_plan(config(ASYNC), gpus=8, gpu_mem_gib=H100)
    assert two.engine_gpus == 8 and items(two.phase("training"))["optimizer"] == 12 * -(-PARAMS_15B // 8)
    assert "2 nodes, each with trainer ranks on GPUs 0-3" in two.layout and "8 replicas in all" in two.layout
    # FP8 engine: 1 byte per linear-layer weight, the (tied) embedding stays bf16; engine TP2 halves it
    embedding = 151936 * 1536
    fp8 = memory_plan(config(ASYNC, "rollout.quantization=fp8", "rollout.tensor_parallel_size=2"), 4, H100)
    assert items(fp8.phase("rollout"))["engine_weights"] == ((PARAMS_15B - embedding) * 1 + embedding * 2) // 2
    assert "2 replicas in all" in fp8.layout


def test_separate_engines_refusals_name_the_keys(capsys):
    """An engine GPU over its usable memory, a KV cache that cannot hold a sequence, and layouts the
    placement cannot run are refused, naming the keys; advice never offers offloading (nothing is
    offloaded with separate engines)."""
    full = memory_plan(config(ASYNC, "rollout.gpu_memory_utilization=0.95"), 4, H100)  # 76 GiB + the bucket
    assert full.failing == ("rollout",)
    assert "rollout.gpu_memory_utilization 0.95" in full.problems[0] and "rollout.sync_bucket_mb" in full.problems[0]
    assert any(a.startswith("rollout.gpu_memory_utilization=0.94  (fits") for a in full.advice)
    assert not any("offload" in a for a in full.advice)

    starved = memory_plan(config(ASYNC, "rollout.gpu_memory_utilization=0.05"), 4, H100)  # 4 GiB: weights + workspace
    assert starved.failing == ("kv_cache",) and "vLLM refuses to start" in starved.problems[0]
    one_sequence = 2 * 28 * 2 * 128 * 2 * 4096  # KV cache of one 4096-token sequence
    least = (PARAMS_15B * 2 + 3 * GiB + one_sequence) / (80 * GiB)  # weights, workspace, one sequence: 0.075
    assert any(a.startswith(f"rollout.gpu_memory_utilization={math.ceil(100 * least) / 100}  (fits")
               for a in starved.advice)

    with pytest.raises(ConfigError, match=r"--gpus 6 trainer GPUs are not whole nodes of 4 trainer ranks"):
        memory_plan(config(ASYNC), 6, H100)
    with pytest.raises(ConfigError, match=r"rollout.gpus \[2, 3, 4, 5\] overlap GPUs 0-3"):
        memory_plan(config(ASYNC, "rollout.gpus=[2,3,4,5]"), 8, H100, nproc_per_node=4)
    with pytest.raises(ConfigError, match=r"rollout.gpus holds 4 replica\(s\) .* the node's 2 trainer ranks"):
        memory_plan(config(ASYNC), 2, H100)
    with pytest.raises(ConfigError, match=r"rollout.placement: separate on GPUs needs rollout.gpus"):
        memory_plan(config(ASYNC, "rollout.gpus=[]"), 4, H100)

    code = main(["plan", f"configs/{ASYNC}", "rollout.gpu_memory_utilization=0.95", "--gpus", "8",
                 "--nproc-per-node", "4"])
    out, err = capsys.readouterr()
    assert code == 2 and "8 trainer GPUs + 8 engine GPUs x 80 GiB" in out
    assert err.startswith("megatron-alp plan: error: the memory plan does not fit 8 trainer GPUs + 8 engine GPUs")


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_docs_show_the_current_plan(path):
    """docs/results/memory_plan.md's summary row of each shipped config matches what the planner says now."""
    gpus = stated_gpus(path)
    plan = memory_plan(load_config(path), gpus, H100)
    row = next(line for line in (ROOT / "docs" / "results" / "memory_plan.md").read_text().splitlines()
               if line.startswith(f"| `{path.stem}` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1].endswith(f"(`--gpus {gpus}`)")
    phases = ("rollout", "engine_restart_resync", "training", "weight_sync", "checkpoint_save")
    assert cells[3:] == [f"{plan.phase(name).total / GiB:.2f}" for name in phases] + ["fits"]


def test_every_phase_of_the_table_is_planned_and_the_worst_one_is_named():
    """A weight-sync bucket of 40 GB beside the engine's weights: the update fits, the sync does not,
    and the refusal names the sync phases; the plan prints a row for each phase, with the phases
    the config never runs marked."""
    plan = memory_plan(config("qwen2.5-math-1.5b_grpo.yaml", "rollout.sync_bucket_mb=40000"), 8, H100)
    assert plan.failing == ("engine_restart_resync", "weight_sync")
    sync = items(plan.phase("weight_sync"))
    assert sync["sync_bucket"] == 2 * 40000 * 2**20  # gathered, and its copy for the engine on GPU 0
    assert sync["grads"] == sync["optimizer"] == 0 and sync["weights"] > 0  # offloaded for the sync
    assert sync["engine"] == 2 * GiB and sync["engine_weights"] > 0 and "kv_cache" not in sync
    assert any(p.startswith("weight sync (engine weights awake, no KV cache) needs") for p in plan.problems)
    assert any(a.startswith("rollout.sync_bucket_mb=20000") for a in plan.advice)
    report = plan.report()
    for title in ("rollout, engine start, validation", "engine restart + resync", "training (policy update)",
                  "weight sync", "sync verification", "checkpoint save"):
        assert title in report, title
    assert "not run (rollout.verify_sync: false)" in report

    verify = memory_plan(config("qwen2.5-math-1.5b_grpo.yaml", "rollout.verify_sync=true"), 8, H100)
    probe = items(verify.phase("sync_verification"))
    assert probe["weights"] > 0 and probe["kv_cache"] > 0 and probe["grads"] == probe["optimizer"] == 0


def test_the_plan_refuses_a_sync_method_the_placement_cannot_use():
    with pytest.raises(ConfigError, match="rollout.sync_method: broadcast with rollout.placement: colocated"):
        memory_plan(config("qwen2.5-math-1.5b_grpo.yaml", "rollout.sync_method=broadcast"), 8, H100)


def test_the_host_copy_of_a_sleeping_engines_weights_is_counted():
    """Issue 37: vLLM sleeps at level 2 where every sync re-sends the weights (no host copy), at level
    1 under adapter-only LoRA syncs (the base weights pinned in host memory); SGLang keeps a host
    backup whenever it frees its memory. Qwen2.5-Math-1.5B on TP1 engines: 1,543,714,304 bf16 weights."""
    weights = 1_543_714_304 * 2 / GiB
    base = "qwen2.5-math-1.5b_token_alp.yaml"
    assert "sleeping engines keep no weights in host memory" in memory_plan(config(base), 8, H100).report()
    for overrides in (["rollout.engine=sglang"], ["lora.enabled=true", "lora.sync=adapter"]):
        report = memory_plan(config(base, *overrides), 8, H100).report()
        assert f"sleeping engines: {weights:.2f} GiB of host memory per engine GPU" in report, overrides
    assert "sleeping engines" not in memory_plan(config(base, "rollout.free_memory_during_training=false"), 8,
                                                 H100).report()


def test_routing_replay_host_buffers_are_counted():
    """Qwen3-30B-A3B (48 layers, 8 of 128 experts per token, uint8 ids), R3 on 16 GPUs (DP16, 4
    replicas of TP4): on a replica leader the engine's expert ids of its replica's quarter of the
    batch (held until fetched), and of the rank's sixteenth the engine's (fetched, then dense) and
    the old pass's: no rank holds the whole batch's (review finding R5)."""
    cfg = config("qwen3-30b-a3b_seq_alp.yaml")
    responses = cfg.trainer.prompts_per_iteration * cfg.rollout.sampling.n
    per_sequence = 4096 * 48 * 8
    host = responses // 4 * per_sequence + 3 * (responses // 16) * per_sequence
    assert host < responses * per_sequence / 2
    plan = memory_plan(cfg, 16, H100)
    assert f"routing replay (r3): {host / GiB:.2f} GiB of host memory per rank" in plan.report()


def test_the_checkpoint_save_counts_what_its_format_gathers(monkeypatch):
    """Qwen3-30B-A3B on 16 GPUs: the save holds the policy's weights and optimizer state (the reference stays
    offloaded, the gradients released), the runtime and the sleeping engine; the distributed optimizer's state is
    gathered over gloo into host memory, none on the GPU, and the host memory of a data-parallel group's first rank
    is a note. The plan reads the save's own format: with Megatron's NCCL all-gather instead, each rank would hold
    the expert buffer's fp32 shard and the expert-DP2 received ones for one state at a time, and a GPU where that
    does not fit is refused naming the save."""
    h, heads, kv_heads, d, layers, vocab, experts, expert_ffn = 2048, 32, 4, 128, 48, 151936, 128, 768
    q, kv = heads * d, kv_heads * d
    dense = layers * (h * (q + 2 * kv) + q * h + 2 * h + 2 * d + h * experts) + 2 * vocab * h + h
    expert = layers * experts * 3 * h * expert_ffn // 8  # EP8
    plan = memory_plan(config("qwen3-30b-a3b_seq_alp.yaml"), gpus=16, gpu_mem_gib=H100)
    save = plan.phase("checkpoint_save")
    assert items(save) == {
        "weights": (dense + expert) * 2, "reference": 0, "grads": 0,
        "optimizer": 12 * (-(-dense // 16) + -(-expert // 2)), "save_transient": 0,
        "runtime": 3 * GiB, "engine": 2 * GiB,
    }
    world = 12 * (dense + expert)  # fp32 parameter, Adam m and v of both buffers, whole, on the host
    gathering = 12 * expert + 12 * expert // 2  # the expert buffer's received shards and concatenations, own shards
    assert f"checkpoint save: {(world + gathering) / GiB:.2f} GiB of host memory" in plan.report()
    assert "checkpoint_save" not in memory_plan(config("qwen3-30b-a3b_seq_alp.yaml"), 16, 58.0).failing

    monkeypatch.setitem(dist_checkpoint.OPTIMIZER_METADATA, "distrib_optim_fully_reshardable_mem_efficient", False)
    nccl = memory_plan(config("qwen3-30b-a3b_seq_alp.yaml"), gpus=16, gpu_mem_gib=H100).phase("checkpoint_save")
    assert items(nccl)["save_transient"] == 4 * expert + 4 * expert // 2  # 20.25 GiB
    assert nccl.total == save.total + 4 * expert + 4 * expert // 2
    small = memory_plan(config("qwen3-30b-a3b_seq_alp.yaml"), 16, 58.0)  # 55.1 GiB usable
    assert "checkpoint_save" in small.failing
    assert f"checkpoint save needs {nccl.total / GiB:.2f} GiB on GPU 0" in small.refusal()
