"""Where the training-inference mismatch comes from: the divergence of the engine's hidden states
from Megatron's, layer by layer, on the same token sequences.

The engine side is captured inside the rollout engine (:meth:`VLLMEngine.layer_states
<megatron_alp.rollout.vllm.engine.VLLMEngine.layer_states>`), the training side here, with forward
hooks on Megatron's decoder layers in an unperturbed forward: per layer the residual stream after
it and, separately, its attention and MLP outputs (the branches added to the stream). Per layer
and kind the report gives the relative divergence ``||h_engine - h_train|| / ||h_train||``, as
the mean over tokens of the per-token ratio and as the ratio of the norms over all tokens
(``global``), the growth of ``global`` from the layer before, and the layer where it grows most:
where a lower-precision engine's rounding is amplified. docs/mismatch.md shows how to read it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
from megatron.core.utils import unwrap_model

KINDS = ("residual", "attention", "mlp")


def _first(output) -> torch.Tensor:
    """A Megatron module's output: layers return ``(hidden, context)``, attention and MLP ``(out, bias)``
    (a bias the layer adds with the residual, part of the branch as in the engine's projection)."""
    if not isinstance(output, tuple):
        return output
    out, bias = output[0], output[1]
    return out if bias is None else out + bias


@contextmanager
def captured(model) -> Iterator[dict[str, list[list[torch.Tensor]]]]:
    """Record, per kind and decoder layer, the ``[s, b, h]`` outputs of the forward passes inside."""
    layers = list(unwrap_model(model).decoder.layers)
    records = {kind: [[] for _ in layers] for kind in KINDS}
    hooks = []

    def recorder(kind, i):
        def hook(module, args, output):
            records[kind][i].append(_first(output).detach().to("cpu", torch.float32, copy=True))
        return hook

    for i, layer in enumerate(layers):
        for kind, module in (("residual", layer), ("attention", layer.self_attention), ("mlp", layer.mlp)):
            hooks.append(module.register_forward_hook(recorder(kind, i)))
    try:
        yield records
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def megatron_layer_states(model, sequences: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """Megatron's side of :func:`layer_divergence`: per sequence and kind ``[layers, tokens, hidden]``
    float32, from a plain causal forward of the sequence alone (eval mode, no perturbation: noise is
    added only inside :func:`~megatron_alp.training.perturbation.perturbed_step`)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    states = []
    try:
        for sequence in sequences:
            tokens = torch.tensor([sequence], device=device)
            with captured(model) as records:
                model(tokens, torch.arange(len(sequence), device=device).unsqueeze(0), None)
            # [s, 1, h] per layer -> [layers, s, h]
            states.append({kind: torch.stack([calls[0][:, 0] for calls in layers]) for kind, layers in records.items()})
    finally:
        model.train(was_training)
    return states


def relative_divergence(engine: list[torch.Tensor], train: list[torch.Tensor]) -> dict:
    """Over the tokens of all sequences (each ``[tokens, hidden]``): the mean of the per-token
    ``||e - t|| / ||t||`` and the norm ratio ``sqrt(sum ||e - t||^2 / sum ||t||^2)`` (``global``)."""
    diff = torch.cat([(e.double() - t.double()).norm(dim=-1) for e, t in zip(engine, train)])
    norm = torch.cat([t.double().norm(dim=-1) for t in train])
    return {"mean": float((diff / norm.clamp_min(1e-30)).mean()),
            "global": float(diff.square().sum().sqrt() / norm.square().sum().sqrt().clamp_min(1e-30))}


def layer_divergence(engine: list[dict[str, torch.Tensor]], train: list[dict[str, torch.Tensor]]) -> dict:
    """The ``layers`` section of mismatch.json from both sides' :func:`megatron_layer_states`-shaped
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
