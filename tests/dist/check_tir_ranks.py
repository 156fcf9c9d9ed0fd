"""TIR episodes on 2 ranks stay identical when code output varies between runs.

Every rank runs ``run_episodes`` collectively against an engine on rank 0 whose completions are
broadcast (as ``DistributedRollout`` does). The executed code prints a random number. With the
``broadcast`` hook only rank 0 executes and both ranks' trajectories are equal; without it each
rank executes on its own and they differ (the hazard the hook exists for).

Usage: torchrun --nproc_per_node=2 check_tir_ranks.py DIR   (the tiny tokenizer is written to DIR/tokenizer)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist
from transformers import AutoTokenizer

from megatron_alp.config import SandboxConfig, TIRConfig
from megatron_alp.rollout.base import Completion, RolloutEngine, SamplingParams
from megatron_alp.tir.multi_turn import run_episodes
from megatron_alp.tir.sandbox import SandboxExecutor


def broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Rank0Engine(RolloutEngine):
    """Scripted turns generated on rank 0 and broadcast: code first, then a final answer."""

    name = "rank0-scripted"

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompts, params):
        groups = None
        if dist.get_rank() == 0:
            groups = []
            for p in prompts:
                turn = self.tok.decode(p).count("```output")
                text = "```python\nimport random\nprint(random.random())\n```\n" if turn == 0 else "\\boxed{1}"
                cut = text.find("```\n")
                ids = self.tok.encode(text if cut < 0 else text[: cut + 4], add_special_tokens=False)
                if cut < 0:
                    ids.append(self.tok.eos_token_id)
                groups.append([Completion(list(p), ids, [-0.5] * len(ids), "stop",
                                          stop_reason="```\n" if cut >= 0 else None) for _ in range(params.n)])
        return broadcast(groups)

    def update_weights(self, weights):
        pass


def main(folder: str) -> None:
    from megatron_alp.models.tiny import save_tokenizer

    owns_group = not dist.is_initialized()  # in a batched launch (tests/dist/run_jobs.py) a job before made it
    if owns_group:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        save_tokenizer(f"{folder}/tokenizer")
    dist.barrier()
    tok = AutoTokenizer.from_pretrained(f"{folder}/tokenizer")
    text = tok.apply_chat_template([{"role": "user", "content": "Pick a number"}], tokenize=False,
                                   add_generation_prompt=True)
    prompts = [tok.encode(text, add_special_tokens=False)] * 2
    params = SamplingParams(n=2, max_tokens=200)
    cfg = TIRConfig(enabled=True)
    engine = Rank0Engine(tok)
    sandbox = SandboxConfig(workers=2, cpu_time_s=2.0, wall_time_s=10.0)
    runs = {}
    with SandboxExecutor(sandbox) as executor:
        runs["broadcast"] = run_episodes(engine, prompts, tok, params, cfg, executor if rank == 0 else None,
                                         broadcast=broadcast)
        runs["per_rank"] = run_episodes(engine, prompts, tok, params, cfg, executor)
    gathered = {}
    for name, trajs in runs.items():
        assert all(t.info["executions"] == 1 and t.finish_reason == "stop" for t in trajs), name
        box = [None] * dist.get_world_size()
        dist.all_gather_object(box, [(t.response_ids, t.loss_mask, t.rollout_logprobs) for t in trajs])
        gathered[name] = box
    if rank == 0:
        assert gathered["broadcast"][0] == gathered["broadcast"][1], "ranks diverged despite the broadcast hook"
        assert gathered["per_rank"][0] != gathered["per_rank"][1], "control: per-rank execution should differ"
        print("TIR ranks OK")
        Path(folder, "result.txt").write_text("TIR ranks OK")
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
