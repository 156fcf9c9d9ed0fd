"""LoRA runs of the trainer end to end (configs/quickstart_lora_cpu.yaml at CI size, real vLLM):
only adapters and sigmas train, the KL reference is the base model (adapters off), a checkpoint holds
the adapters without the frozen base (it records the run's base model folder) and resumes to the same
metrics and tensors, a changed base model is refused at resume in one line, the engine serves the
trained adapters (merged or adapter-only), and the two-rank layouts reproduce the one-rank run."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from helpers import LOSS_KEYS, QUICKSTART_LORA, ROLLOUT_KEYS, TP2_SP, copy_run, metrics, train
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

# one update per iteration: iteration 0's update starts from B = 0, the base model itself
RUN = ("trainer.iterations=2", "trainer.save_interval=2", "trainer.sft_warmup_steps=30", "trainer.eval_interval=0",
       "trainer.updates_per_iteration=1", "rollout.verify_sync=true")


def lora_train(run: Path, *overrides: str, nproc: int = 1) -> str:
    rc, out = train(run, *RUN, *overrides, nproc=nproc, config=QUICKSTART_LORA)
    assert rc == 0, out[-6000:]
    return out


@pytest.fixture(scope="module")
def lora_run(sync_run, tmp_path_factory) -> Path:
    """The LoRA quickstart at CI size on one rank, from the shared run's warm-started base model (the
    same tiny Qwen2 and warm start as the LoRA quickstart's)."""
    run = copy_run(sync_run, tmp_path_factory.mktemp("lora") / "one_rank", base_model_only=True)
    lora_train(run)
    return run


def _adapter_numel(hf: dict, rank: int) -> int:
    """A (r x in) + B (out x r) of q/k/v (fused), o, gate/up (fused) and down in every layer, counted
    from the HF config alone."""
    h, inter = hf["hidden_size"], hf["intermediate_size"]
    head = hf.get("head_dim") or h // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * head, hf["num_key_value_heads"] * head
    per_layer = rank * (h + q + 2 * kv) + rank * (q + h) + rank * (h + 2 * inter) + rank * (inter + h)
    return per_layer * hf["num_hidden_layers"]


def test_only_adapters_train_and_the_reference_is_the_base_model(lora_run):
    m = metrics(lora_run)
    assert [r["iteration"] for r in m] == [0, 1]
    # B = 0 at iteration 0: the policy is the base model, up to ALP's 1e-4 noise in the update pass;
    # after one update the adapters have moved it away from the reference (adapters off)
    assert m[0]["kl_ref/mean"] < 1e-5, m[0]["kl_ref/mean"]
    assert m[1]["kl_ref/mean"] > 1e-4 and m[1]["kl_ref/mean"] > 30 * m[0]["kl_ref/mean"], (
        m[0]["kl_ref/mean"], m[1]["kl_ref/mean"])
    assert all(r["update/skipped"] == 0 and math.isfinite(r["grad_norm"]) for r in m), m
    # the engine serves the trained adapters: its probe logprobs match the trainer's after each sync
    assert all(r["sync/verify_mean_abs_diff"] < 2e-2 for r in m), [r["sync/verify_mean_abs_diff"] for r in m]

    ckpt = lora_run / "checkpoints" / "iter_0000002"
    stored = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    sizes = {k: v.size for k, v in stored.items() if k.startswith("optimizer.state.")}
    trained = {k.split(".", 3)[3] for k in sizes}
    assert all(k.endswith(("_lora.A", "_lora.B", "log_sigma")) for k in trained), sorted(trained)
    # no frozen base weight on disk: the model keys are the trained tensors (and Megatron's _extra_state
    # objects); the base is the run's base model folder, recorded with its tensor count
    model_keys = {k.split("/")[0] for k in stored if not k.startswith("optimizer.")}
    assert model_keys - {k for k in model_keys if "._extra_state" in k} == trained, sorted(model_keys ^ trained)
    base = json.loads((ckpt / "megatron_alp.json").read_text())["lora_base"]
    tensors = load_file(lora_run / "base_model" / "model.safetensors")
    assert base["dir"] == str(lora_run / "base_model") and base["tensors"] == len(tensors), base
    hf = json.loads((lora_run / "base_model" / "config.json").read_text())
    adapters = sum(math.prod(s) for k, s in sizes.items() if k.startswith("optimizer.state.exp_avg.") and "_lora." in k)
    assert adapters == _adapter_numel(hf, rank=8), (adapters, _adapter_numel(hf, rank=8))


def _saved_tensors(ckpt: Path, out: Path) -> dict:
    """Every tensor of a distributed checkpoint (model and optimizer state), read without a process group."""
    dcp_to_torch_save(str(ckpt), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items() if torch.is_tensor(v)}


