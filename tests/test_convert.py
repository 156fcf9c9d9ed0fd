"""HF <-> Megatron conversion: mapping, logits vs transformers, bit-exact round trips, resharding,
optimizer checkpoints, the CLI (incl. vLLM loading the export, and trainer checkpoints exporting
on their own) and bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, read_results, torchrun
from safetensors.torch import load_file, save_file

from megatron_alp.models.families import load_hf_config
from megatron_alp.models.tiny import make_tiny_model
from megatron_alp.models.weight_mapping import WeightMapping

FAMILIES = ["qwen2", "qwen3", "llama", "qwen3_moe"]
TOL = 1e-4  # fp32 max |logit diff| vs transformers


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("convert_models")
    for i, family in enumerate(FAMILIES):
        make_tiny_model(family, root / family, seed=10 + i)
    return root


@pytest.fixture(scope="module")
def dist_run(models, tmp_path_factory):
    """One torchrun job: every family at TP=2 / PP=2 (EP=2 for MoE) + checkpoints with sigmas."""
    work = tmp_path_factory.mktemp("convert_dist")
    for family in FAMILIES:
        shutil.copytree(models / family, work / family)
    out = work / "results.json"
    torchrun("check_convert.py", str(work), str(out), *FAMILIES)
    return work, read_results(out)


def convert(*args: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "megatron_alp.cli", "convert", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"convert {' '.join(args)} failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc


def hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_bit_exact(original: Path, exported: Path) -> dict:
    a, b = hf_tensors(original), hf_tensors(exported)
    assert sorted(a) == sorted(b), f"tensor names differ: {sorted(set(a) ^ set(b))[:5]}"
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), f"{name} changed in the round trip"
    return b


# ----------------------------------------------------------------------------------- mapping


@pytest.mark.parametrize("family", FAMILIES)
def test_mapping_expects_exactly_the_hf_tensors(models, family):
    mapping = WeightMapping.from_hf_config(load_hf_config(models / family))
    expected = mapping.hf_names()
    assert len(expected) == len(set(expected))
    assert set(expected) == set(load_file(models / family / "model.safetensors"))
    tied = load_hf_config(models / family)["tie_word_embeddings"]
    assert ("lm_head.weight" in expected) == (not tied)


def test_qkv_and_gate_up_layouts():
    """Megatron's fused QKV is grouped per query group: [q heads of g, k_g, v_g] for each g."""
    mapping = WeightMapping.from_hf_config({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 6, "num_hidden_layers": 1, "vocab_size": 16,
    })
    m = mapping.match("decoder.layers.0.self_attention.linear_qkv.weight")
    d, hidden = 2, 8  # head_dim = hidden / heads
    q = torch.arange(4 * d * hidden, dtype=torch.float32).reshape(4 * d, hidden)
    k = 1000 + torch.arange(2 * d * hidden, dtype=torch.float32).reshape(2 * d, hidden)
    v = 2000 + torch.arange(2 * d * hidden, dtype=torch.float32).reshape(2 * d, hidden)
    fused = mapping.to_mcore(m, [q, k, v])
    expected = torch.cat([q[0:4], k[0:2], v[0:2], q[4:8], k[2:4], v[2:4]])  # group 0, then group 1
    assert torch.equal(fused, expected)
    back = dict(mapping.to_hf(m, fused))
    assert all(torch.equal(back[n], t) for n, t in zip(m.hf_names, (q, k, v)))
    bias = mapping.match("decoder.layers.0.self_attention.linear_qkv.bias")
    fused_b = mapping.to_mcore(bias, [q[:, 0], k[:, 0], v[:, 0]])
    assert torch.equal(fused_b, expected[:, 0])
    fc1 = mapping.match("decoder.layers.0.mlp.linear_fc1.weight")
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    assert torch.equal(mapping.to_mcore(fc1, [gate, up]), torch.cat([gate, up]))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight: shape \(3, 8\)"):
        mapping.to_mcore(m, [q, k[:3], v])


