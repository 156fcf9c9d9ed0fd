"""ALP perturbation sites under TP/SP/PP and activation recomputation (torchrun, gloo)."""

from helpers import read_results, torchrun


def test_perturbation_under_tp_sp_pp_and_recompute(tmp_path):
    """Replicated noise under TP, per-shard noise under SP, TP=2 == TP=1 perturbed logits and sigma
    grads, bit-identical unperturbed passes, sigma=0 == no perturbation, recompute replays the noise,
    layer ranges / logits-only sites, PP stages own their sigmas (asserted in the script)."""
    torchrun("check_perturbation.py", str(tmp_path / "r.json"))
    r = read_results(tmp_path / "r.json")
    assert r["tp2_logit_diff"] < 2e-5 and r["ref_logit_shift"] > 1e-3 and r["recompute_sites_replayed"] == 4
