"""Where the training-inference mismatch comes from: the divergence of the engine's hidden states
from Megatron's, layer by layer, on the same token sequences.

The engine side is captured inside the rollout engine (:meth:`VLLMEngine.layer_states
<megatron_alp.rollout.vllm.engine.VLLMEngine.layer_states>`), the training side by
:func:`~megatron_alp.training.layer_states.megatron_layer_states` in an unperturbed forward: per
layer the residual stream after it and, separately, its attention and MLP outputs (the branches
added to the stream). Per layer and kind the report gives the relative divergence
``||h_engine - h_train|| / ||h_train||``, as the mean over tokens of the per-token ratio and as the
ratio of the norms over all tokens (``global``), the growth of ``global`` from the layer before,
and the layer where it grows most: where a lower-precision engine's rounding is amplified. docs/mismatch.md shows how to read it.
"""

from __future__ import annotations

import numpy as np
import torch

KINDS = ("residual", "attention", "mlp")  # the report's kinds of layer states (megatron_alp/training/layer_states.py)


def relative_divergence(engine: list[torch.Tensor], train: list[torch.Tensor]) -> dict:
    """Over the tokens of all sequences (each ``[tokens, hidden]``): the mean of the per-token
    ``||e - t|| / ||t||`` and the norm ratio ``sqrt(sum ||e - t||^2 / sum ||t||^2)`` (``global``)."""
    diff = torch.cat([(e.double() - t.double()).norm(dim=-1) for e, t in zip(engine, train)])
    norm = torch.cat([t.double().norm(dim=-1) for t in train])
    return {"mean": float((diff / norm.clamp_min(1e-30)).mean()),
            "global": float(diff.square().sum().sqrt() / norm.square().sum().sqrt().clamp_min(1e-30))}


def layer_divergence(engine: list[dict[str, torch.Tensor]], train: list[dict[str, torch.Tensor]]) -> dict:
    """The ``layers`` section of mismatch.json from both sides' :func:`~megatron_alp.training.layer_states.megatron_layer_states`-shaped
    states: per layer (0-based, as ``model.layers.<i>`` of the checkpoint) the divergence of each
    kind both sides captured, the growth of the residual stream's global divergence from the layer
    before, and the jump (the largest growth)."""
    kinds = [k for k in KINDS if all(k in e for e in engine)]
    count = train[0]["residual"].shape[0]
    for i, (e, t) in enumerate(zip(engine, train)):
        for kind in kinds:
            if e[kind].shape != t[kind].shape:
                raise ValueError(f"sequence {i} {kind}: engine {tuple(e[kind].shape)} vs Megatron "
                                 f"{tuple(t[kind].shape)} ([layers, tokens, hidden])")
    layers = []
    for layer in range(count):
        row = {"layer": layer}
        for kind in kinds:
            row[kind] = relative_divergence([e[kind][layer] for e in engine], [t[kind][layer] for t in train])
        previous = layers[-1]["residual"]["global"] if layers else None
        row["growth"] = row["residual"]["global"] / previous if previous else None
        layers.append(row)
    growth = [(row["growth"], row["layer"]) for row in layers if row["growth"] is not None]
    jump = max(growth) if growth else (None, None)
    return {"sequences": len(train), "tokens": sum(t["residual"].shape[1] for t in train), "kinds": kinds,
            "per_layer": layers, "jump": {"layer": jump[1], "growth": jump[0]}}


def format_layers(section: dict) -> str:
    """One line per layer: the divergences (global) of each kind and the growth; the jump marked."""
    header = ["layer"] + [f"{k} rel" for k in section["kinds"]] + ["growth"]
    lines = [header]
    for row in section["per_layer"]:
        mark = " <- jump" if row["layer"] == section["jump"]["layer"] else ""
        growth = "-" if row["growth"] is None else f"{row['growth']:.2f}x{mark}"
        lines.append([str(row["layer"])] + [f"{row[k]['global']:.3e}" for k in section["kinds"]] + [growth])
    widths = [max(len(r[i]) for r in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in lines)


def draw_layers(ax, section: dict) -> None:
    """Global relative divergence per layer and kind, log y; the jump layer marked."""
    x = np.array([row["layer"] for row in section["per_layer"]])
    for kind, style in zip(section["kinds"], ("o-", "s--", "^:")):
        ax.plot(x, [max(row[kind]["global"], 1e-12) for row in section["per_layer"]], style, label=kind)
    if section["jump"]["layer"] is not None:
        ax.axvline(section["jump"]["layer"], color="grey", lw=0.8, ls="--",
                   label=f"jump x{section['jump']['growth']:.2f}")
    ax.set_yscale("log")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("||h_engine - h_train|| / ||h_train||")
    ax.set_xticks(x)
    ax.legend(fontsize=8)
