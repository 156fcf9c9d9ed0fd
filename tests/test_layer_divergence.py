"""`megatron-alp mismatch --layers`: the divergence math against numpy on synthetic hidden states.
Real engines (tiny model; vLLM in float32, bfloat16 and FP8 weights against a float32 Megatron
model) are tests/test_mismatch.py's test_engine_precision_shows_layer_by_layer, on the probes that
file makes once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_alp.cli import main as cli_main
from megatron_alp.diagnostics.layer_divergence import format_layers, layer_divergence, relative_divergence


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