@pytest.mark.slow  # the exact resume of adapters and their optimizer state: tests/test_lora.py
def test_a_lora_run_resumes_to_the_same_metrics(lora_run, tmp_path):
    """A run stopped after iteration 1's checkpoint (adapters, sigmas and optimizer state, no base) and
    resumed, its base read back from its base model folder, reproduces the straight run: the same
    metrics, and the same tensors in the last checkpoint."""
    run = tmp_path / "resumed"
    copy_run(lora_run, run, base_model_only=True)
    lora_train(run, "trainer.iterations=1", "trainer.save_interval=1")
    out = lora_train(run, "trainer.save_interval=1")
    assert "resumed from" in out, out[-3000:]
    for a, b in zip(metrics(run), metrics(lora_run)):
        for key in ROLLOUT_KEYS + ("loss/policy", "grad_norm", "kl_ref/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-9), (a["iteration"], key, a[key], b[key])
    last = "checkpoints/iter_0000002"
    got, want = (_saved_tensors(r / last, tmp_path / f"{r.name}.pt") for r in (run, lora_run))
    assert sorted(got) == sorted(want) and any("_lora.B" in k for k in got), sorted(set(got) ^ set(want))[:5]
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_a_changed_base_model_is_refused_at_resume_in_one_line(lora_run, tmp_path):
    """The run's base model folder rewritten with one tensor scaled (same names, shapes and sizes): the
    resume stops before any engine starts, naming the checkpoint, the folder and what differs."""
    run = copy_run(lora_run, tmp_path / "changed")
    weights = run / "base_model" / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(weights), metadata={"format": "pt"})
    rc, out = train(run, *RUN, "trainer.iterations=3", config=QUICKSTART_LORA)
    ckpt = run / "checkpoints" / "iter_0000002"
    assert rc != 0, out[-3000:]
    assert (f"megatron-alp train: error: {ckpt}: its LoRA base {run / 'base_model'} holds other weights than the "
            f"adapters were trained on: the same {len(tensors)} tensors") in out, out[-3000:]
    assert "rollout engine:" not in out, out[-3000:]


def _peft_numel(hf: dict, rank: int) -> int:
    """What PEFT holds for the same adapters: q, k and v each with their own copy of the fused layer's
    A, gate and up too."""
    h = hf["hidden_size"]
    extra = 2 * rank * h + rank * h  # two more copies of linear_qkv's A, one more of linear_fc1's
    return _adapter_numel(hf, rank) + extra * hf["num_hidden_layers"]


def test_adapter_only_sync_serves_the_same_policy_with_the_adapters_bytes(lora_run, tmp_path):
    """lora.sync: adapter: the engine applies the trained adapters itself (vLLM's LoRA) and agrees with
    the trainer as closely as after a merged sync; only the adapters' bytes travel."""
    run = tmp_path / "adapter_sync"
    copy_run(lora_run, run, base_model_only=True)
    lora_train(run, "lora.sync=adapter")
    got, merged = metrics(run), metrics(lora_run)
    hf = json.loads((run / "base_model" / "config.json").read_text())
    for r, m in zip(got, merged):
        assert r["sync/bytes"] == 4 * _peft_numel(hf, rank=8), (r["sync/bytes"], _peft_numel(hf, rank=8))
        assert r["sync/bytes"] < m["sync/bytes"] / 5, (r["sync/bytes"], m["sync/bytes"])
        assert r["sync/verify_mean_abs_diff"] < 2 * m["sync/verify_mean_abs_diff"] + 1e-3, (r, m)
    for key in ROLLOUT_KEYS:  # iteration 0 samples from the base model (B = 0) both ways
        assert got[0][key] == merged[0][key], key


def test_a_target_the_model_lacks_is_one_line(tmp_path):
    rc, out = train(tmp_path / "bad", "lora.target_modules=[experts]", "trainer.sft_warmup_steps=2",
                    config=QUICKSTART_LORA)
    assert rc != 0 and re.search(r"exitcode\s*:\s*2 ", out), out[-3000:]  # torchrun reports the rank's exit 2
    assert "megatron-alp train: error: lora.target_modules: experts not in this dense model (it has linear_fc1" in out


def test_tensor_parallel_lora_reproduces_the_one_rank_run(lora_run, tmp_path):
    _check_layout("tp2_sp", TP2_SP, lora_run, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("layout,overrides", [("pp2", ("parallel.pipeline_model_parallel_size=2",)), ("dp2", ())])
def test_pipeline_and_data_parallel_lora_reproduce_the_one_rank_run(lora_run, tmp_path, layout, overrides):
    _check_layout(layout, overrides, lora_run, tmp_path)


def _check_layout(layout: str, overrides: tuple, reference_run: Path, tmp_path: Path) -> None:
    """Iteration 0's rollouts are equal (same engine, weights and per-sample seeds) and its losses agree
    within ALP's per-rank noise streams (see tests/test_trainer.py's reference comparison); its KL to
    the reference is that noise alone (B = 0), which other streams draw differently. Iteration 1's KL
    to the reference is what the first update moved the adapters by, and must agree. Its rollouts
    come from adapters that differ by the noise's share of the update (about 1e-3 relative under DP2),
    which can change a few tokens the bf16 engine samples: lengths within 1%."""
    run = tmp_path / layout
    copy_run(reference_run, run, base_model_only=True)
    lora_train(run, *overrides, nproc=2)
    got, base = metrics(run), metrics(reference_run)
    assert [r["iteration"] for r in got] == [0, 1]
    for key in ROLLOUT_KEYS:
        assert got[0][key] == base[0][key], (layout, key, got[0][key], base[0][key])
    for key in (k for k in LOSS_KEYS if k != "kl_ref/mean"):
        assert got[0][key] == pytest.approx(base[0][key], rel=2e-2, abs=1e-9), (layout, key, got[0][key], base[0][key])
    assert got[1]["kl_ref/mean"] == pytest.approx(base[1]["kl_ref/mean"], rel=2e-2), (layout, got[1], base[1])
    assert got[1]["response_length/mean"] == pytest.approx(base[1]["response_length/mean"], rel=1e-2), layout
