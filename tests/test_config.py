"""Config validation: every wrong key, type or value is named by its dotted path; YAML loading,
command-line overrides and layer selections."""

import pytest
import yaml

from megatron_alp.config import ConfigError, config_from_dict, load_config, parse_layer_selection


def _minimal(**sections):
    return {"model": {"tiny": "qwen2"}, **sections}


@pytest.mark.parametrize(
    "data, expected",
    [
        (_minimal(loss={"nme": "grpo"}), "loss.nme: unknown key"),
        (_minimal(loss={"name": "ppo"}), "loss.name: unknown policy loss 'ppo'"),
        (_minimal(loss={"dual_clip_c": 1.0}), "loss.dual_clip_c: dual clip c must be > 1"),
        (_minimal(loss={"clip_low": "x"}), "loss.clip_low: Input should be a valid number"),
        (_minimal(perturbation={"init_std": -1}), "perturbation.init_std: Input should be greater than or equal to 0"),
        (_minimal(perturbation={"layers": "3-1"}), "perturbation.layers"),
        (_minimal(perturbation={"layers": "a-b"}), "expected an index like 3 or a range like 0-4"),
        (_minimal(perturbation={"shape": "matrix"}), "perturbation.shape"),
        (_minimal(parallel={"sequence_parallel": True}), "needs `tensor_model_parallel_size` > 1"),
        (_minimal(rollout={"sampling": {"top_k": 0}}), "rollout.sampling.top_k"),
        ({"model": {}}, "set exactly one of `hf_path`"),
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
