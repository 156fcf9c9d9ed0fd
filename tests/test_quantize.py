"""`megatron-alp convert quantize` (checkpoint_tools/quantize.py): nvidia-modelopt's FP8 and NVFP4
checkpoints of a tiny model, checked against the formats' definitions: FP8 e4m3 per-tensor weights
with scale max|W|/448 and static input scales max|x|/448 over the calibration data; NVFP4 e2m1
weights, two per byte (low nibble first), in blocks of 16 with an e4m3 block scale and a global
scale. Serving the result in vLLM needs its GPU kernels (a GPU test)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
CALIB = ROOT / "data" / "largest" / "val.jsonl"
SAMPLES = 12
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX, E2M1_MAX = 448.0, 6.0
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])

pytestmark = pytest.mark.skipif(__import__("importlib").util.find_spec("modelopt") is None,
                                reason="nvidia-modelopt is not installed (pip install nvidia-modelopt)")


def convert(*args: str) -> subprocess.Popen:
    """``megatron-alp convert ARGS`` as the user runs it, in a process of its own (started, not awaited)."""
    # without the rendezvous this process's own torch.distributed group left in the environment
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    env = {**{k: v for k, v in os.environ.items() if k not in rendezvous}, "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "megatron_alp.cli", "convert", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model):
    """A tiny Qwen3, its Megatron checkpoint, FP8 from the checkpoint and NVFP4 from the HF folder:
    the two quantizations run as the user runs them, each in its own process, side by side."""
    from checkpoint_tools.hf_to_mcore import convert as hf_to_mcore

    from megatron_alp.commands.context import one_process
    from megatron_alp.config import ParallelConfig

    root = tmp_path_factory.mktemp("quantize")
    hf = shutil.copytree(tiny_model("qwen3", seed=5), root / "hf")
    with one_process(seed=0):
        hf_to_mcore(hf, root / "mcore", ParallelConfig())
    procs = {fmt: convert("quantize", *source, "--out", str(root / fmt), "--format", fmt, "--calib", str(CALIB),
                          "--calib-samples", str(SAMPLES))
             for fmt, source in (("fp8", ["--mcore", str(root / "mcore")]), ("nvfp4", ["--hf", str(hf)]))}
    runs = {}
    for fmt, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        runs[fmt] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        assert runs[fmt].returncode == 0, runs[fmt].stderr[-3000:]
    return root, runs


def reference_weights(hf: Path) -> dict[str, torch.Tensor]:
    """The source weights as the quantizer sees them (loaded in bfloat16)."""
    return {k: v.to(torch.bfloat16).float() for k, v in load_file(hf / "model.safetensors").items()}


def linear_names(weights: dict) -> list[str]:
    return sorted(k.removesuffix(".weight") for k in weights if k.endswith(".weight") and k.split(".")[-2] in PROJ)


@pytest.fixture(scope="module")
def input_amax(exported) -> dict[str, float]:
    return calibration_input_amax(exported[0] / "hf")


def calibration_input_amax(hf: Path) -> dict[str, float]:
    """max |input| of every projection over the calibration samples (each prompt in the chat
    template, then its answer), from the bfloat16 model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16).eval()
    amax: dict[str, float] = {}
    for name, module in model.named_modules():
        if name.split(".")[-1] in PROJ:
            module.register_forward_pre_hook(
                lambda m, args, name=name: amax.__setitem__(name, max(amax.get(name, 0.0),
                                                                       args[0].abs().max().item())))
    rows = [json.loads(line) for line in CALIB.read_text().splitlines()[:SAMPLES]]
    with torch.no_grad():
        for row in rows:
            text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
            ids += tok.encode(str(row["reward_model"]["ground_truth"]), add_special_tokens=False)
            model(input_ids=torch.tensor([ids]))
    return amax


def test_the_command_is_quiet_and_says_what_it_wrote(exported):
    root, runs = exported
    for fmt, proc in runs.items():
        lines = proc.stdout.strip().splitlines()
        assert lines[-1].startswith(f"megatron-alp convert quantize: wrote {root / fmt} ("), proc.stdout
        assert proc.stderr == "", proc.stderr[-2000:]
        assert "modelopt" in (root / f"{fmt}.convert.log").read_text().lower()
    assert "exporting" in runs["fp8"].stdout  # a Megatron checkpoint is exported to HF first
    assert not list(root.glob("*.tmp-*")) and not list(root.glob("*.export-*"))


