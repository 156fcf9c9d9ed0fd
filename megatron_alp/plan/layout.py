"""Where a run's ranks and engines sit: the parallel layout the plan counts on, and the GPUs it needs.

A colocated run has ``rollout.replicas`` engines beside the trainer's ranks, replica k on the
first ``rollout.tensor_parallel_size`` GPUs of the k-th block of world/replicas GPUs
(megatron_alp/rollout/placement.py; with ``auto`` every GPU). A run with ``rollout.placement:
separate`` keeps the two apart. Its GPU count (``--gpus``) is the trainer's world size, the GPUs
torchrun starts ranks on: ``nproc_per_node`` per node, on the node's first GPUs (default: the GPUs
below the first of ``rollout.gpus``); every node adds its ``rollout.gpus`` for the engines,
``tensor_parallel_size`` each (placement.py's rules).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from megatron_alp.config import Config, ConfigError
from megatron_alp.plan.architecture import Architecture
from megatron_alp.rollout.placement import auto_replicas, check_sync_placement, replica_layout




@dataclasses.dataclass(frozen=True)
class Layout:
    gpus: int  # the trainer's ranks, one GPU each
    tp: int
    pp: int
    ep: int
    etp: int
    sp: bool
    distributed_optimizer: bool
    rollout_tp: int
    replicas: int
    separate_gpus: tuple[int, ...] = ()  # placement: separate: rollout.gpus, the engines' GPUs of every node
    nodes: int = 1  # placement: separate: nodes of gpus // nodes trainer ranks each

    @classmethod
    def of(cls, cfg: Config, gpus: int, nproc_per_node: Optional[int] = None) -> "Layout":
        """``gpus`` trainer ranks; with ``placement: separate``, ``nproc_per_node`` of them per node
        (default: the GPUs below the first of ``rollout.gpus``), and the nodes' ``rollout.gpus`` beside."""
        p, r = cfg.parallel, cfg.rollout
        check_sync_placement(r, gpu=True)  # the plan is of a GPU job
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        replicas, separate, nodes = r.replicas, (), 1
        if r.placement == "separate":
            local = nproc_per_node or min([gpus, *r.gpus])
            if gpus % local:
                raise ConfigError(f"--gpus {gpus} trainer GPUs are not whole nodes of {local} trainer ranks "
                                  "(--nproc-per-node; default: the GPUs below the first of rollout.gpus)")
            if r.gpus and min(r.gpus) < local:
                raise ConfigError(f"rollout.gpus {r.gpus} overlap GPUs 0-{local - 1}, which the node's {local} "
                                  "trainer ranks use (placement: separate)")
            replicas = replica_layout(r, gpus, gpus, gpu=True, local_world=local).replicas
            separate, nodes = tuple(r.gpus), gpus // local
        elif replicas == "auto":
            replicas = auto_replicas(r, gpus, gpus // (tp * pp), gpu=True, local_world=gpus)
        return cls(gpus, tp, pp, p.expert_model_parallel_size, p.expert_tensor_parallel_size or tp,
                   p.sequence_parallel, p.use_distributed_optimizer, r.tensor_parallel_size, replicas, separate, nodes)

    @property
    def separate(self) -> bool:
        return bool(self.separate_gpus)

    @property
    def engine_gpu_count(self) -> int:
        """GPUs of the job that only the engines use (placement: separate), besides the trainer's."""
        return self.nodes * len(self.separate_gpus)

    @property
    def replica_stride(self) -> int:
        return self.gpus // self.replicas

    def stages_with_engine(self) -> list[int]:
        """Pipeline stages (Megatron orders ranks with PP outermost) that have a GPU holding an engine."""
        if self.separate:
            return []
        per_stage = self.gpus // self.pp
        return [s for s in range(self.pp)
                if any(g % self.replica_stride < self.rollout_tp for g in range(s * per_stage, (s + 1) * per_stage))]

    def engine_on_stage(self, first: bool) -> bool:
        """Whether the first (else the last) pipeline stage has a GPU holding an engine."""
        return (0 if first else self.pp - 1) in self.stages_with_engine()

    def stage_name(self, first: bool) -> str:
        """The GPU the plan counts the first (else the last) pipeline stage on."""
        return "GPU 0" if self.pp == 1 else "first pipeline stage" if first else "last pipeline stage"

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.gpus // (self.etp * self.ep * self.pp)

    def check(self, arch: Architecture) -> None:
        """Refuse a layout Megatron, vLLM or the GPU count cannot run, naming the keys."""
        rules = [
            (self.gpus % (self.tp * self.pp) == 0,
             f"--gpus {self.gpus} is not a multiple of parallel.tensor_model_parallel_size x "
             f"pipeline_model_parallel_size = {self.tp * self.pp}"),
            (not arch.experts or self.gpus % (self.etp * self.ep * self.pp) == 0,
             f"--gpus {self.gpus} is not a multiple of parallel.expert_tensor_parallel_size x "
             f"expert_model_parallel_size x pipeline_model_parallel_size = {self.etp * self.ep * self.pp}"),
            (arch.heads % self.tp == 0 and arch.kv_heads % self.tp == 0 and arch.vocab % self.tp == 0
             and (arch.experts or arch.ffn % self.tp == 0),
             f"parallel.tensor_model_parallel_size={self.tp} does not divide the model's heads "
             f"({arch.heads}), KV heads ({arch.kv_heads}), vocabulary ({arch.vocab}) or FFN ({arch.ffn})"),
            (arch.layers % self.pp == 0,
             f"parallel.pipeline_model_parallel_size={self.pp} does not divide the {arch.layers} layers"),
            (arch.experts % self.ep == 0 if arch.experts else self.ep == 1,
             f"parallel.expert_model_parallel_size={self.ep} does not divide the model's "
             f"{arch.experts or 'absent'} experts"),
            (arch.expert_ffn % self.etp == 0,
             f"parallel.expert_tensor_parallel_size={self.etp} does not divide the experts' FFN ({arch.expert_ffn})"),
            (not arch.experts or self.tp == 1 or self.sp,
             "parallel.sequence_parallel must be true for a mixture-of-experts model with TP > 1"),
            (arch.heads % self.rollout_tp == 0 and (self.separate or self.rollout_tp <= self.gpus),
             f"rollout.tensor_parallel_size={self.rollout_tp} must divide the model's {arch.heads} heads "
             + ("" if self.separate else f"and fit in --gpus {self.gpus}")),
            (self.separate or (self.gpus % self.replicas == 0 and self.replica_stride >= self.rollout_tp),
             f"rollout.replicas={self.replicas} must divide --gpus {self.gpus} into blocks of at least "
             f"rollout.tensor_parallel_size={self.rollout_tp} GPUs"),
        ]
        wrong = [msg for ok, msg in rules if not ok]
        if wrong:
            raise ConfigError("parallel layout cannot run:\n  " + "\n  ".join(wrong))

    def describe(self, moe: bool) -> str:
        parts = [f"TP{self.tp}" + (" (SP)" if self.sp else ""), f"PP{self.pp}"]
        if moe:
            parts.append(f"EP{self.ep} (expert TP{self.etp}, expert-DP{self.expert_dp})")
        parts.append(f"DP{self.dp}")
        opt = "distributed optimizer" if self.distributed_optimizer else "replicated optimizer"
        if self.separate:
            return (f"{' x '.join(parts)}, {opt}; {self.nodes} node{'s, each' if self.nodes > 1 else ''} with "
                    f"trainer ranks on GPUs 0-{self.gpus // self.nodes - 1} and rollout engines TP{self.rollout_tp} "
                    f"on rollout.gpus {list(self.separate_gpus)} ({self.replicas} replicas in all)")
        return f"{' x '.join(parts)}, {opt}; rollout engine TP{self.rollout_tp} on {self.engine_gpus}"

    @property
    def engine_gpus(self) -> str:
        first = "GPU 0" if self.rollout_tp == 1 else f"GPUs 0-{self.rollout_tp - 1}"
        if self.replicas == 1:
            return first
        if self.replica_stride == self.rollout_tp:
            return f"every GPU ({self.replicas} replicas)"
        return f"{first} of every {self.replica_stride} GPUs ({self.replicas} replicas)"


def default_gpus(cfg: Config) -> int:
    """The fewest GPUs the config's layout runs on (not its stated hardware: pass --gpus for that);
    with ``placement: separate`` the fewest trainer GPUs, enough to lead one node's engine replicas."""
    p, r = cfg.parallel, cfg.rollout
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    unit = math.lcm(p.tensor_model_parallel_size * p.pipeline_model_parallel_size,
                    etp * p.expert_model_parallel_size * p.pipeline_model_parallel_size)
    if r.placement == "separate":
        return math.lcm(unit, max(1, len(r.gpus) // r.tensor_parallel_size))
    return unit * math.ceil(r.tensor_parallel_size / unit)
