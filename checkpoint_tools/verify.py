"""Compare the logits of an HF model and a Megatron checkpoint on a fixed batch.

Both sides run in float32 (bf16 weights upcast exactly), so the difference measures the
conversion and the two implementations' arithmetic, not storage precision. The Megatron side
runs under any TP/PP/EP layout through Megatron's pipeline schedule. A LoRA checkpoint runs with
its adapters, so it matches its merged HF export (``mcore-to-hf``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_alp.runtime.comm import comm_device
from megatron_alp.runtime.console import say
from megatron_alp.runtime.platform import device
from megatron_alp.training.export import checkpoint_lora, weightless_model

DEFAULT_TOL = 1e-4


def fixed_batch(vocab_size: int, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=g)


def hf_logits(hf_dir, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def megatron_logits(model, tokens: torch.Tensor):
    """Full-vocabulary logits [b, s, V] on the last pipeline stage's ranks, None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_alp.models.sharding import gather_tp

    b, s = tokens.shape
    tokens = tokens.to(device())
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, -1)
    model.eval()

    def step(data_iter, m):
        return m(next(data_iter), position_ids, None), None

    with torch.no_grad():
        outs = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([tokens]), model=[model], num_microbatches=1,
            seq_length=s, micro_batch_size=b, forward_only=True,
        )
    if not ps.is_pipeline_last_stage():
        return None
    logits = outs[0].float()
    return gather_tp(logits.contiguous(), "logits", logits.dim() - 1, ps.get_tensor_model_parallel_group(),
                     False).cpu()


def verify(hf_dir, mcore_dir, parallel, *, layer_spec: str = "auto", tol: float = DEFAULT_TOL, base_dir=None) -> float:
    """Max |logit difference|, reduced over ranks; prints it on rank 0. Raises if above ``tol``.
    ``base_dir``: a LoRA checkpoint's base folder, if not the recorded one."""
    import torch.distributed as dist

    from megatron_alp.models.families import load_hf_config
    from megatron_alp.runtime.parallel import init_distributed
    from megatron_alp.training.dist_checkpoint import load_checkpoint, read_metadata

    hf_config = load_hf_config(hf_dir)
    read_metadata(mcore_dir)
    init_distributed(parallel)
    model = weightless_model(hf_config, parallel, "float32", layer_spec, source=str(mcore_dir),
                             lora=checkpoint_lora(mcore_dir))
    load_checkpoint(mcore_dir, model, base_dir=base_dir)
    tokens = fixed_batch(int(hf_config["vocab_size"]))
    logits = megatron_logits(model, tokens)
    diff = torch.zeros(())
    if logits is not None:  # both on the CPU: the HF model runs there
        diff = (logits - hf_logits(hf_dir, tokens)).abs().max().reshape(())
    if dist.is_initialized():
        diff = diff.to(comm_device())
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    value = diff.item()
    if not dist.is_initialized() or dist.get_rank() == 0:
        ok = value <= tol
        say(f"verify {Path(hf_dir)} vs {Path(mcore_dir)}: max |logit diff| = {value:.3e} "
            f"on {tuple(tokens.shape)} tokens ({'OK' if ok else 'FAILED'}, tolerance {tol:g})")
    if value > tol:
        raise ValueError(f"max |logit diff| {value:.3e} exceeds the tolerance {tol:g}")
    return value
