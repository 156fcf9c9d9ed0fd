"""Supervised warm start of a tiny base model, for the CPU quickstart.

RL needs a policy that is sometimes right: a random tiny model never produces a correct
``\\boxed{}`` answer, so every reward is 0 and every GRPO advantage vanishes. A short supervised
pass gives it a partial skill that RL then improves. Two target formats:

* ``answer``: "<question> -> The answer is \\boxed{<answer>}." A fraction ``unboxed`` of the
  prompts (chosen by ``seed``) gets "The answer is <answer>." instead, which the math_verify reward
  scores 0: the warm-started model then forgets the box about as often on any problem, held-out
  ones included, and RL has something to learn that transfers whatever the model's skill.
* ``tir``: one multi-turn episode in the exact token layout of
  :func:`megatron_alp.tir.multi_turn.run_episodes`: a ```python block that prints the problem's
  value, ending on the stop string ``CODE_STOP`` as a sampled code turn does; the interpreter
  feedback, tokenized on its own by the same :class:`FeedbackFormatter` (and, as in RL, left out of
  the loss); then the final answer and end-of-sequence. A random model never writes code, so
  without this no episode would ever execute anything.

Runs with Hugging Face transformers on the model directory itself, so every later consumer
(Megatron loader, vLLM) starts from the same checkpoint files.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from megatron_alp.data.prompts import pad_id
from megatron_alp.tir.multi_turn import CODE_STOP, FeedbackFormatter

WARMUP_FORMATS = ("answer", "tir")

# arithmetic in a question, and the one form the warm start writes code for: a single integer
# operation, as in data/digits and data/arith ("What is 7 + 9?", "Compute 4 - 3.")
_EXPRESSION = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s*[-+*/]\s*\d+(?:\.\d+)?)+")
_BINARY = re.compile(r"(\d+)\s*([-+*])\s*(\d+)")


def answer_text(ground_truth: str, boxed: bool = True) -> str:
    return f"The answer is \\boxed{{{ground_truth}}}." if boxed else f"The answer is {ground_truth}."


def tir_code(question: str, ground_truth: str) -> tuple[str, str]:
    """(code, its printed output) for an arithmetic question; ValueError when the question holds no
    single ``a + b`` / ``a - b`` / ``a * b`` or its value is not the ground truth."""
    found = _EXPRESSION.findall(question)
    binary = _BINARY.fullmatch(found[0]) if len(found) == 1 else None
    if binary is None:
        raise ValueError(f"expected one integer operation like '7 + 9' in the question, found {found}: {question!r}")
    a, op, b = binary.groups()
    value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    if str(value) != ground_truth.strip():
        raise ValueError(f"{a} {op} {b} = {value} but the ground truth is {ground_truth!r}: {question!r}")
    return f"print({a} {op} {b})\n", f"{value}\n"


def target_ids(fmt: str, tokenizer, question: str, ground_truth: str,
               tool_format: str = "inline", boxed: bool = True) -> tuple[list[int], list[int]]:
    """Response token ids of one warm-start example and their loss mask (0 on interpreter feedback)."""
    eos = tokenizer.eos_token_id
    answer = list(tokenizer.encode(answer_text(ground_truth, boxed), add_special_tokens=False)) + [eos]
    if fmt == "answer":
        return answer, [1] * len(answer)
    if fmt != "tir":
        raise ValueError(f"warm-start format {fmt!r}: expected one of {WARMUP_FORMATS}")
    code, output = tir_code(question, ground_truth)
    turn = f"```python\n{code}{CODE_STOP}"
    model = list(tokenizer.encode(turn, add_special_tokens=False))
    feedback = FeedbackFormatter(tokenizer, tool_format)(output, turn, ended_with_eos=False)
    ids = model + feedback + answer
    return ids, [1] * len(model) + [0] * len(feedback) + [1] * len(answer)


def warmup_examples(prompts: Iterable, tokenizer, fmt: str, tool_format: str = "inline", *,
                    unboxed: float = 0.0, seed: int = 0) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, target ids, target mask) of each :class:`~megatron_alp.data.prompts.Prompt`; the
    question is its last user message. A fraction ``unboxed`` of the ``answer`` targets, drawn with
    ``seed``, leaves out the box (see the module docstring)."""
    if unboxed and fmt != "answer":
        raise ValueError(f"unboxed warm-start answers are for the answer format, not {fmt!r}")
    rng = random.Random(seed)
    examples = []
    for p in prompts:
        question = next((m["content"] for m in reversed(p.messages) if m["role"] == "user"), "")
        boxed = rng.random() >= unboxed
        try:
            ids, mask = target_ids(fmt, tokenizer, question, p.ground_truth, tool_format, boxed)
        except ValueError as err:
            raise ValueError(f"trainer.sft_warmup_format={fmt}: prompt {p.source}: {err}") from None
        examples.append((list(p.prompt_ids), ids, mask))
    return examples


def warm_start(model_dir: str | Path, examples: list[tuple[list[int], list[int], list[int]]], tokenizer, *,
               steps: int, lr: float = 3e-3, batch_size: int = 32, seed: int = 0,
               progress: Optional[Callable[[int, float], None]] = None) -> dict:
    """Train ``model_dir`` in place on (prompt ids, target ids, target loss mask) examples
    (:func:`warmup_examples`); returns loss stats. ``progress(step, loss)`` is called after every
    step (the caller decides what to show)."""
    from transformers import AutoModelForCausalLM

    if not examples:
        raise ValueError("warm start needs training examples")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad = pad_id(tokenizer)
    first = last = None
    for step in range(steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        width = max(len(p) + len(a) for p, a, _ in batch)
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        attn = torch.zeros(batch_size, width, dtype=torch.long)
        for i, (p, a, m) in enumerate(batch):
            target = torch.tensor(a)
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p): len(p) + len(a)] = torch.where(torch.tensor(m) > 0, target, -100)
            attn[i, : len(p) + len(a)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
        if progress is not None:
            progress(step + 1, last)
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"warmstart/first_loss": first, "warmstart/last_loss": last, "warmstart/steps": steps}
