"""Distributed checkpoints across parallel layouts: every tensor survives DP/TP/PP 1 -> 2 -> 1 and
the MoE weights EP 1 -> 2 -> 1 (tests/dist/check_reshard.py), with the optimizer state gathered over
gloo for the save and each DP rank reading its own shard's state at the load; what cannot move is
refused naming the key. Saving, resuming and failing saves are in tests/test_convert.py."""

from helpers import dist_job, read_results

# three jobs on one folder: 1 rank saves, 2 ranks load and save again, 1 rank loads those and compares
dist_job("reshard_seed", "check_reshard.py", "seed", "{dir}", nproc=1)
dist_job("reshard_wide", "check_reshard.py", "wide", "{dir:reshard_seed}", after=("reshard_seed",))
NARROW = dist_job("reshard_narrow", "check_reshard.py", "narrow", "{dir:reshard_seed}", "{dir}/results.json", nproc=1,
                  after=("reshard_wide",))


@NARROW
def test_a_checkpoint_moves_between_layouts_with_every_tensor_intact(dist_jobs):
    r = read_results(dist_jobs.run("reshard_narrow") / "results.json")
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
    # a DP=2 load reads on each rank the state of the parameters its optimizer shard holds, not the whole slice,
    # and every parameter's state is read once as the main replica (Megatron's check of the load passes)
    for rank in r["kept"]:
        assert rank["kept"] == rank["expected"] and 0 < rank["kept"] < rank["total"], r["kept"]
    assert r["kept"][0]["main"] == r["kept"][0]["total"], r["kept"]
