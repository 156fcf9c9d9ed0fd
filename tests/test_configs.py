"""Every shipped config validates, the paper's experiments carry the paper's settings, and each
parallel layout fits its nodes and model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import MODELS

from megatron_alp.config import TIR_SYSTEM_PROMPT, ConfigError, DataConfig, parse_layer_selection
from megatron_alp.resolve import config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
PAPER = [p for p in CONFIGS if not p.name.startswith("quickstart")]

TOKEN_LOSSES = {"alp_token", "grpo", "token_mis", "token_tis"}
EXPECTED = {  # the paper's experiments, each a ready config
    "qwen2.5-math-1.5b_token_alp": "alp_token", "qwen2.5-math-1.5b_seq_alp": "alp_seq",
    "qwen2.5-math-1.5b_grpo": "grpo", "qwen2.5-math-1.5b_token_mis": "token_mis",
    "qwen2.5-math-1.5b_seq_mis": "seq_mis", "qwen2.5-math-1.5b_seq_bypass": "seq_bypass",
    "qwen3-4b_seq_alp": "alp_seq", "qwen2.5-7b_tir_seq_alp": "alp_seq",
    "qwen2.5-math-1.5b_ablation_layers_0-4": "alp_token", "qwen2.5-math-1.5b_ablation_layers_12-16": "alp_token",
    "qwen2.5-math-1.5b_ablation_layers_19-23": "alp_token", "qwen2.5-math-1.5b_ablation_logits_only": "alp_token",
    "qwen3-30b-a3b_seq_alp": "alp_seq", "qwen2.5-32b_seq_alp": "alp_seq",
    "qwen3-16b-a3b_seq_alp": "alp_seq",
}


def test_all_experiments_present():
    assert {p.stem for p in PAPER} >= set(EXPECTED)
    for stem, loss in EXPECTED.items():
        assert load_config(ROOT / "configs" / f"{stem}.yaml").loss.name == loss, stem


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path):
    cfg = load_config(path)
    assert cfg.trainer.output_dir


@pytest.mark.parametrize("path", [p for p in CONFIGS if p not in PAPER], ids=lambda p: p.name)
def test_a_quickstart_switches_loss_by_its_name_alone(path):
    """The quickstarts leave perturbation.enabled to the loss, so `loss.name=grpo` runs the
    baseline rather than being refused as ALP under a baseline's name."""
    assert load_config(path, gpu=False).perturbation.enabled  # its ALP loss perturbs
    for name in ("grpo", "token_tis", "cispo"):
        assert load_config(path, [f"loss.name={name}"], gpu=False).perturbation.enabled is False, name


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_paper_settings(path):
    cfg = load_config(path)
    # the paper's full-weight LR; adapters take a larger step (LoRA RL practice: 10-20x)
    assert cfg.optimizer.lr == (2e-5 if cfg.lora.enabled else 1e-6) and cfg.optimizer.weight_decay == 0.01
    assert cfg.trainer.prompts_per_iteration == 512 and cfg.trainer.updates_per_iteration == 16
    s = cfg.rollout.sampling
    assert s.n == 8 and s.temperature == 1.0 and s.max_prompt_length == 2048
    assert s.max_response_length == (16384 if cfg.tir.enabled else 2048)
    loss = cfg.loss
    assert loss.dual_clip_c == 10.0 and loss.kl_coef == 0.001 and loss.entropy_coef == 0.001
    expected_clip = (0.2, 0.28) if loss.name in TOKEN_LOSSES else (0.5, 3.0)
    assert (loss.clip_low, loss.clip_high) == expected_clip
    if loss.name.endswith("_mis"):
        assert loss.mis_threshold == 2.0
    alp = loss.name.startswith("alp_")
    assert cfg.perturbation.enabled == alp, "ALP configs perturb, baselines do not"
    if alp:
        assert cfg.perturbation.init_std == 1e-4 and cfg.perturbation.lr == 5e-4
    assert (cfg.eval.k, cfg.eval.temperature, cfg.eval.max_response_length) == (32, 1.0, 4096)
    assert len(cfg.eval.files) == 5
    assert cfg.model.hf_path.startswith("/models/"), "placeholders users replace with their checkpoints"


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_parallel_layout_fits_nodes_and_model(path):
    """The layout divides the GPUs named in the header (the trainer's, with separate engines), the
    model's heads and layers, and the batch."""
    cfg = load_config(path)
    header = path.read_text().split("\n\n")[0]
    m = re.search(r"Hardware: (\d+) nodes? x (\d+) H100", header)
    assert m, f"{path.name}: header must name its hardware ('Hardware: N node(s) x 8 H100')"
    per_node = int(m.group(2))
    engine_gpus = cfg.rollout.gpus if cfg.rollout.placement == "separate" else []
    assert all(g < per_node for g in engine_gpus), "rollout.gpus are GPUs of the node"
    world = int(m.group(1)) * (per_node - len(engine_gpus))  # the trainer's ranks: the GPUs the engines leave
    assert min(engine_gpus, default=per_node) >= per_node - len(engine_gpus), "trainer ranks take the first GPUs"
    layers, heads, kv_heads = MODELS[Path(cfg.model.hf_path).name]
    p = cfg.parallel
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    assert world % (tp * pp) == 0 and world % (etp * ep * pp) == 0
    assert heads % tp == 0 and kv_heads % tp == 0 and layers % pp == 0
    assert tp <= int(m.group(2)), "tensor parallelism stays inside a node"
    dp = world // (tp * pp)
    assert (cfg.trainer.prompts_per_iteration * cfg.rollout.sampling.n) % (dp * cfg.trainer.updates_per_iteration) == 0
    if cfg.perturbation.enabled and cfg.perturbation.layers not in ("all", "logits"):
        parse_layer_selection(cfg.perturbation.layers, layers)
    assert cfg.rollout.tensor_parallel_size <= int(m.group(2))


