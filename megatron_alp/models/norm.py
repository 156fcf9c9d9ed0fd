"""RMSNorm for the Megatron-Core local layer spec that also works under sequence parallelism.

Megatron's ``WrappedTorchNorm`` refuses sequence parallelism (the SP-aware fused norms come from
apex / Transformer Engine, which need CUDA). This norm marks its weight ``sequence_parallel`` so
Megatron's ``finalize_model_grads`` sums its gradient over the tensor-parallel group, exactly as
it does for the fused norms.
"""

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.Module):
    """y = x / rms(x) * weight, computed in float32 like Hugging Face's RMSNorm."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(dtype)
