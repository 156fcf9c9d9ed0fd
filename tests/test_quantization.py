"""The engine options behind rollout.quantization (megatron_alp/rollout/quantization.py)."""

import pytest
import vllm.model_executor.layers.quantization as vq
from vllm.config.quantization import _ONLINE_SHORTHANDS

from megatron_alp.config import RolloutConfig
from megatron_alp.rollout.quantization import vllm_method, vllm_quantization_args


def test_fp8_names_vllms_per_tensor_scheme_not_its_deprecated_alias():
    """The installed vLLM lists the online per-tensor FP8 shorthand, so `fp8` is sent under it (vLLM
    warns that `fp8` for online quantization is a deprecated alias of it); other names pass unchanged."""
    assert "fp8_per_tensor" in vq.QUANTIZATION_METHODS and "fp8_per_tensor" in _ONLINE_SHORTHANDS
    args = vllm_quantization_args(RolloutConfig(quantization="fp8", dtype="bfloat16"), gpu=True)
    assert args == {"quantization": "fp8_per_tensor"}
    per_channel = vllm_quantization_args(RolloutConfig(quantization="fp8_per_channel", dtype="bfloat16"), gpu=False)
    assert per_channel == {"quantization": "fp8_per_channel"}


def test_an_older_vllm_without_the_per_tensor_name_gets_fp8(monkeypatch):
    monkeypatch.setattr(vq, "QUANTIZATION_METHODS", [m for m in vq.QUANTIZATION_METHODS if m != "fp8_per_tensor"])
    assert vllm_method("fp8") == "fp8"
    assert vllm_method("fp8_per_channel") == "fp8_per_channel"


@pytest.mark.parametrize("quantization", ["fp8", "fp8_per_channel"])
def test_every_configurable_name_is_one_the_installed_vllm_accepts(quantization):
    assert vllm_method(quantization) in vq.QUANTIZATION_METHODS