def test_fp8_weights_and_scales_follow_the_format(exported, input_amax):
    root, _ = exported
    config = json.loads((root / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert config["quantization_config"]["quant_algo"] == "FP8"
    ref, q = reference_weights(root / "hf"), load_file(root / "fp8" / "model.safetensors")
    amax = input_amax
    names = linear_names(q)
    assert len(names) == 4 * len(PROJ)  # every projection of the 4 layers
    for name in names:
        W, w, s = ref[name + ".weight"], q[name + ".weight"], q[name + ".weight_scale"]
        assert w.dtype == torch.float8_e4m3fn and s.numel() == 1
        assert s.item() == pytest.approx(W.abs().max().item() / E4M3_MAX, rel=1e-6)
        # round to nearest in e4m3: half an ulp (3 mantissa bits) or half the subnormal step 2^-9
        err = (w.float() * s - W).abs()
        assert bool((err <= W.abs() * 2 ** -4 + s * 2 ** -10 + 1e-12).all()), name
        assert q[name + ".input_scale"].item() == pytest.approx(amax[name] / E4M3_MAX, rel=1e-5), name
    for kept in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"):
        assert q[kept].dtype == torch.bfloat16 and torch.equal(q[kept].float(), ref[kept])
    assert (root / "fp8" / "tokenizer_config.json").is_file()


def test_nvfp4_blocks_decode_to_the_weights(exported, input_amax):
    root, _ = exported
    config = json.loads((root / "nvfp4" / "config.json").read_text())
    assert config["quantization_config"]["quant_algo"] == "NVFP4"
    ref, q = reference_weights(root / "hf"), load_file(root / "nvfp4" / "model.safetensors")
    amax = input_amax
    for name in linear_names(q):
        W, packed = ref[name + ".weight"], q[name + ".weight"]
        block, glob = q[name + ".weight_scale"], q[name + ".weight_scale_2"]
        assert packed.dtype == torch.uint8 and packed.shape == (W.shape[0], W.shape[1] // 2)
        assert block.dtype == torch.float8_e4m3fn and block.shape == (W.shape[0], W.shape[1] // 16)
        values = torch.stack([E2M1[(packed & 15).long()], E2M1[(packed >> 4).long()]], -1).reshape(W.shape)
        scale = block.float().repeat_interleave(16, dim=1) * glob
        decoded = values * scale
        # each block's largest weight sits near the top of e2m1's range, and nothing is far outside it
        assert bool((W.abs() <= E2M1_MAX * scale * 1.07 + 1e-9).all()), name
        # 4-bit values: about 10% relative error for Gaussian weights; decoding high nibble first
        # gives ~140%, so this also pins the order vLLM reads
        assert ((decoded - W).norm() / W.norm()).item() < 0.12, name
        assert q[name + ".input_scale"].item() == pytest.approx(amax[name] / (E2M1_MAX * E4M3_MAX), rel=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--format", "fp8", "--calib", "missing.jsonl"], "data file missing.jsonl does not exist"),
    (["--format", "fp8", "--calib", str(CALIB), "--calib-samples", "0"], "--calib-samples must be >= 1 (got 0)"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, tiny_model, capfd, args, message):
    """Refused before anything is written (in this process: what a real process's terminal shows of
    the command is test_the_command_is_quiet_and_says_what_it_wrote's)."""
    from megatron_alp.cli import main as cli_main

    rc = cli_main(["convert", "quantize", "--hf", str(tiny_model("qwen3")), "--out", str(tmp_path / "q"), *args])
    out, err = capfd.readouterr()
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [f"megatron-alp convert quantize: error: {message}"], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="serving FP8 needs vLLM's CUDA kernels: GPU only")
def test_vllm_serves_the_fp8_export_close_to_the_source(exported):
    from vllm import LLM, SamplingParams

    root, _ = exported
    prompts = ["What is the largest number in [6,0,4,8]?", "1 + 1 ="]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    outs = {}
    for name in ("hf", "fp8"):
        llm = LLM(str(root / name), enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.3)
        outs[name] = llm.generate(prompts, params)
        del llm
    for ref, quant in zip(outs["hf"], outs["fp8"]):
        assert len(quant.outputs[0].token_ids) > 0
        first_ref = next(iter(ref.outputs[0].logprobs[0].values())).logprob
        first_q = next(iter(quant.outputs[0].logprobs[0].values())).logprob
        assert abs(first_ref - first_q) < 0.5