def test_te_spec_names_map_to_the_same_rules(models):
    dense = WeightMapping.from_hf_config(load_hf_config(models / "qwen3"))
    assert dense.match("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight").hf_names == [
        "model.layers.3.input_layernorm.weight"]
    assert dense.match("decoder.layers.2.mlp.linear_fc1.layer_norm_weight").hf_names == [
        "model.layers.2.post_attention_layernorm.weight"]
    moe = WeightMapping.from_hf_config(load_hf_config(models / "qwen3_moe"))
    grouped = moe.match("decoder.layers.1.mlp.experts.linear_fc1.weight3")
    assert grouped.name == "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert grouped.hf_names == ["model.layers.1.mlp.experts.3.gate_proj.weight",
                                "model.layers.1.mlp.experts.3.up_proj.weight"]
    assert moe.match("decoder.layers.1.pre_mlp_layernorm.weight").hf_names == [
        "model.layers.1.post_attention_layernorm.weight"]
    with pytest.raises(KeyError, match="linear_qkv.weight_scale"):
        dense.match("decoder.layers.0.self_attention.linear_qkv.weight_scale")
    with pytest.raises(ValueError, match="expert 4 >= num_experts=4"):
        moe.match("decoder.layers.0.mlp.experts.local_experts.4.linear_fc2.weight")


# ------------------------------------------------------------------------ distributed (gloo)


def test_every_family_matches_transformers_and_round_trips(dist_run):
    _, results = dist_run
    for family in FAMILIES:
        r = results[family]
        n = len(load_file(dist_run[0] / family / "model.safetensors"))
        for layout in ("tp2_pp1_ep1", "tp1_pp2_ep1") + (("tp1_pp1_ep2",) if family == "qwen3_moe" else ()):
            assert r[f"{layout}_logit_diff"] < TOL, (family, layout, r)
            assert r[f"{layout}_exported"] == n, (family, layout, r)
        assert r["tp2_to_pp2_exported"] == n
        # PP=2: stage 0 owns layers 0-1 (sigma on 1), stage 1 layers 2-3 (sigma on 3)
        assert r["pp_stage0_sigma_layers"] == [1] and r["pp_stage1_sigma_layers"] == [3], r
    assert results["qwen3_moe"]["expert_tensors"] == 48


@pytest.fixture(scope="module")
def checkpoint_run(tmp_path_factory):
    """One torchrun job: checkpoints with optimizer state, saved as the trainer saves them."""
    work = tmp_path_factory.mktemp("convert_checkpoint")
    out = work / "results.json"
    torchrun("check_convert_checkpoint.py", str(work), str(out))
    return work, read_results(out)


def test_optimizer_checkpoint_resumes_exactly(checkpoint_run):
    _, r = checkpoint_run
    assert r["distopt0_float32"] == r["distopt1_bfloat16"] == "resumed step identical"
    assert r["tp1_to_tp2_resume_max_diff"] < 1e-6
    assert r["crash_leaves"] == ["iter_0000001"]
    need = f"needs about {r['disk_full_previous_bytes'] / 2**20:.1f} MiB (the size of the last complete one)"
    assert "the disk is full" in r["disk_full"] and need in r["disk_full"], r["disk_full"]
    assert "the previous checkpoints are kept" in r["disk_full"]


# ------------------------------------------------------------------------------------- CLI


