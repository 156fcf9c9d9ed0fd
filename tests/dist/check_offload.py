"""Offloading Megatron's training state around a rollout leaves it bit-identical (2 gloo ranks).

For each layout (bf16 model with the distributed optimizer over DP=2; fp32 model, plain optimizer,
PP=2), two copies of one model train two steps; one of them offloads and reloads its weights,
gradient buffers and optimizer state between the steps (what the trainer does around a rollout).
Checked: the storages are really released, everything comes back bit for bit, and the second
step gives bit-identical weights in both copies.

Usage: torchrun --nproc_per_node 2 check_offload.py RESULT.json
"""

import json
import sys

import torch
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from common import build, full_state, load_full_state, rank, reinit, tokens
from megatron_alp.config import OptimizerConfig, ParallelConfig, PerturbationConfig
from megatron_alp.training.offload import TrainingStateOffloader
from megatron_alp.training.optim import build_optimizer, wrap_for_training
from megatron_alp.training.perturbation import next_microbatch, perturbed_step

LAYOUTS = {"dp2_bf16_distopt": dict(tp=1, pp=1, dtype="bfloat16", distopt=True),
           "pp2_fp32": dict(tp=1, pp=2, dtype="float32", distopt=False)}


def step(model, optimizer, i: int) -> None:
    batch = tokens(b=2, s=10, seed=100 * i + rank())
    pos = torch.arange(10).unsqueeze(0).expand(2, -1)

    def forward(data_iter, m):
        next_microbatch(m)
        logits = m(next(data_iter), pos, None)
        return logits, lambda out: (tensor_parallel.vocab_parallel_cross_entropy(
            out.float(), batch.roll(-1, 1)).mean(), {})

    model.zero_grad_buffer()
    optimizer.zero_grad()
    with perturbed_step(model, i):
        get_forward_backward_func()(forward_step_func=forward, data_iterator=iter([batch]), model=[model],
                                    num_microbatches=1, seq_length=10, micro_batch_size=2, forward_only=False)
    ok, _, _ = optimizer.step()
    assert ok


def snapshot(model, optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", sub)
        out += [p.detach().clone() for g in inner.param_groups for p in g["params"]]
        out += [v.clone() for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    return out


def run(layout: str, spec: dict, init: dict) -> dict:
    par = reinit(tp=spec["tp"], pp=spec["pp"])
    par = ParallelConfig(**{**par.model_dump(), "use_distributed_optimizer": spec["distopt"]})
    pert = PerturbationConfig(enabled=True, init_std=1e-2)
    copies = []
    for _ in range(2):
        model = build("qwen2", par, pert, dtype=spec["dtype"])
        load_full_state(model, init)
        model = wrap_for_training(model, par)
        optimizer, _ = build_optimizer(model, OptimizerConfig(lr=1e-3, min_lr=1e-3), pert, par, total_steps=2)
        step(model, optimizer, 0)
        copies.append((model, optimizer))
    (model, optimizer), (plain, plain_opt) = copies
    before = snapshot(model, optimizer)
    offloader = TrainingStateOffloader([model], optimizer)
    stats = offloader.offload()
    released = all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    grads_released = all(p.main_grad.untyped_storage().nbytes() == 0 for p in model.parameters())
    stats.update(offloader.reload())
    after = snapshot(model, optimizer)
    identical = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    step(model, optimizer, 1)
    step(plain, plain_opt, 1)
    same_training = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    assert released and grads_released and identical and same_training, (layout, released, grads_released,
                                                                          identical, same_training)
    return {"released": released, "grads_released": grads_released, "identical": identical,
            "same_training": same_training, **stats}


def main() -> None:
    init = full_state(build("qwen2", reinit()))
    results = {layout: run(layout, spec, init) for layout, spec in LAYOUTS.items()}
    if rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)


main()
