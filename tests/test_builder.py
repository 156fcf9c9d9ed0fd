"""HF config -> Megatron GPTModel on the CPU: every family's logits under TP/PP/SP/EP equal the
single-rank model's (torchrun, gloo), and unsupported families and layouts are named errors."""

import pytest
from helpers import dist_job, read_results

from megatron_alp.config import ParallelConfig
from megatron_alp.models.families import hf_to_megatron
from megatron_alp.models.tiny import tiny_hf_config
from megatron_alp.training.builder import check_parallel_layout


FAMILIES = ["qwen2", "qwen3", "llama", "qwen3_moe"]
LOGITS = {family: dist_job(f"parallel_logits_{family}", "check_parallel_logits.py", family, "{dir}/r.json")
          for family in FAMILIES}


@pytest.mark.parametrize("family", [pytest.param(f, marks=LOGITS[f]) for f in FAMILIES])
def test_parallel_layouts_match_single_rank_logits(family, dist_jobs):
    """TP=2 with and without sequence parallel, PP=2 (and EP=2 for MoE) give TP=1 logits."""
    diffs = read_results(dist_jobs.run(f"parallel_logits_{family}") / "r.json")
    assert len(diffs) == 3 and max(diffs.values()) < 2e-5


def test_family_and_layout_errors():
    with pytest.raises(ValueError, match="unsupported architecture"):
        hf_to_megatron({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    yarn = tiny_hf_config("qwen2", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        hf_to_megatron(yarn)
    args = hf_to_megatron(tiny_hf_config("qwen2"))
    with pytest.raises(ValueError, match="tensor_model_parallel_size=8 does not divide the model's num_attention_heads=4"):
        check_parallel_layout(args, ParallelConfig(tensor_model_parallel_size=8))
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=3 does not divide"):
        check_parallel_layout(args, ParallelConfig(pipeline_model_parallel_size=3))
    moe = hf_to_megatron(tiny_hf_config("qwen3_moe"))
    with pytest.raises(ValueError, match="sequence_parallel must be true for a mixture-of-experts"):
        check_parallel_layout(moe, ParallelConfig(tensor_model_parallel_size=2))
    q3 = hf_to_megatron(tiny_hf_config("qwen3"))
    assert q3.transformer["kv_channels"] == 64 and q3.transformer["qk_layernorm"]
    assert not q3.transformer["add_qkv_bias"] and args.transformer["add_qkv_bias"]


def test_layer_spec_never_falls_back_silently(monkeypatch):
    """auto is the local spec on the CPU; on a GPU whose Transformer Engine does not import, auto and te
    fail loudly, naming the key and the import error, instead of training with unfused modules."""
    from megatron_alp.models import layer_spec

    assert layer_spec.resolve_spec("auto") == "local" and layer_spec.resolve_spec("local") == "local"
    with pytest.raises(RuntimeError, match="model.layer_spec: te needs an NVIDIA GPU"):
        layer_spec.resolve_spec("te")
    monkeypatch.setattr(layer_spec, "has_gpu", lambda: True)
    monkeypatch.setattr(layer_spec, "te_import_error", lambda: "ImportError: libcudart.so.13 missing")
    for choice in ("auto", "te"):
        with pytest.raises(RuntimeError, match=rf"model.layer_spec: {choice} .*libcudart.*layer_spec: local"):
            layer_spec.resolve_spec(choice)
    assert layer_spec.resolve_spec("local") == "local"
    monkeypatch.setattr(layer_spec, "te_import_error", lambda: None)
    assert layer_spec.resolve_spec("auto") == "te"



@pytest.mark.parametrize("pytorch_module, error", [
    ("raise ImportError('flash_attn_2_cuda: undefined symbol _ZN3c10')", "ImportError: flash_attn_2_cuda"),
    ("Linear = object", None),
])
def test_te_check_imports_the_pytorch_modules(tmp_path, monkeypatch, pytorch_module, error):
    """A Transformer Engine whose PyTorch submodule fails to import still imports as a package (its
    __init__ swallows the error, as TE's does); the startup check reports that submodule's error."""
    import importlib
    import sys

    from megatron_alp.models import layer_spec

    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("try:\n    from . import pytorch\nexcept ImportError:\n    pass\n")
    (package / "pytorch" / "__init__.py").write_text(pytorch_module + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    try:
        assert importlib.import_module("transformer_engine").__file__.startswith(str(tmp_path))
        sys.modules.pop("transformer_engine.pytorch", None)
        got = layer_spec.te_import_error()
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
            sys.modules.pop(name)
    assert (got is None) if error is None else got.startswith(error), got
