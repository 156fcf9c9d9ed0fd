"""MoE routing replay over an RL iteration (``moe.routing_replay``, ``perturbation.moe_routing``).

Which experts each training pass of an iteration uses, and what it records (:class:`RoutingPlan`):

- **old-policy pass** (unperturbed): under ``r3`` it replays the engine's routing, carried from
  the trajectories in ``RLBatch.rollout_routing``; it always records the router's own choice in
  ``RLBatch.old_routing`` and measures its agreement with the engine's (``moe/rollout_agreement``).
- **reference pass**: replays ``old_routing`` under ``r2``, the engine's routing under ``r3``.
- **update pass** (ALP-perturbed): replays ``old_routing`` under ``r2``, the engine's under ``r3``,
  and ``old_routing`` without a replay when ``perturbation.moe_routing: fixed`` (so the noise
  cannot flip experts); without a replay ``perturbation.moe_routing: follow`` lets the perturbed
  router choose (with a replay it is refused: the update would drop the replayed experts). It logs how often the noise changed the router's own choice (``moe/noise_flip_frac``),
  how often the experts it used differ from those the unperturbed pass used
  (``moe/update_flip_frac``; 0 under ``fixed``), tokens per expert and the load-balancing loss.

The routing tensors are per sequence (the padded view of :class:`~megatron_alp.training.rl_batch.RLBatch`),
so they follow the rows through data-parallel sharding and mini-batches; every pass lays them out
for its own micro-batches (padded or packed rows, sequence-parallel shards, pipeline stages) with
:meth:`~megatron_alp.training.micro_batch.MicroBatch.layout`. Statistics count each token whose hidden
state reaches a predicted token (every position but a sequence's last) once per MoE layer.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_alp.config import Config
from megatron_alp.models.routing import MicroBatchRouting, RoutingControl, from_router, no_expert, routing_of, to_router
from megatron_alp.runtime.comm import comm_device
from megatron_alp.training.micro_batch import MicroBatch
from megatron_alp.training.rl_batch import RLBatch


@dataclass(frozen=True)
class PassRouting:
    """What one pass does with routing. ``replay``: the :class:`RLBatch` field whose experts it
    uses (``rollout_routing`` or ``old_routing``). ``record``: it writes the router's own choice to
    ``batch.old_routing``. ``agreement``: it measures its own choice against the engine's.
    ``flips``: it compares with the old-policy pass, whose replayed field was ``old_replay``.
    ``load``: it counts tokens per expert and the load-balancing loss terms."""

    replay: Optional[str] = None
    record: bool = False
    agreement: bool = False
    flips: bool = False
    old_replay: Optional[str] = None
    load: bool = False


@dataclass(frozen=True)
class RoutingPlan:
    """The :class:`PassRouting` of each pass of an iteration (see the module docstring)."""

    old: PassRouting
    ref: PassRouting
    update: PassRouting

    @property
    def needs_old_pass(self) -> bool:
        """Whether a pass replays the old-policy pass's routing, which must then run."""
        return "old_routing" in (self.ref.replay, self.update.replay)

    @classmethod
    def for_config(cls, cfg: Config) -> "RoutingPlan":
        replay = cfg.moe.routing_replay
        source = {"none": None, "r2": "old_routing", "r3": "rollout_routing"}[replay]
        perturbed = bool(cfg.perturbation.enabled)
        if perturbed and cfg.perturbation.moe_routing == "follow":  # only without a replay (resolve refuses it with one)
            update = None
        else:
            update = source or ("old_routing" if perturbed else None)
        old_replay = "rollout_routing" if replay == "r3" else None
        return cls(
            old=PassRouting(replay=old_replay, record=True, agreement=True),
            ref=PassRouting(replay=source),
            update=PassRouting(replay=update, flips=True, old_replay=old_replay, load=True),
        )


