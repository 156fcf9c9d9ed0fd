"""Helpers shared by the torchrun check scripts (run inside each rank)."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_alp.config import LoRAConfig, ModelConfig, ParallelConfig, PerturbationConfig
from megatron_alp.training.builder import build_gpt_model
from megatron_alp.models.families import hf_to_megatron
from megatron_alp.models.sharding import gather_tp, partition_dim_of, shard
from megatron_alp.models.tiny import tiny_hf_config
from megatron_alp.runtime.parallel import init_distributed


def reinit(tp: int = 1, pp: int = 1, sp: bool = False, seed: int = 1, ep: int = 1) -> ParallelConfig:
    """Switch Megatron's model-parallel layout inside a running torchrun job, and reseed its RNG
    tracker (the same layout keeps its groups: making them costs about 0.6 s on 2 cores)."""
    if ps.model_parallel_is_initialized() and _current_layout() != (tp, pp, ep):
        old = _megatron_groups()
        ps.destroy_model_parallel()
        # Megatron forgets its groups without destroying them: on the CPU every one is a gloo group
        # with threads of its own (about 50 per layout), which a job switching layouts dozens of times
        # would pile up by the thousand
        while old:
            group = old.pop()
            if group in dist.distributed_c10d._world.pg_map:
                dist.destroy_process_group(group)
            del group
        gc.collect()  # the groups' threads end with the last reference, some of them in cycles
    par = ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
        expert_model_parallel_size=ep,
    )
    init_distributed(par, seed=seed)
    return par


def _current_layout() -> tuple[int, int, int]:
    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size())


def _megatron_groups() -> list:
    """Every process group Megatron's parallel state holds (not the default group)."""
    default = dist.distributed_c10d._get_default_group()
    found: dict[int, dist.ProcessGroup] = {}

    def visit(value) -> None:
        if isinstance(value, dist.ProcessGroup):
            if value is not default:
                found[id(value)] = value
        elif isinstance(value, (list, tuple, set)):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)

    for value in list(vars(ps).values()):
        visit(value)
    return list(found.values())


def build(family: str, par: ParallelConfig, pert: PerturbationConfig | None = None, lora: LoRAConfig | None = None,
          **model_kw):
    args = hf_to_megatron(tiny_hf_config(family))
    mcfg = ModelConfig(**{"tiny": family, "dtype": "float32", "layer_spec": "local", **model_kw})
    return build_gpt_model(args, mcfg, par, pert, lora=lora)


def global_name(name: str, model) -> str:
    """Local pipeline-stage parameter name -> name in the single-stage model."""
    parts = name.split(".")
    if name.startswith("decoder.layers."):
        parts[2] = str(int(parts[2]) + model.decoder.layers[0].layer_number - 1)
    if "local_experts" in parts:
        i = parts.index("local_experts") + 1
        num_local = model.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
        parts[i] = str(ps.get_expert_model_parallel_rank() * num_local + int(parts[i]))
    return ".".join(parts)


def full_state(model) -> dict[str, torch.Tensor]:
    """Full (TP-gathered) parameters of this stage, keyed by single-stage names."""
    gated = model.config.gated_linear_unit
    out = {}
    for name, p in model.named_parameters():
        out[global_name(name, model)] = gather_tp(
            p.detach(), name, partition_dim_of(p), ps.get_tensor_model_parallel_group(), gated
        ).clone()
    return out


def load_full_state(model, full: dict[str, torch.Tensor]) -> None:
    gated = model.config.gated_linear_unit
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = global_name(name, model)
            if key not in full:
                continue
            p.copy_(shard(full[key], name, partition_dim_of(p), tp_rank, tp, gated))
        if model.share_embeddings_and_output_weights and ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage():
            model.output_layer.weight.copy_(
                shard(full["embedding.word_embeddings.weight"], "output_layer.weight", 0, tp_rank, tp, gated)
            )


def pipeline_logits(model, tokens: torch.Tensor, hook=None) -> torch.Tensor | None:
    """Forward-only through the pipeline; full-vocab logits [b, s, V] on the last stage, else None."""
    b, s = tokens.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, -1)

    def step(data_iter, m):
        batch = next(data_iter)
        if hook:
            hook(m)
        out = m(batch, position_ids, None)
        return out, None

    outs = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter([tokens]), model=[model], num_microbatches=1,
        seq_length=s, micro_batch_size=b, forward_only=True,
    )
    if not ps.is_pipeline_last_stage():
        return None
    logits = outs[0]
    return gather_tp(logits.contiguous(), "logits", logits.dim() - 1, ps.get_tensor_model_parallel_group(), False)


def tokens(b: int = 2, s: int = 12, vocab: int = 512, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (b, s), generator=g)


def rank() -> int:
    return dist.get_rank()


def run_command(argv: list[str], out_dir, name: str) -> dict:
    """``megatron-alp *argv`` in this one-rank process, as its own process would run it (a command that
    needs more ranks launches them itself); what reached descriptors 1 and 2 (the launched ranks'
    included) is kept in ``out_dir/name.out`` / ``.err``. Returns ``{"rc", "out", "err"}``."""
    import os
    import sys
    from pathlib import Path

    from megatron_alp.cli import main

    out_dir = Path(out_dir)
    paths = out_dir / f"{name}.out", out_dir / f"{name}.err"
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):  # a command makes its own group
        if not dist.is_initialized():
            os.environ.pop(key, None)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    files = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for p in paths]
    os.dup2(files[0], 1)
    os.dup2(files[1], 2)
    try:
        rc = main(list(argv))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, *files):
            os.close(fd)
    return {"rc": rc, "out": paths[0].read_text(), "err": paths[1].read_text()}
