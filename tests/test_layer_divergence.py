"""`megatron-alp mismatch --layers`: the divergence math against numpy on synthetic hidden states,
and real engines (tiny model; vLLM in float32, bfloat16 and FP8 weights against a float32
Megatron model, one engine start each)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_alp.cli import main as cli_main
from megatron_alp.diagnostics.layer_divergence import format_layers, layer_divergence, relative_divergence

ROOT = Path(__file__).resolve().parents[1]
FLOOR = 1e-5  # float32 on both sides: kernels and reduction orders differ, nothing else


def test_divergence_math_matches_numpy():
    rng = np.random.default_rng(0)
    layers, hidden, lengths = 4, 8, (5, 3)
    # the engine's error grows tenfold per layer from layer 2 on, 1.5x before
    scale = np.array([1e-4, 1.5e-4, 1.5e-3, 1.5e-2])
    train, engine = [], []
    for n in lengths:
        t = rng.normal(0, 1, (layers, n, hidden))
        e = t + scale[:, None, None] * rng.normal(0, 1, (layers, n, hidden))
        train.append({k: torch.tensor(t * (i + 1), dtype=torch.float32) for i, k in enumerate(("residual", "mlp"))})
        engine.append({k: torch.tensor(e * (i + 1), dtype=torch.float32) for i, k in enumerate(("residual", "mlp"))})
    section = layer_divergence(engine, train)
    assert section["kinds"] == ["residual", "mlp"] and section["sequences"] == 2 and section["tokens"] == 8

    t_all = np.concatenate([s["residual"].double().numpy() for s in train], axis=1)  # [layers, tokens, hidden]
    e_all = np.concatenate([s["residual"].double().numpy() for s in engine], axis=1)
    d = np.linalg.norm(e_all - t_all, axis=-1)
    n = np.linalg.norm(t_all, axis=-1)
    mean = (d / n).mean(axis=1)
    glob = np.sqrt((d ** 2).sum(axis=1) / (n ** 2).sum(axis=1))
    for layer, row in enumerate(section["per_layer"]):
        assert row["layer"] == layer
        assert row["residual"]["mean"] == pytest.approx(mean[layer], rel=1e-6)
        assert row["residual"]["global"] == pytest.approx(glob[layer], rel=1e-6)
        assert row["mlp"]["global"] == pytest.approx(glob[layer], rel=1e-6)  # scale-free
        assert row["growth"] == (None if layer == 0 else pytest.approx(glob[layer] / glob[layer - 1], rel=1e-6))
    growth = glob[1:] / glob[:-1]
    assert section["jump"] == {"layer": int(np.argmax(growth)) + 1, "growth": pytest.approx(growth.max(), rel=1e-6)}
    assert section["jump"]["layer"] in (2, 3)

    same = relative_divergence([train[0]["residual"][0]], [train[0]["residual"][0]])
    assert same == {"mean": 0.0, "global": 0.0}
    table = format_layers(section).splitlines()
    assert table[0].split() == ["layer", "residual", "rel", "mlp", "rel", "growth"] and len(table) == 1 + layers
    assert table[1].split()[-1] == "-" and table[1 + section["jump"]["layer"]].endswith("<- jump")
    with pytest.raises(ValueError, match=r"sequence 1 residual: engine \(4, 2, 8\) vs Megatron \(4, 3, 8\)"):
        layer_divergence([engine[0], {"residual": engine[1]["residual"][:, :2]}], train)


def test_help_documents_the_option(capsys):
    with pytest.raises(SystemExit):
        cli_main(["mismatch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--layers N" in text and "layers.png" in text and "enforce_eager" in text


def test_engine_precision_shows_layer_by_layer(tmp_path, capfd):
    """The same 4 sampled sequences through each engine and Megatron (float32): a float32 engine
    stays at the rounding floor at every layer, bfloat16 is far above it, FP8 weights further.
    The float32 engine runs in vLLM's engine-core process, so the capture's RPC crosses processes."""
    from megatron_alp.models.tiny import make_tiny_model

    model = make_tiny_model("qwen2", tmp_path / "model", seed=0)
    cfg = tmp_path / "mismatch.yaml"
    cfg.write_text(
        f"model: {{hf_path: {model}, dtype: float32, layer_spec: local}}\n"
        "rollout: {sampling: {n: 2, temperature: 1.0, max_prompt_length: 96, max_response_length: 8}}\n"
        f"data: {{val_files: [{ROOT / 'data/largest/val.jsonl'}]}}\n"
        f"trainer: {{output_dir: {tmp_path / 'run'}}}\n"
    )
    settings = {
        # through vLLM's engine-core process, as its GPU workers are reached; the others in process
        "float32": ["rollout.dtype=float32", "rollout.engine_process=subprocess"],
        "bfloat16": ["rollout.dtype=bfloat16"],
        # and sigma calibrated per layer from the same engine's layer inputs
        "fp8": ["rollout.dtype=bfloat16", "rollout.quantization=fp8_per_channel", "perturbation.init_std=auto",
                "perturbation.calibration_mode=per_layer"],
    }
    sections = {}
    for name, overrides in settings.items():
        out = tmp_path / name
        assert cli_main(["mismatch", str(cfg), *overrides, "--prompts", "2", "--n", "2", "--max-tokens", "8",
                         "--layers", "4", "--out", str(out)]) == 0
        assert (out / "layers.png").stat().st_size > 10_000
        report = json.loads((out / "mismatch.json").read_text())
        section = sections[name] = report["layers"]
        printed = capfd.readouterr().out
        assert "hidden-state divergence" in printed and str(out / "layers.png") in printed
        assert section["sequences"] == 4 and section["kinds"] == ["residual", "attention", "mlp"]
        assert len(section["per_layer"]) == 4  # the tiny model's layers
        with capfd.disabled():  # the measured numbers, for docs/mismatch.md (pytest -s)
            print(f"\n{name}:\n{format_layers(section)}")

    for row in sections["float32"]["per_layer"]:
        for kind in ("residual", "attention", "mlp"):
            assert row[kind]["global"] < FLOOR and row[kind]["mean"] < FLOOR, (kind, row)
    for name in ("bfloat16", "fp8"):
        rows = sections[name]["per_layer"]
        for row in rows:
            assert row["residual"]["global"] > 1e-4 and row["residual"]["mean"] > 1e-4, (name, row)
        # the rounding compounds: deeper layers diverge more than the first
        assert rows[-1]["residual"]["global"] > 1.2 * rows[0]["residual"]["global"], (name, rows)
        assert sections[name]["jump"]["growth"] > 1.0
    for layer in range(4):
        order = [sections[n]["per_layer"][layer]["residual"]["global"] for n in ("fp8", "bfloat16", "float32")]
        assert order[0] > order[1] > 10 * order[2], (layer, order)
    # per_layer: sigma_h = scale x the engine's drift at layer h's input; FP8 leaves the embedding
    # (layer 0's input) in bf16, so the noise there is far below the deeper layers'
    cal = report["calibration"]
    assert cal["calibration/per_layer"] == 1.0 and len(cal["input_divergence"]) == 4
    for layer, d in cal["input_divergence"].items():
        assert cal["sigma"][layer] == pytest.approx(cal["calibration/scale"] * d, rel=1e-5), layer
    assert cal["input_divergence"]["layer_03"] > 10 * cal["input_divergence"]["layer_00"] > 0, cal
    assert cal["calibration/perturbed_kl"] == pytest.approx(cal["calibration/target_kl"], rel=0.021)
    assert "x layer-input divergence engine-train" in printed
