"""Config validation: every wrong key, type or value is named by its dotted path; YAML loading,
command-line overrides and layer selections."""

import pytest
import yaml

from megatron_alp.config import ConfigError, parse_layer_selection
from megatron_alp.resolve import config_from_dict, load_config


def _minimal(**sections):
    return {"model": {"tiny": "qwen2"}, **sections}


@pytest.mark.parametrize(
    "data, expected",
    [
        (_minimal(loss={"nme": "grpo"}), "loss.nme: unknown key"),
        (_minimal(loss={"name": "ppo"}), "loss.name: unknown policy loss 'ppo'"),
        (_minimal(loss={"dual_clip_c": 1.0}), "loss.dual_clip_c: dual clip c must be > 1"),
        (_minimal(loss={"clip_low": "x"}), "loss.clip_low: Input should be a valid number"),
        (_minimal(perturbation={"init_std": -1}), "perturbation.init_std: expected a number >= 0 or 'auto' (got -1)"),
        (_minimal(perturbation={"init_std": "often"}), "perturbation.init_std: expected a number >= 0 or 'auto'"),
        (_minimal(perturbation={"calibrate_every": 5}), "perturbation.calibrate_every: 5 re-calibrates sigma, which "
                                                        "needs perturbation.init_std: auto"),
        (_minimal(loss={"name": "seq_bypass"}, perturbation={"init_std": "auto"}),
         "perturbation.init_std: auto calibrates the ALP noise, but loss.name=seq_bypass runs unperturbed"),
        (_minimal(perturbation={"calibration_mode": "per_layer"}),
         "perturbation.calibration_mode: per_layer sizes the calibrated sigma, which needs perturbation.init_std: auto"),
        (_minimal(perturbation={"init_std": "auto", "calibration_mode": "per_layer", "layers": "logits"}),
         "perturbation.calibration_mode: per_layer with perturbation.layers: logits"),
        (_minimal(perturbation={"init_std": "auto", "calibration_mode": "per_layer"}, rollout={"engine": "sglang"}),
         "perturbation.calibration_mode: per_layer with rollout.engine=sglang: the engine cannot show"),
        (_minimal(perturbation={"init_std": "auto", "calibration_mode": "per_layer"},
                  parallel={"pipeline_model_parallel_size": 2}),
         "perturbation.calibration_mode: per_layer with parallel.pipeline_model_parallel_size=2"),
        (_minimal(perturbation={"init_std": "auto", "calibration_mode": "per_layer_added"}, rollout={"engine": "sglang"}),
         "perturbation.calibration_mode: per_layer_added with rollout.engine=sglang: the engine cannot show"),
        (_minimal(perturbation={"calibration_mode": "layerwise"}), "perturbation.calibration_mode: Input should be"),
        (_minimal(model={"tiny": "qwen2", "dtype": "bfloat16"}, parallel={"use_distributed_optimizer": False}),
         "parallel.use_distributed_optimizer: false with model.dtype=bfloat16 and ALP"),
        (_minimal(perturbation={"layers": "3-1"}), "perturbation.layers"),
        (_minimal(perturbation={"layers": "a-b"}), "expected an index like 3 or a range like 0-4"),
        (_minimal(perturbation={"shape": "matrix"}), "perturbation.shape"),
        (_minimal(parallel={"sequence_parallel": True}), "needs `tensor_model_parallel_size` > 1"),
        (_minimal(rollout={"sampling": {"top_k": 0}}), "rollout.sampling.top_k"),
        ({"model": {}}, "set exactly one of `hf_path`"),
        (_minimal(moe={"routing_replay": "r4"}), "moe.routing_replay: Input should be 'none', 'r2' or 'r3'"),
        (_minimal(moe={"routing_replay": "r2"}), "moe.routing_replay=r2 needs a mixture-of-experts model; "
                                                "model.tiny=qwen2 is dense"),
        ({"model": {"tiny": "qwen3_moe"}, "moe": {"routing_replay": "r3"}, "rollout": {"return_routed_experts": False}},
         "moe.routing_replay=r3 replays the engine's routing, which rollout.return_routed_experts=false turns off"),
        (_minimal(perturbation={"moe_routing": "frozen"}), "perturbation.moe_routing"),
        (_minimal(model={"tiny": "qwen2", "moe_aux_loss_coeff": 0.0}), "model.moe_aux_loss_coeff: unknown key"),
        ({"loss": {}}, "model: required key is missing"),
    ],
)
def test_invalid_configs_name_the_key(data, expected):
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert expected in str(err.value)


