"""Expert routing of a Megatron-Core MoE model: replay given expert choices, record the router's own.

Megatron's ``TopKRouter`` hands its top-k selection to ``router.router_replay.get_replay_topk``
(megatron/core/transformer/moe/router_replay.py). :func:`attach_routing` puts a :class:`RouterTap`
in that slot on every router of a model. Outside a pass (:meth:`RoutingControl.pass_`) the tap
returns Megatron's own top-k, bit for bit. Inside a pass, for each micro-batch
(:meth:`RoutingControl.begin_microbatch`):

- **replay**: a token given experts uses them, with the router's current scores gathered at those
  experts as its gate weights (Megatron's REPLAY semantics: the gate stays differentiable, only
  the discrete choice is imposed); a token given none (its index is >= the number of experts, e.g.
  the sentinel of :func:`no_expert`) routes on its own;
- **record**: the router's own top-k of every token is kept in a compact dtype;
- **statistics** (:class:`RoutingStats`): agreement of the router's own choice, or of the experts
  used, with reference choices; tokens per expert; the load-balancing loss terms.

Why not Megatron's own ``RouterReplay``: it keeps its instances in one process-wide list (the
policy's and the reference model's routers mixed, in construction order) and expects the caller to
switch every router to ``REPLAY_BACKWARD`` around each backward so that recomputation pops the
right indices. The tap detects recomputation itself: a router called again after it has already
routed the current micro-batch is recomputing, and in pipeline schedules (1F1B) micro-batches are
recomputed in the order they ran forward. So in a training pass each tap queues the experts it used
per micro-batch (when the model recomputes its MoE layers) and a recomputation takes the oldest:
the backward uses exactly the forward's experts even where a recomputed router would choose
otherwise (non-deterministic kernels).

Layouts. Callers give per-token tensors in the micro-batch layout ``[r, T, layers, k]`` (rows x
positions x every layer of the model). A router sees Megatron's sequence-first activations
flattened (``[T, r]`` -> ``T * r`` tokens), under sequence parallelism only its TP rank's slice of
``T``, and only the layers of its pipeline stage: :func:`to_router` and :func:`from_router` convert.
Expert parallelism changes nothing here: every rank routes its own tokens before the dispatch.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.utils import unwrap_model

from megatron_alp.runtime.comm import comm_device


def routing_dtype(num_experts: int) -> torch.dtype:
    """The compact dtype of stored expert indices, with room for the :func:`no_expert` marker."""
    return torch.uint8 if num_experts < 255 else torch.int16


def no_expert(dtype: torch.dtype) -> int:
    """The marker of "no routing given" in a routing tensor of ``dtype`` (never an expert index)."""
    return torch.iinfo(dtype).max


def to_router(values: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """Micro-batch layout ``[r, T, ...]`` -> this rank's router tokens ``[T_local * r, ...]``."""
    x = values.transpose(0, 1)
    if sequence_parallel:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        n = x.shape[0] // tp
        x = x[rank * n: (rank + 1) * n]
    return x.reshape(-1, *x.shape[2:])


def from_router(values: torch.Tensor, rows: int, sequence_parallel: bool) -> torch.Tensor:
    """This rank's router tokens ``[T_local * r, ...]`` -> the micro-batch layout ``[r, T, ...]``,
    the sequence shards of the tensor-parallel group gathered (a collective on that group)."""
    x = values.reshape(-1, rows, *values.shape[1:])
    if sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
        group = ps.get_tensor_model_parallel_group()
        local = x.to(comm_device(group)).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        x = torch.cat(parts).to(values.device)
    return x.transpose(0, 1)