def test_cli_trainer_checkpoint_exports_without_hf_ref(checkpoint_run, tmp_path):
    """A checkpoint saved as the trainer saves it holds the HF config and tokenizer: mcore-to-hf
    needs nothing else, and transformers loads the export with the trained Megatron model's
    logits and the original tokenizer. One that holds neither asks for --hf-ref."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work, _ = checkpoint_run
    base, out = work / "base_model", tmp_path / "hf"
    ckpt = work / "ckpt_distopt0_float32" / "checkpoints" / "iter_0000002"
    assert json.loads((ckpt / "megatron_alp.json").read_text())["hf_config"] == load_hf_config(base)
    convert("mcore-to-hf", "--mcore", str(ckpt), "--out", str(out))
    assert json.loads((out / "config.json").read_text()) == {**load_hf_config(base), "dtype": "float32"}
    reference = torch.load(work / "export_reference.pt")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=reference["tokens"]).logits
    assert (logits - reference["logits"]).abs().max().item() < 1e-5  # same fp32 weights: kernel rounding only
    exported, original = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(base)
    text = "Natalia sold 48 clips in April, and half as many in May. <|im_end|>"
    assert exported(text).input_ids == original(text).input_ids
    chat = [{"role": "user", "content": "What is 12 * 7?"}]
    assert exported.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(chat, tokenize=False)

    old = work / "crash_run" / "checkpoints" / "iter_0000001"  # saved without the HF model directory
    proc = convert("mcore-to-hf", "--mcore", str(old), "--out", str(tmp_path / "no_ref"), expect_ok=False)
    assert proc.returncode == 2
    assert f"{old / 'megatron_alp.json'}: the checkpoint records no HF config" in proc.stderr, proc.stderr[-2000:]
    assert "pass --hf-ref" in proc.stderr
    _no_output(tmp_path / "no_ref")


def _logit_diff(output: str) -> float:
    m = re.search(r"max \|logit diff\| = ([0-9.e+-]+)", output)
    assert m, output[-3000:]
    return float(m.group(1))


def test_cli_moe_expert_parallel_round_trip(models, tmp_path):
    """hf-to-mcore at EP=2, export on one rank into sharded safetensors: every expert survives."""
    hf, ckpt, out = models / "qwen3_moe", tmp_path / "mcore", tmp_path / "hf"
    convert("hf-to-mcore", "--hf", str(hf), "--out", str(ckpt), "--ep", "2")
    meta = json.loads((ckpt / "megatron_alp.json").read_text())
    assert meta["layout"]["expert_model_parallel_size"] == 2 and meta["dtype"] == "float32"
    assert (ckpt / "hf" / "tokenizer.json").is_file()
    convert("mcore-to-hf", "--mcore", str(ckpt), "--out", str(out), "--max-shard-size", "200KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    exported = assert_bit_exact(hf, out)
    assert len([n for n in exported if ".mlp.experts." in n]) == 4 * 4 * 3
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (hf / f).read_bytes()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    proc = convert("verify", "--hf", str(hf), "--mcore", str(ckpt))
    assert _logit_diff(proc.stdout) < TOL


def test_cli_bf16_stays_bf16_and_loads_in_vllm(tmp_path):
    """A bf16 checkpoint converts to a bf16 Megatron checkpoint and back bit-exactly; vLLM serves
    the export with transformers' log-probabilities."""
    hf, ckpt, out = tmp_path / "qwen3_bf16", tmp_path / "mcore", tmp_path / "hf"
    make_tiny_model("qwen3", hf, seed=3, dtype="bfloat16")
    proc = convert("hf-to-mcore", "--hf", str(hf), "--out", str(ckpt))
    # the terminal gets one line saying what was written where; library output goes to the log
    assert proc.stdout.strip().splitlines() == [
        f"megatron-alp convert hf-to-mcore: wrote {ckpt} ({len([f for f in ckpt.rglob('*') if f.is_file()])} files, "
        f"{sum(f.stat().st_size for f in ckpt.rglob('*') if f.is_file()) / 2**20:.1f} MiB); library output in "
        f"{ckpt.with_name('mcore.convert.log')}"], proc.stdout + proc.stderr
    assert proc.stderr == "" and "Apex" in ckpt.with_name("mcore.convert.log").read_text()
    assert json.loads((ckpt / "megatron_alp.json").read_text())["dtype"] == "bfloat16"
    convert("mcore-to-hf", "--mcore", str(ckpt), "--out", str(out))
    exported = assert_bit_exact(hf, out)
    assert all(t.dtype == torch.bfloat16 for t in exported.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert _logit_diff(convert("verify", "--hf", str(hf), "--mcore", str(ckpt)).stdout) < TOL

    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from megatron_alp.rollout.vllm.engine import forget_dead_vllm_groups

    prompt = [5, 17, 42, 99, 7]
    forget_dead_vllm_groups()  # torch.distributed may have been torn down by an earlier test
    llm = LLM(model=str(out), dtype="float32", max_model_len=64, enforce_eager=True, seed=0)
    res = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, logprobs=0))
    gen = res[0].outputs[0]
    engine_lp = torch.tensor([d[t].logprob for d, t in zip(gen.logprobs, gen.token_ids)])
    ids = torch.tensor([prompt + list(gen.token_ids)])
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1)[0, len(prompt) - 1: -1]
    ref_lp = logp.gather(-1, ids[0, len(prompt):, None])[:, 0]
    assert (engine_lp - ref_lp).abs().max().item() < 1e-3


