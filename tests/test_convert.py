"""HF <-> Megatron conversion: mapping, logits vs transformers, bit-exact round trips, resharding,
optimizer checkpoints, the CLI (incl. vLLM loading the export, and trainer checkpoints exporting
on their own) and bad input.

The multi-rank checks run in tests/dist/check_convert.py and check_convert_checkpoint.py; the CLI's
conversions run by its own entry, one after the other in one process, in check_convert_cli.py (a
two-rank command launches its ranks itself); bad input, refused before any rank starts, runs here
through the same entry; one conversion runs as a real process, for what its terminal shows."""

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
from helpers import ROOT, dist_job, read_results
from safetensors.torch import load_file, save_file

from megatron_alp.models.families import load_hf_config
from megatron_alp.models.tiny import make_tiny_model
from megatron_alp.models.weight_mapping import WeightMapping

FAMILIES = ["qwen2", "qwen3", "llama", "qwen3_moe"]
SEEDS = {"qwen2": 10, "qwen3": 11, "llama": 12, "qwen3_moe": 13}  # as tests/dist/check_convert.py makes them
TOL = 1e-4  # fp32 max |logit diff| vs transformers

# every family at TP=2 / PP=2 (EP=2 for MoE) + checkpoints with sigmas; checkpoints with optimizer state
# saved as the trainer saves them; then the CLI's conversions of both
DIST = dist_job("convert", "check_convert.py", "{dir}", "{dir}/results.json", *FAMILIES)
CHECKPOINTS = dist_job("convert_checkpoint", "check_convert_checkpoint.py", "{dir}", "{dir}/results.json")
CLI = dist_job("convert_cli", "check_convert_cli.py", "{dir}", "{dir:convert}", "{dir:convert_checkpoint}", nproc=1,
               after=("convert", "convert_checkpoint"))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("convert_models")
    for family in FAMILIES:
        make_tiny_model(family, root / family, seed=SEEDS[family])
    return root


@pytest.fixture(scope="module")
def dist_run(dist_jobs):
    work = dist_jobs.run("convert")
    return work, read_results(work / "results.json")


@pytest.fixture(scope="module")
def checkpoint_run(dist_jobs):
    work = dist_jobs.run("convert_checkpoint")
    return work, read_results(work / "results.json")


@pytest.fixture(scope="module")
def cli_run(dist_jobs):
    """(check_convert_cli.py's folder, its commands: step -> rc, out, err), and the folders it read."""
    work = dist_jobs.run("convert_cli")
    return work, json.loads((work / "commands.json").read_text()), dist_jobs.dir("convert")


def ok(commands: dict, step: str) -> dict:
    c = commands[step]
    assert c["rc"] == 0, f"convert {step} failed (rc={c['rc']}):\n{c['err'][-6000:]}"
    return c


def convert_here(capsys, *args: str) -> tuple[int, str]:
    """`megatron-alp convert ARGS` by its entry in this process, for bad input (refused before any rank
    starts, so nothing here makes a process group): (status, stderr)."""
    from megatron_alp.cli import main

    capsys.readouterr()
    rc = main(["convert", *args])
    return rc, capsys.readouterr().err


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


@DIST
def test_every_family_matches_transformers_and_round_trips(dist_run):
    work, results = dist_run
    for family in FAMILIES:
        r = results[family]
        n = len(load_file(work / family / "model.safetensors"))
        for layout in ("tp2_pp1_ep1", "tp1_pp2_ep1") + (("tp1_pp1_ep2",) if family == "qwen3_moe" else ()):
            assert r[f"{layout}_logit_diff"] < TOL, (family, layout, r)
            assert r[f"{layout}_exported"] == n, (family, layout, r)
        assert r["tp2_to_pp2_exported"] == n
        # PP=2: stage 0 owns layers 0-1 (sigma on 1), stage 1 layers 2-3 (sigma on 3)
        assert r["pp_stage0_sigma_layers"] == [1] and r["pp_stage1_sigma_layers"] == [3], r
    assert results["qwen3_moe"]["expert_tensors"] == 48


@CHECKPOINTS
def test_optimizer_checkpoint_resumes_exactly(checkpoint_run):
    _, r = checkpoint_run
    assert r["distopt0_float32"] == r["distopt1_bfloat16"] == "resumed step identical"
    assert r["tp1_to_tp2_resume_max_diff"] < 1e-6
    assert r["crash_leaves"] == ["iter_0000001"]
    need = f"needs about {r['disk_full_previous_bytes'] / 2**20:.1f} MiB (the size of the last complete one)"
    assert "the disk is full" in r["disk_full"] and need in r["disk_full"], r["disk_full"]
    assert "the previous checkpoints are kept" in r["disk_full"]


# ------------------------------------------------------------------------------------- CLI


