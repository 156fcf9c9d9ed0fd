"""Distributed checkpoints across parallel layouts: every tensor survives DP/TP/PP 1 -> 2 -> 1 and
the MoE weights EP 1 -> 2 -> 1 (tests/dist/check_reshard.py); what cannot move is refused naming the
key. Saving, resuming and failing saves are in tests/test_convert.py."""

from helpers import read_results, torchrun


def test_a_checkpoint_moves_between_layouts_with_every_tensor_intact(tmp_path):
    torchrun("check_reshard.py", "seed", str(tmp_path), nproc=1)
    torchrun("check_reshard.py", "wide", str(tmp_path), nproc=2)
    out = tmp_path / "results.json"
    torchrun("check_reshard.py", "narrow", str(tmp_path), str(out), nproc=1)
    r = read_results(out)
    assert len(r["differences"]) == 16 and all(d == [] for d in r["differences"].values()), r["differences"]
    expected = {"dp2": "DP 2 -> 1", "tp2": "TP 2 -> 1", "pp2": "PP 2 -> 1", "ep2": "EP 2 -> 1"}
    for tag, line in r["lines"].items():
        layout = tag.split("_")[0]
        assert line.startswith(f"resuming {tag} at another layout ("), line
        assert expected[layout] in line and "ALP noise from other per-rank streams" in line, line
        # EP=2 ran beside DP=2 (2 ranks); TP=2 and PP=2 left DP at 1
        assert ("DP 2 -> 1" in line) == (layout in ("dp2", "ep2")), line
    assert "set parallel.use_distributed_optimizer=true to resume it" in r["refusal"], r["refusal"]
    for refusal in r["moe_refusals"].values():  # EP=1 -> 2 keeps the weights but not the optimizer state
        assert "saved at parallel.expert_model_parallel_size=1" in refusal and "size=2 cannot hold it" in refusal, r
