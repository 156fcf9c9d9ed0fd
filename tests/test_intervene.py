"""`megatron-alp intervene`: bad arms, and real one-step interventions (tiny model, vLLM on the CPU,
math-verify rewards, Megatron on gloo, one process) whose two arms must differ exactly by the noise."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_alp.cli import EXIT_BAD_INPUT
from megatron_alp.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, N, MAX_TOKENS, SEEDS = 4, 4, 8, 2


def _k3(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """mean(r - 1 - log r), r = p / q: the k3 estimator, written out."""
    d = logp.double() - logq.double()
    return float((d.exp() - 1.0 - d).mean())


@pytest.fixture(scope="module")
def tiny(tiny_model) -> Path:
    return tiny_model("qwen2", seed=0)


def _config(tmp_path: Path, model: Path) -> Path:
    # entropy_coef: a gradient even when every reward of the random model is 0 (no GRPO signal)
    path = tmp_path / "intervene.yaml"
    path.write_text(
        f"model: {{hf_path: {model}, dtype: float32, layer_spec: local}}\n"
        "loss: {name: alp_token, kl_coef: 0.001, entropy_coef: 0.01}\n"
        "optimizer: {lr: 1.0e-3, min_lr: 1.0e-3}\n"
        "rollout:\n"
        "  dtype: float32\n"
        f"  sampling: {{n: {N}, temperature: 1.0, max_prompt_length: 96, max_response_length: {MAX_TOKENS}}}\n"
        f"data: {{train_files: [{ROOT / 'data/largest/train.jsonl'}]}}\n"
        "reward: {workers: 1}\n"
        f"trainer: {{output_dir: {tmp_path / 'run'}, micro_batch_size: 64, prompts_per_iteration: {PROMPTS}}}\n"
    )
    return path


def _measure(config: Path, model: Path, compare: str | None, *overrides: str, checkpoint: Path | None = None,
             optimizer_state: bool = False, seeds: int = SEEDS):
    from megatron_alp.commands.intervene import arm_config, measure, parse_compare
    from megatron_alp.resolve import load_config

    cfg = load_config(config, list(overrides))
    arms = {arm: arm_config(str(config), list(overrides), arm) for arm in parse_compare(compare, cfg)}
    return measure(cfg, arms, checkpoint=str(checkpoint or model), model_dir=str(model), prompts=PROMPTS, seeds=seeds,
                   seed=3, optimizer_state=optimizer_state)


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory) -> Path:
    """A megatron-alp checkpoint as training saves it: ALP sites (sigma 1e-3) and the Adam state of
    two Token-ALP steps on random sequences."""
    from megatron_alp.config import LossConfig, ModelConfig, OptimizerConfig, ParallelConfig, PerturbationConfig
    from megatron_alp.models.families import hf_to_megatron, load_hf_config
    from megatron_alp.models.hf_weights import load_hf_weights
    from megatron_alp.runtime.parallel import destroy_distributed, init_distributed
    from megatron_alp.training.builder import build_gpt_model
    from megatron_alp.training.dist_checkpoint import save_checkpoint
    from megatron_alp.training.micro_batch import Batching
    from megatron_alp.training.optim import build_optimizer, wrap_for_training
    from megatron_alp.training.policy_update import compute_logprobs, train_mini_batch
    from megatron_alp.training.rl_batch import RLBatch
    from megatron_alp.training.step_metrics import StepMetrics

    ckpt = tmp_path_factory.mktemp("intervene_ckpt") / "iter_0000002"
    par, pert = ParallelConfig(), PerturbationConfig(enabled=True, init_std=1e-3)
    init_distributed(par, seed=0)
    try:
        model = build_gpt_model(hf_to_megatron(load_hf_config(tiny)),
                                ModelConfig(hf_path=str(tiny), layer_spec="local", dtype="float32"),
                                par, pert)
        load_hf_weights(model, tiny)
        policy = wrap_for_training(model, par)
        optimizer, _ = build_optimizer(policy, OptimizerConfig(lr=1e-3, min_lr=1e-3), pert, par, total_steps=2)
        g = torch.Generator().manual_seed(5)
        tokens = torch.randint(3, 200, (8, 12), generator=g)
        mask = torch.zeros(8, 12)
        mask[:, 3:11] = 1
        batch = RLBatch(tokens, torch.nn.functional.pad(tokens[:, 1:], (0, 1)), mask, torch.zeros(8, 12),
                        torch.tensor([1.0, -1.0] * 4), torch.full((8,), 12))
        batch.rollout_logprobs = compute_logprobs(policy, batch, batching=Batching(size=8), temperature=1.0, pad_id=0)
        for step in range(2):
            train_mini_batch(policy, optimizer, batch, loss_cfg=LossConfig(name="alp_token", kl_coef=0.0), step=step,
                             batching=Batching(size=8), temperature=1.0, pad_id=0, metrics=StepMetrics())
        save_checkpoint(ckpt, policy, optimizer=optimizer, hf_dir=tiny)
    finally:
        destroy_distributed()
    return ckpt


# -------------------------------------------------------------------------------- bad input


def test_bad_compare_and_checkpoint_exit_2(tmp_path, tiny, capsys):
    cfg = _config(tmp_path, tiny)

    def fails(*argv, names=("--compare",)):
        assert cli_main(["intervene", str(cfg), *argv]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert err.startswith("megatron-alp intervene: error: ") and "Traceback" not in err, err
        for name in names:
            assert name in err, (name, err)

    ckpt = ["--checkpoint", str(tiny)]
    fails(*ckpt, "--compare", "alp_token", names=("--compare", "A:B"))
    fails(*ckpt, "--compare", "alp_tokn:seq_bypass", names=("--compare", "'alp_tokn'", "seq_bypass"))
    fails(*ckpt, "--compare", "alp_token@x:alp_token@0", names=("--compare", "SIGMA", "'x'"))
    fails(*ckpt, "--compare", "alp_token@-1:alp_token@0", names=("--compare", ">= 0"))
    fails(*ckpt, "--compare", "seq_bypass@0:alp_seq", names=("--compare", "seq_bypass", "not perturbed"))
    fails(*ckpt, "--compare", "alp_seq:alp_seq", names=("--compare", "both arms"))
    fails(*ckpt, "loss.name=seq_bypass", names=("--compare is needed", "seq_bypass"))
    fails("--checkpoint", str(tmp_path / "nowhere"), names=("--checkpoint", "nowhere", "config.json"))
    fails(*ckpt, "--optimizer-state", "checkpoint", names=("--optimizer-state", "holds no optimizer state"))
    fails(*ckpt, "--compare", "alp_token@often:alp_token@0", names=("--compare", "auto", "'often'"))
    with pytest.raises(SystemExit) as exit_:
        cli_main(["intervene", str(cfg)])
    assert exit_.value.code == 2 and "--checkpoint" in capsys.readouterr().err


# -------------------------------------------------------------------------------- real runs


def test_without_noise_both_arms_take_the_same_step(tmp_path, tiny):
    """init_std = 0 and the default arms (alp_token : alp_token@0): nothing tells the arms apart,
    so the updated policies are bit-identical; the update moves the policy (lr 1e-3)."""
    report, tokens = _measure(_config(tmp_path, tiny), tiny, None, "perturbation.init_std=0")
    assert list(report["arms"]) == ["alp_token", "alp_token@0"]
    assert len(tokens["per_seed"]) == SEEDS and report["seeds"] == [3, 4]
    for flat, entry in zip(tokens["per_seed"], report["per_seed"]):
        a, b = entry["arms"]["alp_token"], entry["arms"]["alp_token@0"]
        assert a["sigma"] == 0.0 and b["sigma"] == 0.0
        assert torch.equal(flat["after"]["alp_token"], flat["after"]["alp_token@0"])
        assert a["after"] == b["after"] and a["shift"] == b["shift"] and a["update"] == b["update"]
        rollout, old, after = flat["rollout"], flat["old"]["alp_token"], flat["after"]["alp_token"]
        assert len(rollout) == entry["tokens"] > 0
        shift = _k3(after, old)
        assert shift > 0 and not torch.equal(after, old)
        assert a["shift"]["kl_k3"] == pytest.approx(shift, rel=1e-5)
        assert a["after"]["all"]["kl_k3"] == pytest.approx(_k3(after, rollout), rel=1e-5)
        assert a["before"]["all"]["kl_k3"] == pytest.approx(_k3(old, rollout), rel=1e-5, abs=1e-12)
        log_r = (after.double() - rollout.double()).numpy()
        assert a["after"]["all"]["log_ratio"]["p98"] == pytest.approx(np.quantile(log_r, 0.98), rel=1e-6)
    s = report["summary"]
    assert s["narrower_pairs"] == 0 and s["narrower_bins"] == 0  # equal widths: never narrower
    assert s["pairs"] == sum(b["seeds"] for b in s["bins"]) > 0


def test_noise_changes_the_update_not_the_logprob_passes(tmp_path, tiny):
    """sigma 1e-2 against 0: the noisy update lands elsewhere, while the checkpoint's own logprobs
    (the before statistics, and the old-policy pass the loss reads) are the same for both arms."""
    report, tokens = _measure(_config(tmp_path, tiny), tiny, "alp_token@1e-2:alp_token@0", seeds=1)
    for flat, entry in zip(tokens["per_seed"], report["per_seed"]):
        a, b = entry["arms"]["alp_token@1e-2"], entry["arms"]["alp_token@0"]
        assert a["sigma"] == pytest.approx(1e-2) and b["sigma"] == 0.0
        assert torch.equal(flat["old"]["alp_token@1e-2"], flat["old"]["alp_token@0"])
        assert a["before"] == b["before"]
        after_a, after_b = flat["after"]["alp_token@1e-2"], flat["after"]["alp_token@0"]
        assert (after_a - after_b).abs().max() > 1e-6
        assert a["after"]["all"]["kl_k3"] != b["after"]["all"]["kl_k3"]
        # the update's own ratio is perturbed-train / rollout in the noisy arm only
        assert a["update"]["ratio/p98"] != b["update"]["ratio/p98"]
        # the noisy arm's perturbed updated policy is reported too (the unperturbed arm has none)
        assert b["after_perturbed"] is None and a["after_perturbed"]["all"]["tokens"] == entry["tokens"]
        assert a["after_perturbed"]["all"]["kl_k3"] != a["after"]["all"]["kl_k3"]


def test_zero_learning_rate_changes_nothing_and_writes_outputs(tmp_path, tiny, capfd):
    """optimizer.lr = 0 and no noise: after equals before, in every statistic. Run through the
    command: the JSON is strict and the figure and the engine log are written."""
    cfg = _config(tmp_path, tiny)
    out = tmp_path / "out"
    assert cli_main(["intervene", str(cfg), "optimizer.lr=0", "optimizer.min_lr=0", "perturbation.init_std=0",
                     "--checkpoint", str(tiny), "--seeds", str(SEEDS), "--out", str(out)]) == 0

    def no_nan(name):
        raise ValueError(f"non-strict JSON constant {name}")

    report = json.loads((out / "intervene.json").read_text(), parse_constant=no_nan)
    assert (out / "intervene.png").stat().st_size > 10_000 and (out / "engine.log").is_file()
    assert report["prompts"] == PROMPTS and len(report["per_seed"]) == SEEDS
    for entry in report["per_seed"]:
        assert entry["samples"] == PROMPTS * N
        for arm in entry["arms"].values():
            assert arm["after"] == arm["before"]
            assert arm["shift"]["kl_k3"] == 0.0 and arm["shift"]["abs_log_ratio"]["max"] == 0.0
    printed = capfd.readouterr().out
    assert "alp_token narrower than alp_token@0 (by more than 1%) in 0 of" in printed and "p [0.99, 1]" in printed
    assert f"written: {out / 'intervene.json'}" in printed


def test_the_checkpoints_optimizer_state_and_a_calibrated_sigma(tmp_path, tiny, trained):
    """From a checkpoint saved by training (ALP sites, Adam moments), with a bf16 engine:
    - with its optimizer state, Seq-Bypass is stepped with the checkpoint's sites at sigma 0 (their
      moments must load) and its update equals Seq-ALP's at sigma 0 bit for bit;
    - the same Seq-Bypass step from a fresh optimizer lands elsewhere (the moments matter), on the
      same rollouts;
    - ``@auto`` calibrates sigma on the batch: the measured engine KL is k3(old, rollout) of the
      batch's tokens, and the perturbed KL is within the search's 2% of it."""
    cfg = _config(tmp_path, tiny)
    loaded, loaded_tokens = _measure(cfg, tiny, "alp_seq@0:seq_bypass", "rollout.dtype=bfloat16", checkpoint=trained,
                                     optimizer_state=True, seeds=1)
    fresh, fresh_tokens = _measure(cfg, tiny, "alp_seq@auto:seq_bypass", "rollout.dtype=bfloat16", checkpoint=trained,
                                   seeds=1)
    still, _ = _measure(cfg, tiny, "alp_seq@1e-2:seq_bypass", "rollout.dtype=bfloat16", "optimizer.lr=0",
                        "optimizer.min_lr=0", "perturbation.lr=0", checkpoint=trained, optimizer_state=True, seeds=1)
    assert loaded["optimizer_state"] == "checkpoint" and fresh["optimizer_state"] == "fresh"
    for entry in still["per_seed"]:  # the config's learning rate applies, not the one saved with the moments
        for arm in entry["arms"].values():
            assert arm["after"] == arm["before"] and arm["shift"]["kl_k3"] == 0.0
    for lt, le, ft, fe in zip(loaded_tokens["per_seed"], loaded["per_seed"], fresh_tokens["per_seed"], fresh["per_seed"]):
        assert le["arms"]["seq_bypass"]["sigma"] == 0.0
        assert torch.equal(lt["after"]["alp_seq@0"], lt["after"]["seq_bypass"])
        assert torch.equal(lt["rollout"], ft["rollout"]) and torch.equal(lt["old"]["seq_bypass"], ft["old"]["seq_bypass"])
        assert (lt["after"]["seq_bypass"] - ft["after"]["seq_bypass"]).abs().max() > 1e-6
        auto = fe["arms"]["alp_seq@auto"]
        engine_kl = _k3(ft["old"]["alp_seq@auto"], ft["rollout"])  # r = pi_train / pi_rollout, as training logs it
        assert engine_kl > 0
        assert auto["update"]["calibration/train_engine_kl"] == pytest.approx(engine_kl, rel=1e-6)
        assert auto["update"]["calibration/perturbed_kl"] == pytest.approx(engine_kl, rel=0.021)
        assert auto["sigma"] > 0