def same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether two ``[..., k]`` expert choices are the same set, per token."""
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


@dataclass
class MicroBatchRouting:
    """One micro-batch's routing inputs in the router layout, this stage's layers (``[t, layers, k]``).

    ``tokens`` marks the tokens statistics count (``[t]``). ``replay`` holds the experts to use
    (an index >= the number of experts: none given). ``own_refs`` / ``used_refs`` name reference
    choices compared with the router's own top-k / with the experts the pass used; a reference row
    with an index >= the number of experts is not counted. ``load``: count the replayed tokens,
    tokens per expert and the load-balancing loss terms."""

    tokens: torch.Tensor
    replay: Optional[torch.Tensor] = None
    load: bool = False
    own_refs: dict[str, torch.Tensor] = field(default_factory=dict)
    used_refs: dict[str, torch.Tensor] = field(default_factory=dict)
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)  # local layer -> own top-k [t, k]


class RoutingStats:
    """Sums over a pass's first forwards (never recomputations), kept on the device: for each
    reference name, the tokens compared and those that agree; the tokens whose experts were
    replayed; per global layer, tokens per expert (experts used), the router's probability mass per
    expert and its own top-k counts (the load-balancing loss terms)."""

    def __init__(self, num_layers: int, num_experts: int, topk: int, device):
        self.num_layers, self.num_experts, self.topk = num_layers, num_experts, topk
        self.counts: dict[str, torch.Tensor] = {}
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.prob_sum = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.own_load = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.layer_tokens = torch.zeros(num_layers, dtype=torch.float64, device=device)

    def count(self, name: str, value: torch.Tensor) -> None:
        v = value.to(torch.float64)
        self.counts[name] = self.counts[name] + v if name in self.counts else v

    def add_load(self, layer: int, used: torch.Tensor, own: torch.Tensor, probs: Optional[torch.Tensor]) -> None:
        ones = torch.ones(used.numel(), dtype=torch.float64, device=used.device)
        self.load[layer].scatter_add_(0, used.reshape(-1), ones)
        self.own_load[layer].scatter_add_(0, own.reshape(-1), ones)
        self.layer_tokens[layer] += used.shape[0]
        if probs is not None:
            self.prob_sum[layer] += probs.to(torch.float64).sum(0)


class RouterTap:
    """Takes the ``router_replay`` slot of one ``TopKRouter`` (see the module docstring)."""

    def __init__(self, control: "RoutingControl", router: TopKRouter):
        self.control = control
        self.layer = router.layer_number - 1  # 0-based, global over pipeline stages
        self.num_experts = router.config.num_moe_experts
        self.seen: Optional[int] = None  # the last micro-batch this router routed in the current pass
        self.queued: deque = deque()  # experts used per micro-batch, oldest first, for recomputation

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return self.control.route(self, scores, probs, own)


class RoutingControl:
    """The routers of one model chunk and the state of the current pass."""

    def __init__(self, model: torch.nn.Module):
        config = model.config
        self.sequence_parallel = config.sequence_parallel
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.num_layers = config.num_layers
        self.dtype = routing_dtype(self.num_experts)
        # the router's scores are logits (softmax after top-k) or softmax probabilities (before top-k)
        self.softmax = config.moe_router_score_function == "softmax"
        self.pre_softmax = config.moe_router_pre_softmax
        self.recomputes = config.recompute_granularity == "full" or (
            config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or ()))
        self.taps: list[RouterTap] = []
        for module in model.modules():
            if isinstance(module, TopKRouter):
                if config.moe_router_fusion:
                    raise ValueError("routing replay needs Megatron's unfused top-k (moe_router_fusion=False)")
                tap = RouterTap(self, module)
                module.router_replay = tap
                self.taps.append(tap)
        self.layers = sorted(t.layer for t in self.taps)  # this stage's MoE layers
        self._local = {layer: i for i, layer in enumerate(self.layers)}
        self._active = False
        self._training = False
        self._record = False
        self._collect = False
        self._current: Optional[MicroBatchRouting] = None
        self._index = -1
        self.stats: Optional[RoutingStats] = None  # the accumulated statistics, until taken

    def local_layers(self, per_layer: torch.Tensor) -> torch.Tensor:
        """``[..., num_layers, k]`` (every layer of the model) -> ``[..., this stage's layers, k]``."""
        return per_layer[..., self.layers, :]

    @contextlib.contextmanager
    def pass_(self, *, training: bool, record: bool = False, stats: bool = False) -> Iterator[None]:
        """One forward(-backward) pass over micro-batches, each started by :meth:`begin_microbatch`.
        ``training``: a backward follows (recomputation possible); ``record``: keep each router's own
        top-k in :attr:`MicroBatchRouting.recorded`; ``stats``: accumulate :class:`RoutingStats`."""
        self._active, self._training, self._record, self._collect = True, training, record, stats
        self._current, self._index = None, -1
        try:
            yield
        finally:
            self._active, self._current, self._collect = False, None, False
            for tap in self.taps:
                tap.seen = None
                tap.queued.clear()

    def begin_microbatch(self, routing: MicroBatchRouting) -> None:
        if not self._active:
            raise RuntimeError("begin_microbatch outside RoutingControl.pass_")
        self._current = routing
        self._index += 1

    def take_stats(self) -> Optional[RoutingStats]:
        stats, self.stats = self.stats, None
        return stats

    def route(self, tap: RouterTap, scores: torch.Tensor, probs: torch.Tensor, own: torch.Tensor):
        mb = self._current
        if mb is None:
            return probs, own
        if tap.seen == self._index:  # this router already routed the micro-batch: a recomputation
            if not tap.queued:
                raise RuntimeError(f"MoE layer {tap.layer}: a recomputed router found no recorded routing")
            used = tap.queued.popleft().to(own.device, torch.long)
            return scores.gather(1, used), used
        tap.seen = self._index
        i = self._local[tap.layer]
        used, replayed = own, None
        if mb.replay is not None:
            target = mb.replay[:, i].long()
            replayed = (target < tap.num_experts).all(-1)
            used = torch.where(replayed.unsqueeze(-1), target, own)
            probs = scores.gather(1, used)
        if self._training and self.recomputes:
            tap.queued.append(used.to(self.dtype))
        if self._record:
            mb.recorded[i] = own.to(self.dtype)
        if self._collect:
            self._add_stats(tap, mb, i, scores, own, used, replayed)
        return probs, used

    @torch.no_grad()
    def _add_stats(self, tap, mb: MicroBatchRouting, i: int, scores, own, used, replayed) -> None:
        if self.stats is None:
            self.stats = RoutingStats(self.num_layers, self.num_experts, self.topk, scores.device)
        s, keep = self.stats, mb.tokens
        for refs, mine in ((mb.own_refs, own), (mb.used_refs, used)):
            for name, ref in refs.items():
                target = ref[:, i].long()
                valid = keep & (target < tap.num_experts).all(-1)
                s.count(f"{name}/tokens", valid.sum())
                s.count(f"{name}/agree", (valid & same_experts(mine, target)).sum())
        if not mb.load:
            return
        if replayed is not None:
            s.count("replayed/tokens", keep.sum())
            s.count("replayed/agree", (keep & replayed).sum())
        probs = None
        if self.softmax:
            probs = scores[keep] if self.pre_softmax else torch.softmax(scores[keep].float(), dim=-1)
        s.add_load(tap.layer, used[keep], own[keep], probs)


def attach_routing(model: torch.nn.Module) -> Optional[RoutingControl]:
    """Put a :class:`RouterTap` on every router of a (single-stage) Megatron GPTModel; None for a
    dense model."""
    if not getattr(model.config, "num_moe_experts", None):
        return None
    control = RoutingControl(model)
    model.moe_routing = control
    return control


def routing_of(model) -> Optional[RoutingControl]:
    """The routing control of a model, looking through DDP / Float16Module wrappers; None if dense."""
    return getattr(unwrap_model(model), "moe_routing", None)