def test_yaml_loading_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_minimal(loss={"name": "alp_seq"})))
    cfg = load_config(path, ["perturbation.layers=0-1", "loss.clip_high=0.2", "trainer.iterations=3"])
    assert cfg.loss.name == "alp_seq" and cfg.perturbation.layers == "0-1"
    assert cfg.loss.clip_high == 0.2 and cfg.trainer.iterations == 3
    with pytest.raises(ConfigError, match="override 'loss.name': expected KEY=VALUE"):
        load_config(path, ["loss.name"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_layer_selection():
    assert parse_layer_selection("0-4,12-16", 28) == {0, 1, 2, 3, 4, 12, 13, 14, 15, 16}
    assert parse_layer_selection("all", 4) == {0, 1, 2, 3}
    assert parse_layer_selection("logits", 4) is None
    assert parse_layer_selection([1, "2-3"], 4) == {1, 2, 3}
    with pytest.raises(ValueError, match="layer 30 does not exist"):
        parse_layer_selection("19-30", 28)


def test_moe_defaults_and_resolution():
    """RL runs default to no load-balancing loss; perturbation.moe_routing and
    rollout.return_routed_experts follow moe.routing_replay unless set."""
    dense = config_from_dict(_minimal())
    assert dense.moe.routing_replay == "none" and dense.moe.aux_loss_coeff == 0.0
    assert dense.perturbation.moe_routing == "follow" and dense.rollout.return_routed_experts is False
    r3 = config_from_dict({"model": {"tiny": "qwen3_moe"}, "moe": {"routing_replay": "r3"}})
    assert r3.perturbation.moe_routing == "fixed" and r3.rollout.return_routed_experts is True
    r2 = config_from_dict({"model": {"tiny": "qwen3_moe"}, "moe": {"routing_replay": "r2"},
                           "rollout": {"return_routed_experts": True}})
    assert r2.perturbation.moe_routing == "fixed" and r2.rollout.return_routed_experts is True
    for replay in ("r2", "r3"):  # follow would drop the replayed experts in the update pass
        with pytest.raises(ConfigError, match=rf"perturbation\.moe_routing: follow with moe\.routing_replay={replay}"):
            config_from_dict({"model": {"tiny": "qwen3_moe"}, "moe": {"routing_replay": replay},
                              "perturbation": {"moe_routing": "follow"}})
    hf = config_from_dict({"model": {"hf_path": "/models/any"}, "moe": {"routing_replay": "r2"}})
    assert hf.moe.routing_replay == "r2"  # dense or not is known once the model's config is read


def test_routing_replay_on_a_dense_checkpoint_is_refused_when_the_model_is_built():
    from megatron_alp.config import MoEConfig
    from megatron_alp.models.families import hf_to_megatron
    from megatron_alp.models.tiny import tiny_hf_config
    from megatron_alp.training.builder import check_moe

    with pytest.raises(ConfigError, match="moe.routing_replay=r3 needs a mixture-of-experts model; this qwen3 model"):
        check_moe(hf_to_megatron(tiny_hf_config("qwen3")), MoEConfig(routing_replay="r3"))
    check_moe(hf_to_megatron(tiny_hf_config("qwen3_moe")), MoEConfig(routing_replay="r3"))


def test_the_distributed_optimizer_defaults_on_exactly_for_half_precision_alp():
    """Megatron-Core's non-distributed fp16 optimizer cannot checkpoint a bf16 model's fp32 sigmas."""
    def resolved(dtype, loss):
        return config_from_dict({"model": {"tiny": "qwen2", "dtype": dtype},
                                      "loss": {"name": loss}}).parallel.use_distributed_optimizer

    assert resolved("bfloat16", "alp_token") is True and resolved("float16", "alp_seq") is True
    assert resolved("float32", "alp_token") is False and resolved("bfloat16", "grpo") is False


@pytest.mark.parametrize("sampling", [{"top_p": 0.9}, {"top_k": 20}])
def test_auto_sigma_with_top_p_or_top_k_is_refused(sampling):
    """The engine's renormalised logprobs carry log(kept mass) on every token, which the calibration
    would take for mismatch (sigma x148 at top_p 0.9)."""
    with pytest.raises(ConfigError, match=r"perturbation\.init_std: auto with rollout\.sampling\.top_p=.*top_k="):
        config_from_dict({**_minimal(), "perturbation": {"init_std": "auto"}, "rollout": {"sampling": sampling}})
    config_from_dict({**_minimal(), "perturbation": {"init_std": 1e-4}, "rollout": {"sampling": sampling}})


def test_per_layer_calibration_on_gpus_needs_an_eager_engine():
    """vLLM's compiled model and CUDA graphs never run the hooks that capture the layer inputs: a GPU
    run is refused at load, naming the key; the CPU engine is always eager."""
    def per_layer(**rollout):
        return _minimal(perturbation={"init_std": "auto", "calibration_mode": "per_layer"}, rollout=rollout)

    with pytest.raises(ConfigError, match=r"perturbation\.calibration_mode: per_layer on GPUs needs "
                                          r"rollout\.enforce_eager: true"):
        config_from_dict(per_layer(), gpu=True)
    assert config_from_dict(per_layer(enforce_eager=True), gpu=True).rollout.enforce_eager
    assert config_from_dict(per_layer(), gpu=False).perturbation.calibration_mode == "per_layer"