def _field(batch: RLBatch, name: str) -> torch.Tensor:
    value = getattr(batch, name)
    if value is None:
        where = ("the trajectories carry no engine routing: moe.routing_replay=r3 needs "
                 "rollout.return_routed_experts" if name == "rollout_routing"
                 else "the old-policy pass did not record it (compute_logprobs with RoutingPlan.old)")
        raise RuntimeError(f"routing replay of batch.{name}: {where}")
    return value


class _Pass:
    """One pass's per-micro-batch routing inputs and its records."""

    def __init__(self, control: RoutingControl, batch: RLBatch, routing: PassRouting):
        self.control, self.batch, self.routing = control, batch, routing
        self.records: list[tuple[MicroBatch, MicroBatchRouting]] = []
        if routing.replay is not None:
            values = _field(batch, routing.replay)
            bad = (values.long() >= control.num_experts) & (values != no_expert(values.dtype))
            if bool(bad.any()):
                raise ValueError(f"moe.routing_replay: batch.{routing.replay} names expert {int(values[bad].max())}, "
                                 f"but the model has {control.num_experts} experts")

    def _router(self, mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
        """``[n, L, layers, k]`` of the micro-batch's sequences -> this rank's router layout."""
        laid = mb.layout(self.control.local_layers(values), fill=no_expert(values.dtype))
        return to_router(laid, self.control.sequence_parallel)

    def begin(self, mb: MicroBatch) -> None:
        """Start micro-batch ``mb`` (on the model's device) on this stage's routers."""
        b, r = mb.batch, self.routing
        positions = torch.arange(b.tokens.shape[1], device=b.tokens.device)
        counted = positions < (b.lengths.to(positions.device) - 1).unsqueeze(1)  # every position but the last
        counted &= not mb.filler  # a repeat that keeps collectives in step is not counted again
        tokens = to_router(mb.layout(counted, fill=False), self.control.sequence_parallel)
        routing = MicroBatchRouting(tokens=tokens, load=r.load)
        if r.replay is not None:
            routing.replay = self._router(mb, getattr(b, r.replay))
        if r.agreement and b.rollout_routing is not None:
            routing.own_refs["rollout"] = self._router(mb, b.rollout_routing)
        if r.flips and b.old_routing is not None:
            routing.own_refs["noise"] = self._router(mb, b.old_routing)
            routing.used_refs["update"] = self._router(mb, self._old_used(b))
        self.control.begin_microbatch(routing)
        if r.record and not mb.filler:
            self.records.append((mb, routing))

    def _old_used(self, b: RLBatch) -> torch.Tensor:
        """The experts the old-policy pass used: what it replayed where given, its own elsewhere."""
        if self.routing.old_replay is None:
            return b.old_routing
        given = _field(b, self.routing.old_replay)
        replayed = (given.long() < self.control.num_experts).all(-1, keepdim=True)
        return torch.where(replayed, given.to(b.old_routing.dtype), b.old_routing)

    def finish(self) -> None:
        """Write the recorded routing into ``batch.old_routing`` (this stage's layers; the
        :func:`no_expert` marker elsewhere)."""
        if not self.routing.record:
            return
        c, b = self.control, self.batch
        out = torch.full((*b.tokens.shape, c.num_layers, c.topk), no_expert(c.dtype), dtype=c.dtype)
        for mb, routing in self.records:
            rows = mb.tokens.shape[0]
            own = torch.stack([routing.recorded[i] for i in range(len(c.layers))], dim=1)  # [t, layers, k]
            per_seq = mb.unpack(from_router(own, rows, c.sequence_parallel), fill=no_expert(c.dtype)).cpu()
            full = torch.full((*per_seq.shape[:2], c.num_layers, c.topk), no_expert(c.dtype), dtype=c.dtype)
            full[:, :, c.layers] = per_seq
            out[mb.rows.cpu(), : per_seq.shape[1]] = full
        b.old_routing = out


@contextlib.contextmanager
def routing_pass(model, batch: RLBatch, routing: Optional[PassRouting], *, training: bool) -> Iterator:
    """The routing of one pass of ``model`` over ``batch``: yields the function to call with each
    micro-batch before its forward (a no-op for a dense model or without ``routing``: the routers
    then choose as Megatron does). A recording pass sets ``batch.old_routing`` when it ends."""
    control = routing_of(model)
    if control is None or routing is None:
        yield lambda mb: None
        return
    state = _Pass(control, batch, routing)
    with control.pass_(training=training, record=routing.record,
                       stats=routing.agreement or routing.flips or routing.load):
        yield state.begin
    state.finish()


def routing_metrics(model) -> dict[str, float]:
    """The ``moe/*`` metrics of the statistics gathered since the last call, over all ranks (a
    collective on the default group: every rank calls it; {} for a dense model):

    - ``moe/rollout_agreement``: fraction of (token, layer) whose experts in the unperturbed
      old-policy pass, routed by the trainer's own router, are the set the engine chose;
    - ``moe/noise_flip_frac``: fraction whose perturbed router's own choice in the update pass
      differs from the unperturbed router's in the old-policy pass (what the ALP noise does to the
      router, whether or not the pass follows it);
    - ``moe/update_flip_frac``: fraction whose experts used in the update pass differ from those
      the old-policy pass used (0 under ``perturbation.moe_routing: fixed``);
    - ``moe/replayed_frac``: fraction of the update pass's tokens that took replayed experts;
    - ``moe/expert_load``: tokens of the busiest expert / mean tokens per expert, in the update
      pass, mean over layers (1 is perfectly even); ``moe/expert_load_worst_layer`` the largest;
    - ``moe/aux_loss``: Megatron's switch load-balancing loss with coefficient 1 over the
      iteration's update tokens, ``E / (k T^2) * sum_e P_e n_e`` (P_e: router probability mass,
      n_e: tokens of the router's own top-k), mean over layers; 1 is perfectly balanced. It is
      logged whatever ``moe.aux_loss_coeff`` is."""
    control = routing_of(model)
    if control is None:
        return {}
    stats = control.take_stats()
    names = ("rollout", "noise", "update", "replayed")
    keys = [f"{n}/{w}" for n in names for w in ("tokens", "agree")]
    device = comm_device()
    num_layers, num_experts = control.num_layers, control.num_experts
    if stats is None:
        scalars = torch.zeros(len(keys), dtype=torch.float64, device=device)
        per_layer = torch.zeros(3, num_layers, num_experts, dtype=torch.float64, device=device)
        layer_tokens = torch.zeros(num_layers, dtype=torch.float64, device=device)
    else:
        zero = torch.zeros((), dtype=torch.float64)
        scalars = torch.stack([stats.counts.get(k, zero).to(device) for k in keys])
        per_layer = torch.stack([stats.load, stats.prob_sum, stats.own_load]).to(device)
        layer_tokens = stats.layer_tokens.to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        for t in (scalars, per_layer, layer_tokens):
            dist.all_reduce(t)
    s = dict(zip(keys, scalars.tolist()))
    out = {}
    for name, key, flip in (("rollout", "moe/rollout_agreement", False), ("noise", "moe/noise_flip_frac", True),
                            ("update", "moe/update_flip_frac", True), ("replayed", "moe/replayed_frac", False)):
        if s[f"{name}/tokens"] > 0:
            agree = s[f"{name}/agree"] / s[f"{name}/tokens"]
            out[key] = 1.0 - agree if flip else agree
    load, prob_sum, own_load = per_layer
    seen = layer_tokens > 0
    if bool(seen.any()):
        ratio = load[seen].max(-1).values / load[seen].mean(-1)
        out["moe/expert_load"] = ratio.mean().item()
        out["moe/expert_load_worst_layer"] = ratio.max().item()
        if control.softmax:
            t = layer_tokens[seen]
            aux = num_experts / (control.topk * t * t) * (prob_sum[seen] * own_load[seen]).sum(-1)
            out["moe/aux_loss"] = aux.mean().item()
    return {k: v for k, v in out.items() if math.isfinite(v)}
