"""`megatron-alp smoke`: one perturbed forward/backward of a tiny model."""


def test_smoke_command(capfd):
    from megatron_alp.cli import main

    assert main(["smoke", "--family", "qwen3", "--layers", "1-2"]) == 0
    out = capfd.readouterr().out
    assert "decoder.layers.1.alp_perturbation" in out and "decoder.layers.0.alp_perturbation" not in out
