"""benchmarks/lora_sizes.py's reading of a checkpoint and of metrics.jsonl, on a tiny distributed
checkpoint saved in this process (no training is run: the benchmark itself takes minutes)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import lora_sizes as ls  # noqa: E402  (benchmarks/ is not a package)


def test_checkpoint_numbers_count_optimizer_tensors_by_their_dtype(tmp_path):
    state = {
        "decoder.layers.mlp.linear_fc1.weight": torch.zeros(2, 6, 4),  # a model tensor: not optimizer state
        "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1_lora.A": torch.zeros(2, 3, 4),
        "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1_lora.A": torch.zeros(2, 3, 4),
        "optimizer.state.exp_avg.decoder.layers.0.alp_perturbation.log_sigma": torch.zeros(1),
        "optimizer.state.exp_avg_sq.decoder.layers.0.alp_perturbation.log_sigma": torch.zeros(1),
        "optimizer.state.fp32_param.decoder.layers.mlp.linear_fc1_lora.A": torch.zeros(2, 3, 4, dtype=torch.bfloat16),
        "optimizer.note": "pickled, not a tensor",  # its size is not in the metadata: left out
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: "assuming ... a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    got = ls.checkpoint_numbers(tmp_path)
    assert got == {"trainable_params": 24 + 1, "sigma_params": 1,
                   "optimizer_bytes": 4 * (24 + 24 + 1 + 1) + 2 * 24, "model_bytes": 4 * 48}
    assert ls.dir_bytes(tmp_path) == sum(p.stat().st_size for p in tmp_path.iterdir()) > 0


def test_metrics_means_skip_the_base_model_validation_and_the_table_shows_ratios():
    rows = [{"iteration": -1, "val/reward_mean": 0.1}, {"iteration": 0, "sync/bytes": 10.0},
            {"iteration": 1, "sync/bytes": 30.0}]
    assert ls.mean_of(rows, "sync/bytes") == 20.0
    one = {"trainable_params": 100, "optimizer_bytes": 800, "model_bytes": 400, "checkpoint_bytes": 2 * ls.MIB,
           "sync_bytes": ls.MIB, "s_per_iteration": 2.0, "update_s": 1.0}
    runs = {"full": one, "lora_merged": {**one, "trainable_params": 10, "sync_bytes": ls.MIB / 4}}
    ratios = {"lora_merged": {key: one[key] / runs["lora_merged"][key] for _, key, _ in ls.ROWS}}
    lines = ls.table(runs, ratios).splitlines()
    assert lines[1].split() == ["trainable", "parameters", "100", "10", "10.00x"]
    assert lines[5].split()[-3:] == ["1.000", "0.250", "4.00x"]
