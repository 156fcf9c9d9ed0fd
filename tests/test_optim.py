"""The optimizer: sigma's own parameter group in a bf16 model under Megatron DDP (torchrun, gloo)."""

from helpers import dist_job, read_results

OPTIMIZER = dist_job("optimizer", "check_optimizer.py", "{dir}/r.json")


@OPTIMIZER
def test_sigma_optimizer_group_bf16_ddp(dist_jobs):
    """Sigma: own constant LR, no decay, float32 inside a bf16 model, synchronised over DP."""
    r = read_results(dist_jobs.run("optimizer") / "r.json")
    assert all(lr["lr/sigma"] == 5e-2 for lr in r["lrs"]) and r["lrs"][-1]["lr"] < 1e-3