@CHECKPOINTS
@CLI
def test_cli_trainer_checkpoint_exports_without_hf_ref(checkpoint_run, cli_run, tmp_path, capsys):
    """A checkpoint saved as the trainer saves it holds the HF config and tokenizer: mcore-to-hf
    needs nothing else, and transformers loads the export with the trained Megatron model's
    logits and the original tokenizer. One that holds neither asks for --hf-ref."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work, _ = checkpoint_run
    cli, commands, _ = cli_run
    ok(commands, "trainer_export")
    base, out = work / "base_model", cli / "trainer_hf"
    ckpt = work / "ckpt_distopt0_float32" / "checkpoints" / "iter_0000002"
    assert json.loads((ckpt / "megatron_alp.json").read_text())["hf_config"] == load_hf_config(base)
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
    rc, err = convert_here(capsys, "mcore-to-hf", "--mcore", str(old), "--out", str(tmp_path / "no_ref"))
    assert rc == 2
    assert f"{old / 'megatron_alp.json'}: the checkpoint records no HF config" in err, err[-2000:]
    assert "pass --hf-ref" in err
    _no_output(tmp_path / "no_ref")


def _logit_diff(output: str) -> float:
    m = re.search(r"max \|logit diff\| = ([0-9.e+-]+)", output)
    assert m, output[-3000:]
    return float(m.group(1))


@CLI
def test_cli_moe_expert_parallel_round_trip(cli_run):
    """hf-to-mcore at EP=2 (the command launches its two ranks), export on one rank into sharded
    safetensors: every expert survives."""
    cli, commands, convert_dir = cli_run
    hf, ckpt, out = convert_dir / "qwen3_moe", cli / "moe_mcore", cli / "moe_hf"
    ok(commands, "moe_to_mcore")
    meta = json.loads((ckpt / "megatron_alp.json").read_text())
    assert meta["layout"]["expert_model_parallel_size"] == 2 and meta["dtype"] == "float32"
    assert (ckpt / "hf" / "tokenizer.json").is_file()
    ok(commands, "moe_to_hf")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    exported = assert_bit_exact(hf, out)
    assert len([n for n in exported if ".mlp.experts." in n]) == 4 * 4 * 3
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (hf / f).read_bytes()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert _logit_diff(ok(commands, "moe_verify")["out"]) < TOL


def test_a_conversion_says_one_line_and_logs_the_rest(tmp_path):
    """A real `megatron-alp convert` process: the terminal gets one line saying what was written where
    (nothing on stderr, import-time warnings included); library output goes to the log."""
    hf, ckpt = tmp_path / "qwen3_bf16", tmp_path / "mcore"
    make_tiny_model("qwen3", hf, seed=3, dtype="bfloat16")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "megatron_alp.cli", "convert", "hf-to-mcore", "--hf", str(hf),
                           "--out", str(ckpt)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.strip().splitlines() == [
        f"megatron-alp convert hf-to-mcore: wrote {ckpt} ({len([f for f in ckpt.rglob('*') if f.is_file()])} files, "
        f"{sum(f.stat().st_size for f in ckpt.rglob('*') if f.is_file()) / 2**20:.1f} MiB); library output in "
        f"{ckpt.with_name('mcore.convert.log')}"], proc.stdout + proc.stderr
    assert proc.stderr == "" and "Apex" in ckpt.with_name("mcore.convert.log").read_text()
    assert json.loads((ckpt / "megatron_alp.json").read_text())["dtype"] == "bfloat16"


@CLI
def test_cli_bf16_stays_bf16_and_loads_in_vllm(cli_run):
    """A bf16 checkpoint converts to a bf16 Megatron checkpoint and back bit-exactly; vLLM serves
    the export with transformers' log-probabilities."""
    cli, commands, _ = cli_run
    hf, ckpt, out = cli / "qwen3_bf16", cli / "bf16_mcore", cli / "bf16_hf"
    assert ok(commands, "bf16_to_mcore")["out"].strip().splitlines() == [  # our one line; the rest in the log
        f"megatron-alp convert hf-to-mcore: wrote {ckpt} ({len([f for f in ckpt.rglob('*') if f.is_file()])} files, "
        f"{sum(f.stat().st_size for f in ckpt.rglob('*') if f.is_file()) / 2**20:.1f} MiB); library output in "
        f"{ckpt.with_name('bf16_mcore.convert.log')}"]
    assert json.loads((ckpt / "megatron_alp.json").read_text())["dtype"] == "bfloat16"
    ok(commands, "bf16_to_hf")
    exported = assert_bit_exact(hf, out)
    assert all(t.dtype == torch.bfloat16 for t in exported.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert _logit_diff(ok(commands, "bf16_verify")["out"]) < TOL

    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from megatron_alp.rollout.vllm.process import forget_dead_vllm_groups

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


@CLI
def test_cli_reshard_keeps_sigmas_and_export_drops_them(cli_run, tmp_path, capsys):
    """A TP=2 checkpoint with ALP sigmas on layers 1 and 3, resharded to one rank: each sigma
    stays on its layer; the HF export has no sigma and equals the original HF model."""
    cli, commands, convert_dir = cli_run
    resharded, out = cli / "resharded", cli / "resharded_hf"
    ok(commands, "reshard")
    meta = json.loads((resharded / "megatron_alp.json").read_text())
    assert meta["layout"]["world_size"] == 1 and meta["perturbation"]["layers"] == "1,3"
    assert meta["extra"] == {"iteration": 3}
    sigmas = json.loads((cli / "sigmas.json").read_text())
    assert sigmas == {"decoder.layers.1.alp_perturbation.log_sigma": [-2.0],
                      "decoder.layers.3.alp_perturbation.log_sigma": [-4.0]}
    rc, err = convert_here(capsys, "mcore-to-hf", "--mcore", str(resharded), "--out", str(tmp_path / "no_ref"))
    assert rc != 0 and "--hf-ref" in err  # no tokenizer files in this checkpoint
    ok(commands, "resharded_to_hf")
    exported = assert_bit_exact(convert_dir / "qwen2", out)
    assert not [n for n in exported if "alp" in n]
    assert (out / "tokenizer.json").is_file()


# ------------------------------------------------------------------------------- bad input


def _no_output(out: Path) -> None:
    assert not out.exists(), f"{out} was created by a failed conversion"
    assert not list(out.parent.glob(out.name + ".tmp-*")), "temporary output left behind"


def test_bad_architecture(models, tmp_path, capsys):
    hf = tmp_path / "mistral"
    shutil.copytree(models / "llama", hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (hf / "config.json").write_text(json.dumps(cfg))
    rc, err = convert_here(capsys, "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "out"))
    assert rc == 2
    assert "unsupported architecture ['MistralForCausalLM']" in err, err[-2000:]
    _no_output(tmp_path / "out")


def test_missing_shard_and_unmapped_tensor(models, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(models / "llama").save_pretrained(sharded, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models / "llama" / f, sharded / f)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (sharded / victim).unlink()
    rc, err = convert_here(capsys, "hf-to-mcore", "--hf", str(sharded), "--out", str(tmp_path / "out"))
    assert rc == 2 and f"{victim}: shard listed in model.safetensors.index.json is missing" in err
    _no_output(tmp_path / "out")

    extra = tmp_path / "extra"
    shutil.copytree(models / "qwen3_moe", extra)
    tensors = load_file(extra / "model.safetensors")
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(4, 64, 64)
    save_file(tensors, extra / "model.safetensors", metadata={"format": "pt"})
    rc, err = convert_here(capsys, "hf-to-mcore", "--hf", str(extra), "--out", str(tmp_path / "out2"))
    assert rc == 2
    assert "model.layers.0.mlp.experts.gate_up_proj has no Megatron parameter" in err, err[-2000:]
    _no_output(tmp_path / "out2")


@CLI
def test_shape_mismatch_on_two_ranks_leaves_nothing(cli_run):
    """hf-to-mcore --tp 2 of a qwen2 model with one tensor too narrow: the two ranks it launched fail
    naming the tensor and the parameter, and nothing is left behind."""
    cli, commands, _ = cli_run
    hidden, ffn = load_file(cli / "bad_shape" / "model.safetensors")["model.layers.2.mlp.down_proj.weight"].shape
    c = commands["shape_mismatch"]
    assert c["rc"] != 0
    assert (f"model.layers.2.mlp.down_proj.weight: shape ({hidden}, {ffn}) does not fit Megatron parameter "
            f"decoder.layers.2.mlp.linear_fc2.weight of shape ({hidden}, {ffn + 32})") in c["err"], c["err"][-3000:]
    _no_output(cli / "bad_shape_mcore")


def test_layout_and_output_errors(models, tmp_path, capsys):
    rc, err = convert_here(capsys, "hf-to-mcore", "--hf", str(models / "qwen3"), "--out", str(tmp_path / "out"),
                           "--tp", "3")
    assert rc == 2
    assert "parallel.tensor_model_parallel_size=3 does not divide the model's num_attention_heads=4" in err
    _no_output(tmp_path / "out")
    existing = tmp_path / "existing"
    existing.mkdir()
    rc, err = convert_here(capsys, "hf-to-mcore", "--hf", str(models / "qwen3"), "--out", str(existing))
    assert rc == 2 and "already exists" in err
    rc, err = convert_here(capsys, "mcore-to-hf", "--mcore", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"))
    assert rc == 2 and "no such checkpoint directory" in err
