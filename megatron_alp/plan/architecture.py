"""What the memory of a model depends on: its architecture, read from the HF config the trainer
builds from, and where the plan found that config (the shipped configs point at placeholder paths,
so a published copy bundled with the package stands in)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from megatron_alp.config import Config, ConfigError
from megatron_alp.models.families import PUBLISHED, hf_to_megatron, load_hf_config
from megatron_alp.models.tiny import tiny_hf_config


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What the memory of a model depends on, read through :func:`hf_to_megatron` so it is what
    the trainer builds (q/k norms and biases by family)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    linear_bias: bool
    qk_norm: bool
    torch_dtype: str
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0

    @classmethod
    def from_hf(cls, hf: dict) -> "Architecture":
        args = hf_to_megatron(hf)
        t = args.transformer
        return cls(
            layers=t["num_layers"], hidden=t["hidden_size"], heads=t["num_attention_heads"],
            kv_heads=t["num_query_groups"], head_dim=t["kv_channels"], ffn=t["ffn_hidden_size"],
            vocab=args.vocab_size, tied=args.tie_word_embeddings, qkv_bias=t["add_qkv_bias"],
            linear_bias=t["add_bias_linear"], qk_norm=t["qk_layernorm"],
            torch_dtype=str(hf.get("torch_dtype") or "bfloat16"),
            experts=t.get("num_moe_experts", 0), topk=t.get("moe_router_topk", 0),
            expert_ffn=t.get("moe_ffn_hidden_size", 0),
        )

    def layer_params(self, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
        """(dense, expert) parameters of one layer on one rank. Norms and the router are replicated;
        a row-parallel bias is whole on every rank."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        dense = h * (q + 2 * kv) // tp + q * h // tp + 2 * h
        dense += (q + 2 * kv) // tp if self.qkv_bias else 0
        dense += h if self.linear_bias else 0
        dense += 2 * self.head_dim if self.qk_norm else 0
        if not self.experts:
            mlp = 3 * h * self.ffn // tp + ((2 * self.ffn // tp + h) if self.linear_bias else 0)
            return dense + mlp, 0
        one_expert = 3 * h * self.expert_ffn // etp + ((2 * self.expert_ffn // etp + h) if self.linear_bias else 0)
        return dense + h * self.experts, self.experts // ep * one_expert

    def adapter_params(self, lora, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
        """(dense, expert) LoRA parameters of one layer on one rank (megatron_alp/models/lora.py): a
        column-parallel layer's A (r x in) is whole and its B (out/TP x r) sharded, a row-parallel
        layer's A (r x in/TP) sharded and its B (out x r) whole; experts as their layers, under EP/ETP.
        The dense MLP targets count only for dense models (shared experts are not modelled)."""
        r, h, t = lora.rank, self.hidden, set(lora.target_modules)
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        dense = (r * h + r * (q + 2 * kv) // tp if "linear_qkv" in t else 0) + (r * q // tp + r * h
                                                                                if "linear_proj" in t else 0)
        if not self.experts:
            dense += (r * h + r * 2 * self.ffn // tp if "linear_fc1" in t else 0) + (
                r * self.ffn // tp + r * h if "linear_fc2" in t else 0)
            return dense, 0
        one_expert = 2 * r * h + 3 * r * self.expert_ffn // etp
        return dense, (self.experts // ep * one_expert if "experts" in t else 0)

    @property
    def embedding_params(self) -> int:
        """Input embedding plus, when untied, the output layer."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def total_params(self) -> int:
        dense, expert = self.layer_params()
        return self.layers * (dense + expert) + self.embedding_params + self.hidden


def resolve_architecture(cfg: Config, hf_config: Optional[dict] = None) -> tuple[dict, str]:
    """The HF config the plan counts, and where it came from: ``hf_config`` as given, the tiny
    model's, ``model.hf_path``/config.json, or the bundled published config named like the
    basename of ``model.hf_path`` (the shipped configs point at placeholder paths)."""
    if hf_config is not None:
        return hf_config, "the given HF config"
    m = cfg.model
    if m.tiny is not None:
        return tiny_hf_config(m.tiny, **m.tiny_config), f"tiny {m.tiny} model (model.tiny)"
    path = Path(m.hf_path)
    if (path / "config.json").is_file():
        return load_hf_config(path), str(path / "config.json")
    published = PUBLISHED / f"{path.name}.json"
    if published.is_file():
        return json.loads(published.read_text()), (
            f"bundled published config megatron_alp/models/published/{published.name} "
            f"(model.hf_path {m.hf_path} has no config.json here)")
    bundled = ", ".join(sorted(p.stem for p in PUBLISHED.glob("*.json")))
    raise ConfigError(
        f"model.hf_path: {m.hf_path} has no config.json, and no published config is bundled for "
        f"{path.name!r} (bundled: {bundled}); point model.hf_path at the model's directory")
