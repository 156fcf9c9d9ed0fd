"""Supervised warm start of a tiny base model, for the CPU quickstart.

RL needs a policy that is sometimes right: a random tiny model never produces a correct
``\\boxed{}`` answer, so every reward is 0 and every GRPO advantage vanishes. A short supervised
pass on "<question> -> The answer is \\boxed{<answer>}." gives it a partial skill that RL then
improves. Runs with Hugging Face transformers on the model directory itself, so every later
consumer (Megatron loader, vLLM) starts from the same checkpoint files.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch


def answer_text(ground_truth: str) -> str:
    return f"The answer is \\boxed{{{ground_truth}}}."


def warm_start(model_dir: str | Path, examples: list[tuple[list[int], str]], tokenizer, *, steps: int,
               lr: float = 3e-3, batch_size: int = 32, seed: int = 0) -> dict:
    """Train ``model_dir`` in place on (prompt ids, ground truth) pairs; returns loss stats."""
    from transformers import AutoModelForCausalLM

    if not examples:
        raise ValueError("warm start needs training examples")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    seqs = []
    for prompt_ids, gt in examples:
        answer = tokenizer.encode(answer_text(gt), add_special_tokens=False) + [eos]
        seqs.append((list(prompt_ids), answer))
    first = last = None
    for step in range(steps):
        batch = [seqs[rng.randrange(len(seqs))] for _ in range(batch_size)]
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        attn = torch.zeros(batch_size, width, dtype=torch.long)
        for i, (p, a) in enumerate(batch):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p): len(p) + len(a)] = torch.tensor(a)
            attn[i, : len(p) + len(a)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"warmstart/first_loss": first, "warmstart/last_loss": last, "warmstart/steps": steps}
