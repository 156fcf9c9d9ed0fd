"""The policy's construction: weights loaded from a checkpoint reach the optimizer (torchrun, gloo)."""

from helpers import read_results, torchrun


def test_a_bf16_policy_started_from_a_checkpoint_trains_from_its_weights(tmp_path):
    """``model.load`` into a bf16 model with the distributed optimizer: one step at learning rate 0
    leaves every parameter at the checkpoint's value (before the fix the optimizer's fp32 main
    parameters still held the HF weights the model was built with, and the step put those back)."""
    (tmp_path / "work").mkdir()
    torchrun("check_policy_load.py", str(tmp_path / "work"), str(tmp_path / "r.json"))
    r = read_results(tmp_path / "r.json")
    assert r["params"] > 30 and r["moved"] == [], r["moved"][:5]
