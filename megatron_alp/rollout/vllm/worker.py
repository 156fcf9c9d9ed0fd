"""What megatron-alp adds to vLLM's worker processes (``worker_extension_cls``).

vLLM imports this module in every worker, in process or in its engine's subprocesses: keep it
light. The import itself asks for the CPU's AMX tiles (:func:`enable_cpu_amx`), which vLLM's CPU
bf16 kernels need in every process that runs them.
"""

from __future__ import annotations

import torch

from megatron_alp.rollout.weight_broadcast import BroadcastReceiver
from megatron_alp.rollout.weight_sync import load_bucket


def enable_cpu_amx() -> None:
    """vLLM's CPU bf16 kernels use Intel AMX tiles, which Linux grants only to a process that asks
    (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); without it the first bf16 forward dies with SIGILL.
    Ask up front in every process that runs vLLM on the CPU (a no-op elsewhere)."""
    cpu = getattr(torch._C, "_cpu", None)
    if not torch.cuda.is_available() and hasattr(cpu, "_init_amx"):
        cpu._init_amx()


class WorkerExtension:
    """Mixed into vLLM's worker class: the receiving ends of the weight transports
    (:mod:`megatron_alp.rollout.vllm.transports`)."""

    def load_weight_bucket(self, handle: bytes) -> int:
        """Reload the weights of one bucket packed by :class:`BucketWriter` (whole layers)."""
        return load_bucket(handle, lambda weights: self.reload_weights(weights_iterator=weights))

    def join_weight_broadcast(self, spec: dict) -> None:
        """Join the replica leader's weight broadcast group (a new one after every engine start)."""
        self._weight_receiver = BroadcastReceiver(spec, self.rank)

    def receive_weight_bucket(self, header: tuple) -> int:
        """Receive one broadcast bucket (whole layers) and reload its weights."""
        receiver = getattr(self, "_weight_receiver", None)
        if receiver is None:
            raise RuntimeError("receive_weight_bucket before join_weight_broadcast")
        return receiver.receive(header, lambda weights: self.reload_weights(weights_iterator=weights))


enable_cpu_amx()