def test_layer_ablations_match_the_paper():
    chosen = {}
    for path in PAPER:
        if "ablation" in path.stem:
            cfg = load_config(path)
            chosen[path.stem] = parse_layer_selection(cfg.perturbation.layers, 28)
    assert sorted(chosen.values(), key=lambda s: -1 if s is None else min(s)) == [
        None, set(range(0, 5)), set(range(12, 17)), set(range(19, 24))]


def test_tir_and_moe_specifics():
    tir = load_config(ROOT / "configs" / "qwen2.5-7b_tir_seq_alp.yaml")
    assert tir.tir.enabled and tir.tir.max_turns == 5 and tir.tir.mask_void_turns
    assert tir.trainer.prompts_per_iteration // tir.trainer.updates_per_iteration == 32  # mini-update size
    for name in ("qwen3-30b-a3b_seq_alp.yaml", "qwen3-16b-a3b_seq_alp.yaml"):
        moe = load_config(ROOT / "configs" / name)
        assert moe.parallel.expert_model_parallel_size == 8
        # R3: the engine's routing replayed in every pass, the noise kept off the expert choice,
        # no load-balancing loss, every GPU generating with vLLM (which returns the routing)
        assert moe.moe.routing_replay == "r3" and moe.rollout.return_routed_experts
        assert moe.perturbation.moe_routing == "fixed" and moe.moe.aux_loss_coeff == 0.0
        assert moe.rollout.engine == "vllm" and moe.rollout.replicas == "auto"


def test_tir_system_prompt_and_warm_start_format():
    """TIR runs tell the model about the interpreter unless the config says otherwise; the TIR warm
    start needs TIR rollouts."""
    tir = load_config(ROOT / "configs" / "qwen2.5-7b_tir_seq_alp.yaml")
    assert tir.data.system_prompt == TIR_SYSTEM_PROMPT and not tir.data.replace_system_prompt
    quick = load_config(ROOT / "configs" / "quickstart_tir_cpu.yaml")
    assert "```python" in quick.data.system_prompt and "```output" in quick.data.system_prompt
    assert quick.data.replace_system_prompt and quick.tir.enabled and quick.tir.tool_format == "inline"
    assert quick.trainer.sft_warmup_format == "tir" and quick.loss.name == "alp_seq"
    default = load_config(ROOT / "configs" / "quickstart_tir_cpu.yaml", ["data.system_prompt=null"])
    assert default.data.system_prompt is None
    unset = config_from_dict({"model": {"tiny": "qwen2"}, "tir": {"enabled": True}})
    assert unset.data.system_prompt == TIR_SYSTEM_PROMPT
    single = load_config(ROOT / "configs" / "quickstart_cpu.yaml")
    assert single.data.system_prompt == DataConfig().system_prompt
    with pytest.raises(ConfigError, match="sft_warmup_format=tir .* needs tir.enabled"):
        load_config(ROOT / "configs" / "quickstart_tir_cpu.yaml", ["tir.enabled=false"])


def test_bad_config_names_the_key(tmp_path):
    text = (ROOT / "configs" / "qwen2.5-math-1.5b_token_alp.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("clip_high: 0.28", "clip_hgh: 0.28").replace("n: 8", "n: 0"))
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert "loss.clip_hgh: unknown key" in str(err.value)
    assert "rollout.sampling.n" in str(err.value)