def test_cli_reshard_keeps_sigmas_and_export_drops_them(dist_run, models, tmp_path):
    """A TP=2 checkpoint with ALP sigmas on layers 1 and 3, resharded to one rank: each sigma
    stays on its layer; the HF export has no sigma and equals the original HF model."""
    work, _ = dist_run
    src, resharded, out = work / "qwen2_ckpt", tmp_path / "resharded", tmp_path / "hf"
    convert("reshard", "--mcore", str(src), "--out", str(resharded))
    meta = json.loads((resharded / "megatron_alp.json").read_text())
    assert meta["layout"]["world_size"] == 1 and meta["perturbation"]["layers"] == "1,3"
    assert meta["extra"] == {"iteration": 3}
    code = (
        "import os, json, torch.distributed as dist\n"
        "from megatron_alp.runtime.parallel import free_port\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(free_port()), RANK='0', WORLD_SIZE='1')\n"
        "dist.init_process_group('gloo')\n"
        "from megatron.core import dist_checkpointing\n"
        f"t = dist_checkpointing.load_plain_tensors({str(resharded)!r})\n"
        "print(json.dumps({k: v.tolist() for k, v in t.items() if 'alp_perturbation' in k}))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sigmas = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sigmas == {"decoder.layers.1.alp_perturbation.log_sigma": [-2.0],
                      "decoder.layers.3.alp_perturbation.log_sigma": [-4.0]}
    proc = convert("mcore-to-hf", "--mcore", str(resharded), "--out", str(tmp_path / "no_ref"), expect_ok=False)
    assert proc.returncode != 0 and "--hf-ref" in proc.stderr  # no tokenizer files in this checkpoint
    convert("mcore-to-hf", "--mcore", str(resharded), "--out", str(out), "--hf-ref", str(models / "qwen2"))
    exported = assert_bit_exact(models / "qwen2", out)
    assert not [n for n in exported if "alp" in n]
    assert (out / "tokenizer.json").is_file()


# ------------------------------------------------------------------------------- bad input


def _no_output(out: Path) -> None:
    assert not out.exists(), f"{out} was created by a failed conversion"
    assert not list(out.parent.glob(out.name + ".tmp-*")), "temporary output left behind"


def test_bad_architecture(models, tmp_path):
    hf = tmp_path / "mistral"
    shutil.copytree(models / "llama", hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (hf / "config.json").write_text(json.dumps(cfg))
    proc = convert("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "out"), expect_ok=False)
    assert proc.returncode == 2
    assert "unsupported architecture ['MistralForCausalLM']" in proc.stderr, proc.stderr[-2000:]
    _no_output(tmp_path / "out")


def test_missing_shard_and_unmapped_tensor(models, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(models / "llama").save_pretrained(sharded, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models / "llama" / f, sharded / f)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (sharded / victim).unlink()
    proc = convert("hf-to-mcore", "--hf", str(sharded), "--out", str(tmp_path / "out"), expect_ok=False)
    assert proc.returncode == 2 and f"{victim}: shard listed in model.safetensors.index.json is missing" in proc.stderr
    _no_output(tmp_path / "out")

    extra = tmp_path / "extra"
    shutil.copytree(models / "qwen3_moe", extra)
    tensors = load_file(extra / "model.safetensors")
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(4, 64, 64)
    save_file(tensors, extra / "model.safetensors", metadata={"format": "pt"})
    proc = convert("hf-to-mcore", "--hf", str(extra), "--out", str(tmp_path / "out2"), expect_ok=False)
    assert proc.returncode == 2
    assert "model.layers.0.mlp.experts.gate_up_proj has no Megatron parameter" in proc.stderr, proc.stderr[-2000:]
    _no_output(tmp_path / "out2")


def test_shape_mismatch_on_two_ranks_leaves_nothing(models, tmp_path):
    hf = tmp_path / "bad_shape"
    shutil.copytree(models / "qwen2", hf)
    tensors = load_file(hf / "model.safetensors")
    hidden, ffn = tensors["model.layers.2.mlp.down_proj.weight"].shape
    tensors["model.layers.2.mlp.down_proj.weight"] = torch.zeros(hidden, ffn - 32)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    proc = convert("hf-to-mcore", "--hf", str(hf), "--out", str(out), "--tp", "2", expect_ok=False)
    assert proc.returncode != 0
    assert (f"model.layers.2.mlp.down_proj.weight: shape ({hidden}, {ffn - 32}) does not fit Megatron parameter "
            f"decoder.layers.2.mlp.linear_fc2.weight of shape ({hidden}, {ffn})") in proc.stderr, proc.stderr[-3000:]
    _no_output(out)


def test_layout_and_output_errors(models, tmp_path):
    proc = convert("hf-to-mcore", "--hf", str(models / "qwen3"), "--out", str(tmp_path / "out"), "--tp", "3",
                   expect_ok=False)
    assert proc.returncode == 2
    assert "parallel.tensor_model_parallel_size=3 does not divide the model's num_attention_heads=4" in proc.stderr
    _no_output(tmp_path / "out")
    existing = tmp_path / "existing"
    existing.mkdir()
    proc = convert("hf-to-mcore", "--hf", str(models / "qwen3"), "--out", str(existing), expect_ok=False)
    assert proc.returncode == 2 and "already exists" in proc.stderr
    proc = convert("mcore-to-hf", "--mcore", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"), expect_ok=False)
    assert proc.returncode == 2 and "no such checkpoint directory" in proc.stderr
