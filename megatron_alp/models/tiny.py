"""Tiny real models and a local tokenizer, for tests and the CPU quickstart.

No weights or tokenizers can be downloaded on the development machines, so tests build a
real Hugging Face model of each supported architecture from a small config (random weights),
plus a byte-level BPE tokenizer trained with the `tokenizers` library on a small built-in math
corpus, with a ChatML chat template. The result is an ordinary HF model directory that
transformers, vLLM and the converters load like any downloaded checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_alp.models.families import FAMILIES, TINY_VOCAB

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    """Text the tokenizer is trained on: arithmetic, LaTeX answers, chat and code fragments."""
    lines = [
        "Please reason step by step, and put your final answer within \\boxed{}.",
        "The answer is \\boxed{42}. So the final answer is \\boxed{7}.",
        "What is 12 + 35? Let us add the numbers: 12 + 35 = 47. The answer is \\boxed{47}.",
        "Compute 9 * 8 - 3. First 9 * 8 = 72, then 72 - 3 = 69.",
        "```python\nprint(3 + 4)\n```\n```output\n7\n```",
        "def f(x):\n    return x ** 2 + 1\nimport math\nprint(math.sqrt(16))",
        "system user assistant tool The result of the computation is",
        "\\frac{1}{2} \\sqrt{2} \\pi x^2 + y^2 = z^2 therefore hence so we get",
    ]
    for a in range(0, 100, 7):
        for b in range(0, 100, 11):
            lines.append(f"{a} + {b} = {a + b}. {a} * {b} = {a * b}. {a} - {b} = {a - b}.")
    return lines


def build_tokenizer(vocab_size: int = TINY_VOCAB):
    """A byte-level BPE tokenizer of exactly ``vocab_size`` tokens (reserved tokens fill the rest)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    return tok


def save_tokenizer(out_dir: str | Path, vocab_size: int = TINY_VOCAB) -> Path:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": 1024,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    return out


def tiny_hf_config(family: str, **overrides) -> dict:
    """The registered ``family``'s tiny HF config (:attr:`ModelFamily.tiny`) with ``overrides``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}: choose one of {sorted(FAMILIES)}")
    return {**FAMILIES[family].tiny, **overrides}


def make_tiny_model(
    family: str, out_dir: str | Path, seed: int = 0, dtype: str = "float32", **overrides
) -> Path:
    """Create an HF model directory with a random tiny ``family`` model and the local tokenizer.

    The tokenizer's end-of-sequence token is ``<|im_end|>`` (id 2), so generation stops at the end
    of the assistant turn as with Qwen chat models.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_hf_config(family, **overrides)
    model_type = cfg.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **cfg)
    hf_config.dtype = dtype
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(out, cfg["vocab_size"])
    gen = {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out
