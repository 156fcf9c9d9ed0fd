"""The optimizer: sigma's own parameter group in a bf16 model under Megatron DDP (torchrun, gloo)."""

from helpers import read_results, torchrun


def test_sigma_optimizer_group_bf16_ddp(tmp_path):
    """Sigma: own constant LR, no decay, float32 inside a bf16 model, synchronised over DP."""
    torchrun("check_optimizer.py", str(tmp_path / "r.json"))
    r = read_results(tmp_path / "r.json")
    assert all(lr["lr/sigma"] == 5e-2 for lr in r["lrs"]) and r["lrs"][-1]["lr"] < 1e-3
